"""qkv.pos: sinusoidal, learned, RoPE (against HF transformers), ALiBi (paper values, BLOOM), T5 buckets
(HF T5) and Shaw relative positions (against a float64 definition)."""

from __future__ import annotations

import doctest
import importlib
import math
import warnings

import pytest
import torch

import qkv
from qkv import pos
from qkv.testing import assert_within_budget

F64 = torch.float64


@pytest.mark.parametrize("d", [1, 7, 16], ids=lambda d: f"d{d}")
def test_sinusoidal_matches_formula(d):
    pe = pos.sinusoidal_encoding(50, d, dtype=F64)
    want = torch.empty(50, d, dtype=F64)
    for p in range(50):
        for c in range(d):
            i = c // 2
            angle = p / 10000 ** (2 * i / d)
            want[p, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    assert torch.allclose(pe, want, atol=1e-12), (pe - want).abs().max()


def test_sinusoidal_batched_positions_and_padding():
    positions = torch.tensor([[3, 4, -1], [0, 1, 2]])
    pe = pos.sinusoidal_encoding(positions, 8)
    assert pe.shape == (2, 3, 8)
    table = pos.sinusoidal_encoding(10, 8)
    assert torch.equal(pe[0, :2], table[3:5]) and torch.equal(pe[0, 2], table[0])


def test_learned_table_raises_past_its_length():
    emb = pos.LearnedPositionalEmbedding(8, 4)
    assert emb(torch.arange(8)).shape == (8, 4)
    assert torch.equal(emb(torch.tensor([-1])), emb(torch.tensor([0])))
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        emb(torch.arange(9))


def _hf_llama_rope(scaling, *, theta=500.0, max_pos=64, head_dim=64, partial=None):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kw = dict(hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=max_pos, rope_theta=theta)
    if scaling:
        kw["rope_scaling"] = dict(scaling)
    if partial is not None:
        kw["partial_rotary_factor"] = partial
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        cfg = transformers.LlamaConfig(**kw)
        return cfg, LlamaRotaryEmbedding(cfg)


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
             "beta_slow": 1},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("n", [40, 300], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_cos_sin_and_rotation_match_hf(case, n):
    apply_rotary_pos_emb = pytest.importorskip("transformers.models.llama.modeling_llama").apply_rotary_pos_emb

    cfg, hf = _hf_llama_rope(ROPE_CASES[case])
    ours = pos.RotaryEmbedding.from_config(cfg)
    assert ours.attention_scaling == pytest.approx(hf.attention_scaling)
    positions = torch.arange(n).unsqueeze(0)
    cos_hf, sin_hf = hf(torch.zeros(1, n, 64), positions)
    cos, sin = ours.cos_sin(positions)
    # HF forms angles in float32, ours in float64: the gap is float32 rounding of angles up to n.
    tol = 4 * n * 2.0 ** -24 + 1e-6
    assert (cos - cos_hf).abs().max() <= tol and (sin - sin_hf).abs().max() <= tol, (case, n)
    q = torch.randn(1, 2, n, 64)
    q_hf, _ = apply_rotary_pos_emb(q, q, cos_hf, sin_hf)
    err = (ours.apply(q, positions) - q_hf).abs().max()
    assert err <= 8 * tol * q.abs().max(), f"{case}: rotation differs from HF by {err:.3e}"


def test_rope_dynamic_only_rescales_past_max_positions():
    rope = pos.RotaryEmbedding(16, scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=32)
    plain = pos.RotaryEmbedding(16)
    short = torch.arange(32)
    assert torch.equal(rope.cos_sin(short)[0], plain.cos_sin(short)[0])
    assert not torch.allclose(rope.cos_sin(torch.arange(64))[0][:32], plain.cos_sin(short)[0])


def test_rope_partial_rotary_matches_hf_and_passes_channels_through():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, partial_rotary_factor=0.25,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})
    inv_hf, _ = ROPE_INIT_FUNCTIONS["linear"](cfg)
    ours = pos.RotaryEmbedding.from_config(cfg)
    assert ours.rotary_dim == 16
    assert torch.allclose(ours.inv_freq().float(), inv_hf, rtol=1e-6)
    x = torch.randn(2, 2, 5, 64)
    y = ours.apply(x, torch.arange(5) + 3)
    assert torch.equal(y[..., 16:], x[..., 16:])
    assert not torch.allclose(y[..., :16], x[..., :16])


