"""qkv.nn.MultiHeadAttention: equivariance, GQA == repeated KV, equality with torch.nn.MultiheadAttention,
parameter counts, masks and positions, the KV-cache protocol, backends."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks, pos
from qkv.cache.protocol import AttentionCache, CacheView
from qkv.nn import MultiHeadAttention
from qkv.testing import assert_within_budget

F64 = torch.float64


def _backends():
    names = qkv.backends.names()
    assert {"reference", "sdpa"} <= set(names)
    return [b for b in ("reference", "sdpa", "tiled") if b in names]


class ConcatCache(AttentionCache):
    """The smallest protocol cache: keeps every key (rotated at its absolute position) and value; the
    protocol's no-op defaults cover ``observe``/``prepare``.

    ``newest_first`` stores slots in reverse arrival order, so masking must go by position, not slot index.
    """

    @property
    def seq_length(self) -> int:
        return max((p.shape[-1] for _, _, p in self.kv.values()), default=0)

    def __init__(self, newest_first: bool = False) -> None:
        self.newest_first = newest_first
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cross_computed = 0

    def update(self, layer_idx, k, v, *, positions, rope=None):
        if rope is not None:
            k = rope(k, positions)
        if layer_idx in self.kv:
            k0, v0, p0 = self.kv[layer_idx]
            parts = ((k, k0), (v, v0), (positions, p0)) if self.newest_first else ((k0, k), (v0, v), (p0, positions))
            k, v, p = (torch.cat(pair, dim=-2 if i < 2 else -1) for i, pair in enumerate(parts))
        else:
            p = positions
        self.kv[layer_idx] = (k, v, p)
        return CacheView(k, v, p, positions)

    def cross_kv(self, layer_idx, compute):
        if layer_idx not in self.cross:
            self.cross_computed += 1
            self.cross[layer_idx] = compute()
        return self.cross[layer_idx]


def test_concat_cache_follows_the_protocol():
    assert isinstance(ConcatCache(), AttentionCache)


def _copy_from_torch(ours: MultiHeadAttention, ref: torch.nn.MultiheadAttention) -> None:
    d = ref.embed_dim
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            wq, wk, wv = ref.in_proj_weight.split(d)
        else:
            wq, wk, wv = ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight
        bq, bk, bv = ref.in_proj_bias.split(d)
        for lin, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv),
                          (ours.o_proj, ref.out_proj.weight, ref.out_proj.bias)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross-kdim24"])
def test_equals_torch_multihead_attention(cross):
    torch.manual_seed(0)
    d, h, nq, nk = 32, 4, 9, 13 if cross else 9
    kdim = 24 if cross else d
    ref = torch.nn.MultiheadAttention(d, h, batch_first=True, kdim=kdim, vdim=kdim).double()
    ours = MultiHeadAttention(d, h, kv_dim=kdim, cross=cross).double()
    _copy_from_torch(ours, ref)
    x = torch.randn(3, nq, d, dtype=F64)
    ctx = torch.randn(3, nk, kdim, dtype=F64) if cross else x
    lengths = torch.tensor([nk, 4, 1])
    key_padding = torch.arange(nk).view(1, -1) >= lengths.view(-1, 1)  # torch: True = ignore
    want = ref(x, ctx, ctx, key_padding_mask=key_padding, need_weights=False)[0]
    base = ref.float()(x.float(), ctx.float(), ctx.float(), key_padding_mask=key_padding, need_weights=False)[0]
    ours.float()
    for backend in _backends():
        ours.backend = backend
        got = ours(x.float(), ctx.float() if cross else None, mask=masks.padding(lengths)).out
        assert_within_budget(got, want, base, what=f"MHA vs torch ({backend})")


def test_permutation_equivariant_without_positions_and_not_when_causal():
    torch.manual_seed(1)
    x = torch.randn(2, 11, 32, dtype=F64)
    perm = torch.randperm(11)
    attn = MultiHeadAttention(32, 4).double()
    assert torch.allclose(attn(x[:, perm]).out, attn(x).out[:, perm], atol=1e-12)
    causal = MultiHeadAttention(32, 4, causal=True).double()
    causal.load_state_dict(attn.state_dict())
    assert (causal(x[:, perm]).out - causal(x).out[:, perm]).abs().max() > 1e-3


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["GQA-Hkv2", "MQA-Hkv1"])
def test_gqa_equals_mha_with_repeated_kv_weights(n_kv_heads):
    torch.manual_seed(2)
    d, h, D = 48, 8, 6
    gqa = MultiHeadAttention(d, h, n_kv_heads=n_kv_heads, rope=pos.RotaryEmbedding(D), causal=True).double()
    mha = MultiHeadAttention(d, h, rope=pos.RotaryEmbedding(D), causal=True).double()
    group = h // n_kv_heads
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(src.weight.view(n_kv_heads, D, d).repeat_interleave(group, 0).reshape(h * D, d))
            dst.bias.copy_(src.bias.view(n_kv_heads, D).repeat_interleave(group, 0).reshape(h * D))
    x = torch.randn(2, 10, d, dtype=F64)
    assert torch.allclose(gqa(x).out, mha(x).out, atol=1e-12)
    assert sum(p.numel() for p in gqa.parameters()) < sum(p.numel() for p in mha.parameters())


@pytest.mark.parametrize("d", [16, 64], ids=lambda d: f"d{d}")
def test_projection_parameter_count(d):
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(MultiHeadAttention(d, 4)) == 4 * d * d + 4 * d
    assert count(MultiHeadAttention(d, 4, bias=False)) == 4 * d * d
    qwen = MultiHeadAttention(d, 4, bias={"q": True, "k": True, "v": True})
    assert count(qwen) == 4 * d * d + 3 * d and qwen.o_proj.bias is None


def test_qk_norm_makes_scores_invariant_to_projection_scale():
    torch.manual_seed(3)
    x = torch.randn(2, 7, 32, dtype=F64)
    attn = MultiHeadAttention(32, 4, bias=False, qk_norm="rms", qk_norm_eps=1e-30).double()
    out = attn(x).out
    with torch.no_grad():
        attn.q_proj.weight.mul_(7.0)
        attn.k_proj.weight.mul_(0.1)
    assert torch.allclose(attn(x).out, out, atol=1e-9)
    plain = MultiHeadAttention(32, 4, bias=False).double()
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if "norm" not in k})
    assert not torch.allclose(plain(x).out, out, atol=1e-3)


def test_causal_and_window_locality():
    torch.manual_seed(4)
    x = torch.randn(1, 12, 16, dtype=F64)
    y = x.clone()
    y[:, 8:] += 1.0  # change the future of token 7
    causal = MultiHeadAttention(16, 2, causal=True).double()
    assert torch.allclose(causal(x).out[:, :8], causal(y).out[:, :8], atol=1e-12)
    assert not torch.allclose(causal(x).out[:, 8:], causal(y).out[:, 8:])
    local = MultiHeadAttention(16, 2, causal=True, window=3).double()
    z = x.clone()
    z[:, :5] -= 1.0  # tokens 0..4 are outside the 3-key window of tokens 7..11
    assert torch.allclose(local(x).out[:, 7:], local(z).out[:, 7:], atol=1e-12)
    assert not torch.allclose(local(x).out[:, 5:7], local(z).out[:, 5:7])


SCHEMES = {
    "rope": lambda: dict(rope=pos.RotaryEmbedding(8, theta=100.0)),
    "alibi": lambda: dict(position_bias=pos.ALiBiBias(4)),
    "t5": lambda: dict(position_bias=pos.T5RelativeBias(4, num_buckets=8, max_distance=16, bidirectional=False)),
    "shaw": lambda: dict(position_bias=pos.ShawRelativePosition(8, 2, values=True)),
    "window": lambda: dict(rope=pos.RotaryEmbedding(8), window=4),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_left_padding_with_positions_equals_unpadded(scheme):
    torch.manual_seed(5)
    attn = MultiHeadAttention(32, 4, causal=True, **SCHEMES[scheme]()).double()
    x = torch.randn(1, 6, 32, dtype=F64)
    padded = torch.cat((torch.randn(1, 3, 32, dtype=F64), x), dim=1)
    positions = torch.tensor([[-1, -1, -1, 0, 1, 2, 3, 4, 5]])
    got = attn(padded, positions=positions).out[:, 3:]
    assert torch.allclose(got, attn(x).out, atol=1e-12)


@pytest.mark.parametrize("newest_first", [False, True], ids=["in-order-slots", "reversed-slots"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_cached_decode_equals_full_recompute(scheme, newest_first):
    torch.manual_seed(6)
    attn = MultiHeadAttention(32, 4, n_kv_heads=2, causal=True, layer_idx=3, **SCHEMES[scheme]()).double()
    x = torch.randn(2, 9, 32, dtype=F64)
    full = attn(x).out
    cache = ConcatCache(newest_first=newest_first)
    steps = [attn(x[:, :5], positions=torch.arange(5).expand(2, 5), cache=cache).out]
    for t in range(5, 9):
        steps.append(attn(x[:, t:t + 1], positions=torch.full((2, 1), t), cache=cache).out)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-12)
    assert set(cache.kv) == {3}


def test_cross_attention_computes_context_kv_once_with_a_cache():
    torch.manual_seed(7)
    attn = MultiHeadAttention(32, 4, kv_dim=20, cross=True, layer_idx=1).double()
    x, ctx = torch.randn(2, 6, 32, dtype=F64), torch.randn(2, 5, 20, dtype=F64)
    mask = masks.padding(torch.tensor([5, 2]))
    full = attn(x, ctx, mask=mask).out
    cache = ConcatCache()
    first = attn(x[:, :2], ctx, mask=mask, cache=cache).out
    rest = attn(x[:, 2:], None, mask=mask, cache=cache).out
    assert cache.cross_computed == 1
    assert torch.allclose(torch.cat((first, rest), 1), full, atol=1e-12)


@pytest.mark.parametrize("scheme", ["rope", "t5", "alibi"])
def test_backends_agree_within_budget(scheme):
    torch.manual_seed(8)
    attn = MultiHeadAttention(32, 4, causal=True, **SCHEMES[scheme]())
    x = torch.randn(2, 13, 32)
    mask = masks.padding(torch.tensor([13, 8]))
    attn64 = MultiHeadAttention(32, 4, causal=True, **SCHEMES[scheme]()).double()
    attn64.load_state_dict(attn.state_dict())
    attn64.backend = "reference"
    want = attn64(x.double(), mask=mask).out
    attn.backend = "reference"
    base = attn(x, mask=mask).out  # the float32 eager baseline; the reference backend is not a candidate here
    for backend in [b for b in _backends() if b != "reference"]:
        attn.backend = backend
        assert_within_budget(attn(x, mask=mask).out, want, base, what=f"{scheme} on {backend}")


def test_need_lse_and_dropout():
    torch.manual_seed(9)
    attn = MultiHeadAttention(32, 4, causal=True, dropout=0.5)
    x = torch.randn(2, 6, 32)
    attn.eval()
    res = attn(x, need_lse=True)
    assert res.lse.shape == (2, 4, 6) and res.lse.dtype == torch.float32 and torch.isfinite(res.lse).all()
    assert attn(x).lse is None and torch.allclose(res.out, attn(x).out, atol=1e-6)
    attn.train()
    assert not torch.allclose(attn(x).out, res.out)


def test_argument_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        MultiHeadAttention(32, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="window needs causal"):
        MultiHeadAttention(32, 4, window=4)
    with pytest.raises(ValueError, match="cross attention takes no"):
        MultiHeadAttention(32, 4, cross=True, causal=True)
    with pytest.raises(TypeError, match="PositionalBias"):
        MultiHeadAttention(32, 4, position_bias=qkv.mods.softcap(5.0))
    attn = MultiHeadAttention(32, 4, causal=True)
    with pytest.raises(ValueError, match="cross=True"):
        attn(torch.randn(1, 3, 32), torch.randn(1, 3, 32))
    with pytest.raises(ValueError, match="needs positions"):
        attn(torch.randn(1, 3, 32), cache=ConcatCache())
    with pytest.raises(ValueError, match=r"\(B, N, d_model=32\)"):
        attn(torch.randn(1, 3, 16))