def test_rope_interleaved_matches_gptj():
    pytest.importorskip("transformers")
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    rotary_dim, head_dim, n = 16, 32, 12
    table = create_sinusoidal_positions(64, rotary_dim)  # (P, R) = [sin | cos]
    positions = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], list(range(n))])
    sin, cos = table[positions].chunk(2, dim=-1)  # (B, N, R/2)
    x = torch.randn(2, 3, n, head_dim)  # (B, H, N, D)
    x_nhd = x.transpose(1, 2)  # GPT-J works in (B, N, H, D)
    want = torch.cat((apply_rotary_pos_emb(x_nhd[..., :rotary_dim], sin, cos), x_nhd[..., rotary_dim:]), -1)
    rope = pos.RotaryEmbedding.from_config({"head_dim": head_dim, "rotary_dim": rotary_dim}, interleaved=True)
    got = rope.apply(x, positions).transpose(1, 2)
    assert (got - want).abs().max() < 1e-5


def test_rope_layouts_are_a_channel_permutation_of_each_other():
    R = 8
    perm = torch.cat((torch.arange(0, R, 2), torch.arange(1, R, 2)))  # interleaved -> rotate-half order
    x = torch.randn(1, 2, 6, R, dtype=F64)
    inter = pos.RotaryEmbedding(R, interleaved=True).apply(x)
    half = pos.RotaryEmbedding(R).apply(x[..., perm])
    assert torch.allclose(inter[..., perm], half, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_rope_scores_depend_only_on_relative_position(interleaved):
    g = torch.Generator().manual_seed(0)
    rope = pos.RotaryEmbedding(32, interleaved=interleaved, theta=1000.0)
    q, k = torch.randn(1, 1, 1, 32, dtype=F64, generator=g), torch.randn(1, 1, 1, 32, dtype=F64, generator=g)
    for i, j, shift in [(5, 2, 11), (0, 7, 100), (40, 40, 3), (3, 9, 1000)]:
        s = (rope.apply(q, torch.tensor([i])) * rope.apply(k, torch.tensor([j]))).sum()
        s2 = (rope.apply(q, torch.tensor([i + shift])) * rope.apply(k, torch.tensor([j + shift]))).sum()
        assert abs(float(s - s2)) < 1e-9, (i, j, shift)
    s_a = (rope.apply(q, torch.tensor([5])) * rope.apply(k, torch.tensor([2]))).sum()
    s_b = (rope.apply(q, torch.tensor([5])) * rope.apply(k, torch.tensor([3]))).sum()
    assert abs(float(s_a - s_b)) > 1e-6  # the test can fail: other distances give other scores


def test_rope_batched_and_negative_positions():
    rope = pos.RotaryEmbedding(8)
    x = torch.randn(2, 2, 3, 8)
    positions = torch.tensor([[-1, 0, 1], [4, 5, 6]])
    y = rope.apply(x, positions)
    assert torch.equal(y[0, :, :2], rope.apply(x[:1, :, :2], torch.tensor([0, 0]))[0])
    assert torch.allclose(y[1], rope.apply(x[1:], torch.tensor([4, 5, 6]))[0])
    assert torch.isfinite(y).all()


def test_rope_low_precision_and_float64():
    rope = pos.RotaryEmbedding(16)
    x = torch.randn(1, 2, 20, 16, dtype=F64)
    ref = rope.apply(x, torch.arange(20) + 1000)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        out = rope.apply(x.to(dt), torch.arange(20) + 1000)
        assert out.dtype == dt
        # baseline: eager rotate-half entirely in the low precision, with low-precision cos/sin
        c, s = rope.cos_sin(torch.arange(20) + 1000, dtype=dt)
        xd = x.to(dt)
        base = xd * c + torch.cat((-xd[..., 8:], xd[..., :8]), dim=-1) * s
        assert_within_budget(out, ref, base, what=f"rope {dt}")


def test_rope_from_config_variants_and_errors():
    nested = {"head_dim": 16, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    full = pos.RotaryEmbedding.from_config(nested, layer_type="full_attention")
    local = pos.RotaryEmbedding.from_config(nested, layer_type="sliding_attention")
    assert (full.rope_type, full.theta, local.theta) == ("linear", 1e6, 1e4)
    assert pos.RotaryEmbedding.from_config({"hidden_size": 64, "num_attention_heads": 4}).rotary_dim == 16
    with pytest.raises(ValueError, match="unsupported rope_type"):
        pos.RotaryEmbedding(16, scaling={"rope_type": "bogus"})
    with pytest.raises(ValueError, match="needs 'factor'"):
        pos.RotaryEmbedding(16, scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match="even"):
        pos.RotaryEmbedding(15)
    with pytest.raises(ValueError, match="shape"):
        pos.RotaryEmbedding(8).apply(torch.randn(1, 1, 4, 8), torch.arange(5))


def test_alibi_slopes_paper_values():
    assert pos.alibi_slopes(8).tolist() == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    want12 = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -(i / 2) for i in (1, 3, 5, 7)]
    assert torch.allclose(pos.alibi_slopes(12, dtype=F64), torch.tensor(want12, dtype=F64), rtol=1e-15)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 8, 12, 16, 24, 40, 71], ids=lambda h: f"H{h}")
def test_alibi_slopes_match_bloom(heads):
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bloom = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32).view(heads, 2)[:, 1]  # slope * position 1
    assert torch.allclose(pos.alibi_slopes(heads), bloom, rtol=1e-6), (pos.alibi_slopes(heads), bloom)


def test_alibi_bias_with_positions_equals_operator_convention():
    mod = pos.ALiBiBias(4)
    nq, nk = 3, 7
    plain = mod().dense_bias(1, 4, nq, nk, dtype=F64)
    q_pos = (torch.arange(nq) + nk - nq).unsqueeze(0)
    by_pos = mod(q_positions=q_pos, kv_positions=torch.arange(nk).unsqueeze(0)).dense_bias(1, 4, nq, nk, dtype=F64)
    assert torch.equal(plain, by_pos)
    assert float(plain[0, 0, 0, 0]) == -0.25 * 4  # query at position 4, key at 0, slope 1/4


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 20), (64, 256), (4, 5)],
                         ids=["b32-max128", "b8-max20", "b64-max256", "b4-max5"])
def test_t5_bucket_matches_hf(bidirectional, buckets, max_distance):
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-600, 601).view(-1, 1) + torch.zeros(1, 3, dtype=torch.long)
    want = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=buckets,
                                                 max_distance=max_distance)
    got = pos.t5_bucket(rel, bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance)
    assert torch.equal(got, want)
    assert int(got.min()) >= 0 and int(got.max()) < buckets


def test_t5_bias_in_attention_matches_definition_and_positions():
    g = torch.Generator().manual_seed(1)
    rel = pos.T5RelativeBias(2, num_buckets=8, max_distance=16, bidirectional=False).double()
    q, k, v = (torch.randn(2, 2, 5, 8, dtype=F64, generator=g) for _ in range(3))
    out = qkv.attention(q, k, v, mask=qkv.masks.causal(), score_mod=rel(), backend="reference")
    i = torch.arange(5).view(-1, 1)
    bucket = pos.t5_bucket(torch.arange(5).view(1, -1) - i, bidirectional=False, num_buckets=8, max_distance=16)
    s = q @ k.transpose(-1, -2) / math.sqrt(8) + rel.weight[bucket].permute(2, 0, 1)
    s = s.masked_fill(torch.arange(5).view(1, -1) > i, float("-inf"))
    assert torch.allclose(out, s.softmax(-1) @ v, atol=1e-12)
    p = torch.arange(5).expand(2, 5)
    by_pos = qkv.attention(q, k, v, mask=qkv.masks.causal(), score_mod=rel(q_positions=p, kv_positions=p))
    assert torch.allclose(out, by_pos, atol=1e-12)


def _shaw_definition(q, k, v, rel_k, rel_v, kk, causal):
    nq, nk = q.shape[2], k.shape[2]
    idx = (torch.arange(nk).view(1, -1) - (torch.arange(nq).view(-1, 1) + nk - nq)).clamp(-kk, kk) + kk  # (Nq, Nk)
    ak = rel_k[idx]  # (Nq, Nk, D)
    s = (q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, ak)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.arange(nk).view(1, -1) > torch.arange(nq).view(-1, 1) + nk - nq, float("-inf"))
    p = s.softmax(-1)
    out = p @ v
    if rel_v is not None:
        out = out + torch.einsum("bhij,ijd->bhid", p, rel_v[idx])
    return out


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("values", [False, True], ids=["keys", "keys+values"])
@pytest.mark.parametrize("nq,nk", [(7, 7), (3, 9)], ids=["Nq7-Nk7", "Nq3-Nk9"])
def test_shaw_matches_definition(backend, values, nq, nk):
    g = torch.Generator().manual_seed(2)
    kk = 2
    q = torch.randn(2, 4, nq, 8, dtype=F64, generator=g, requires_grad=True)
    k, v = torch.randn(2, 4, nk, 8, dtype=F64, generator=g), torch.randn(2, 4, nk, 8, dtype=F64, generator=g)
    rel_k = torch.randn(2 * kk + 1, 8, dtype=F64, generator=g, requires_grad=True)
    rel_v = torch.randn(2 * kk + 1, 8, dtype=F64, generator=g, requires_grad=True) if values else None
    want = _shaw_definition(q, k, v, rel_k, rel_v, kk, causal=True)
    got = pos.shaw_attention(q.float(), k.float(), v.float(), max_distance=kk, rel_k=rel_k.float(),
                             rel_v=None if rel_v is None else rel_v.float(), mask=qkv.masks.causal(), backend=backend)
    base = _shaw_definition(q.float(), k.float(), v.float(), rel_k.float(), None if rel_v is None else rel_v.float(),
                            kk, causal=True)
    assert_within_budget(got, want, base, what=f"shaw {backend}")
    got64 = pos.shaw_attention(q, k, v, max_distance=kk, rel_k=rel_k, rel_v=rel_v, mask=qkv.masks.causal(),
                               backend="reference")
    gw = torch.autograd.grad(want.sum(), [q, rel_k])
    gg = torch.autograd.grad(got64.sum(), [q, rel_k])
    for a, b in zip(gg, gw):
        assert torch.allclose(a, b, atol=1e-10)


def test_shaw_key_table_is_linear_in_n_and_positions_agree():
    q = torch.randn(1, 2, 50, 8)
    mod = pos.shaw_key_bias(q, torch.randn(7, 8), max_distance=3)
    assert tuple(mod.table.shape) == (1, 2, 50, 7)  # O(N k), not (N, N)
    p = torch.arange(50).unsqueeze(0)
    by_pos = pos.shaw_key_bias(q, torch.randn(7, 8), max_distance=3, q_positions=p, kv_positions=p)
    by_pos.table = mod.table
    assert torch.equal(mod.dense_bias(1, 2, 50, 50), by_pos.dense_bias(1, 2, 50, 50))


def test_shaw_module_learns_and_reports_errors():
    shaw = pos.ShawRelativePosition(8, 2, values=True)
    q = k = v = torch.randn(1, 2, 5, 8)
    shaw.attend(q, k, v).sum().backward()
    assert shaw.rel_k.grad is not None and shaw.rel_v.grad is not None
    with pytest.raises(ValueError, match="needs the queries"):
        shaw()
    with pytest.raises(ValueError, match="rel_k"):
        pos.shaw_key_bias(q, torch.randn(4, 8), max_distance=2)


@pytest.mark.parametrize("name", ["__init__", "sinusoidal", "learned", "rope", "alibi", "relative"])
def test_docstring_examples_run(name):
    module = importlib.import_module("qkv.pos" if name == "__init__" else f"qkv.pos.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,R,batched", [((1, 10, 1, 64), 64, False), ((2, 8, 3, 96), 32, True),
                                             ((1, 1, 1, 32), 16, True), ((3, 4, 5, 6), 2, False),
                                             ((2, 8, 33, 128), 128, True), ((1, 2, 40, 64), 40, False)])
@pytest.mark.parametrize("transposed", [False, True], ids=["bhnd", "bnhd"])
def test_apply_rotary_compiled_equals_the_torch_ops_bit_for_bit(dtype, interleaved, shape, R, batched, transposed,
                                                                 monkeypatch):
    """On the CPU without a gradient, apply_rotary given qkv.cpu.fused.rotary runs one call of qkv's compiled kernels
    (float32/float64: one vectorized pass; else the same torch ops in the same order); it equals the Python ops exactly
    (QKV_CPU_KERNELS=0), partial rotation, both pair layouts and a projection's transposed layout included, and rotates
    by the definition (float64) within budget."""
    from qkv.cpu import kernels
    from qkv.cpu.fused import rotary
    from qkv.pos.rope import apply_rotary

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(*shape, generator=g).to(dtype)
    if transposed:  # (B, N, H, D) memory, as a projection's heads are split
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    B, _, N, D = shape
    angle = torch.rand(*((B, N) if batched else (N,)), R // 2, generator=g, dtype=torch.float64) * 6
    angle = angle.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angle, angle), dim=-1)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = angle.cos().to(work), angle.sin().to(work)
    with torch.inference_mode():
        assert rotary(x, cos, sin, interleaved) is not None  # the compiled call runs these
        got = apply_rotary(x, cos, sin, interleaved=interleaved, kernel=rotary)
        monkeypatch.setenv(kernels.ENV, "0")
        want = apply_rotary(x, cos, sin, interleaved=interleaved, kernel=rotary)
    assert got.dtype == dtype and torch.equal(got, want)
    xd = x.double()
    c, s = angle.cos().unsqueeze(-3), angle.sin().unsqueeze(-3)
    a, b = (xd[..., 0:R:2], xd[..., 1:R:2]) if interleaved else (xd[..., :R // 2], xd[..., R // 2:R])
    ca, sa = (c[..., 0::2], s[..., 0::2]) if interleaved else (c[..., :R // 2], s[..., :R // 2])
    ra, rb = a * ca - b * sa, b * ca + a * sa  # each pair turned by its angle
    ref = xd.clone()
    if interleaved:
        ref[..., 0:R:2], ref[..., 1:R:2] = ra, rb
    else:
        ref[..., :R // 2], ref[..., R // 2:R] = ra, rb
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # the output's rounding
    torch.testing.assert_close(got.double(), ref, atol=tol * 8, rtol=tol)
