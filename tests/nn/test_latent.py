"""Multi-head latent attention (``qkv.nn.latent``): absorbed == expanded (forward and backward), the
latent-only cache, cached decode == full recompute, and parity with HF transformers' DeepseekV2Attention and
(without positions, NoPE) KimiLinearAttention."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from _helpers import eager_same_dtype
from qkv import masks
from qkv.cache import KVCache
from qkv.cache.protocol import LatentView
from qkv.costs import mla_kv_bytes_per_token
from qkv.nn.latent import (
    LatentAttention,
    LatentConfig,
    crossover_queries,
    mla_absorbed,
    mla_expanded,
    path_flops,
)
from qkv.testing import DEFAULT_FLOOR, assert_within_budget

F64 = torch.float64


def _config(q_lora_rank=None, **kw) -> LatentConfig:
    # Awkward sizes on purpose: 3 heads, rope 6, v != nope.
    base = dict(hidden_size=40, num_attention_heads=3, kv_lora_rank=20, q_lora_rank=q_lora_rank,
                qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=7, attention_bias=True)
    base.update(kw)
    return LatentConfig(**base)


def _master(cfg: LatentConfig, seed: int = 0) -> LatentAttention:
    """A float64 module with every parameter random (norm gains too, so a missing norm fails)."""
    torch.manual_seed(seed)
    m = LatentAttention(cfg, dtype=F64)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "layernorm" in name else torch.randn_like(p) / math.sqrt(
                p.shape[-1]))
    return m


def _cast(m: LatentAttention, dtype) -> LatentAttention:
    """A copy in ``dtype``; the float64 master is rounded through ``dtype`` so all copies hold equal values."""
    out = copy.deepcopy(m).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(dtype).to(F64))
    return out


class _ConcatLatentCache:
    """A minimal, autograd-friendly latent cache (torch.cat per step): lets gradients flow into the cached
    prefix, which a real cache (in-place buffers) deliberately does not."""

    def __init__(self):
        self.c_kv = self.k_rope = self.pos = None

    def update_latent(self, layer_idx, c_kv, k_rope, *, positions, rope=None):
        if rope is not None:
            k_rope = rope(k_rope.unsqueeze(1), positions.clamp_min(0)).squeeze(1)
        if self.c_kv is None:
            self.c_kv, self.k_rope, self.pos = c_kv, k_rope, positions
        else:
            self.c_kv = torch.cat((self.c_kv, c_kv), 1)
            self.k_rope = torch.cat((self.k_rope, k_rope), 1)
            self.pos = torch.cat((self.pos, positions), 1)
        return LatentView(self.c_kv, self.k_rope, self.pos, positions)


def _eager_expanded(m: LatentAttention, x_prefix, x_new):
    """Plain eager MLA in the inputs' dtype (decompressed K/V, scores and softmax in that dtype): the
    error-budget baseline. Written from the paper's equations, independently of the module's paths."""
    c = m.config
    x = x_new if x_prefix is None else torch.cat((x_prefix, x_new), 1)
    B, N, Nq = x.shape[0], x.shape[1], x_new.shape[1]
    H, r, dn, dr, dv = c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q = m.q_proj(x_new) if c.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x_new)))
    q = q.view(B, Nq, H, dn + dr).transpose(1, 2)
    latent, k_rope = m.kv_a_proj_with_mqa(x).split([r, dr], -1)
    kv = m.kv_b_proj(m.kv_a_layernorm(latent)).view(B, N, H, dn + dv).transpose(1, 2)
    pos = torch.arange(N)
    q_rope = m.rope(q[..., dn:], pos[N - Nq:])
    k_rope = m.rope(k_rope.unsqueeze(1), pos).expand(B, H, N, dr)
    q = torch.cat((q[..., :dn], q_rope), -1)
    k = torch.cat((kv[..., :dn], k_rope), -1)
    out = eager_same_dtype(q, k, kv[..., dn:], mask=masks.causal(), scale=c.softmax_scale)
    return m.o_proj(out.transpose(1, 2).reshape(B, Nq, H * dv))


def _run(m: LatentAttention, x_prefix, x_new, path: str, g):
    """``sum(out * g)`` and its gradients w.r.t. both inputs and every parameter, for the new tokens'
    output: ``path`` is ``"eager"`` (:func:`_eager_expanded`) or a module path, which runs the prefix (if
    any) into a concat cache and then ``x_new`` over it."""
    m.zero_grad(set_to_none=True)
    xs = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x_prefix, x_new)]
    xp, xn = xs
    B, Nn = xn.shape[:2]
    if path == "eager":
        out = _eager_expanded(m, xp, xn)
    elif xp is None:
        out = m(xn, path=path).out
    else:
        Np = xp.shape[1]
        cache = _ConcatLatentCache()
        m(xp, positions=torch.arange(Np).expand(B, Np), cache=cache, path="expanded")
        out = m(xn, positions=torch.arange(Np, Np + Nn).expand(B, Nn), cache=cache, path=path).out
    (out * g.to(out.dtype)).sum().backward()
    grads = {"x_new": xn.grad}
    if xp is not None:
        grads["x_prefix"] = xp.grad
    grads.update({n: p.grad for n, p in m.named_parameters()})
    return out, grads


def _floor(dtype, ref) -> float:
    """The default floor at the reference's scale. Weight gradients here reach |g| ~ 10, where one bfloat16
    ulp (0.06) exceeds the absolute default (8e-3, about 2 ulp at 1) and a lucky baseline (a bias gradient
    is a plain sum over tokens) would leave no allowance for rounding that cannot be avoided."""
    return DEFAULT_FLOOR[dtype] * max(1.0, float(ref.detach().abs().max()))


SCENARIOS = {
    "prefill-B2-N13": (0, 13),  # Nq == Nk, causal
    "decode-B2-Nq3-Nk12": (9, 3),  # a chunk over a cache
    "decode-B2-Nq1-Nk12": (11, 1),  # one token over a cache
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["q_proj", "q_lora16"])
def test_absorbed_matches_expanded(q_lora_rank, scenario, dtype):
    """Both paths, forward and gradients (both inputs, every parameter), against plain eager MLA (written
    from the paper, independent of both paths) on the float64 weights, each within the budget set by the
    same eager MLA in the candidate's dtype. In float64 (where the eager baseline is itself exact) this asks
    the two paths to agree with the eager reference to the floor, 1e-12."""
    cfg = _config(q_lora_rank)
    n_prefix, n_new = SCENARIOS[scenario]
    master = _master(cfg, seed=3)
    m = _cast(master, dtype)
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(2, n_prefix + n_new, cfg.hidden_size, generator=gen, dtype=F64).to(dtype).to(F64)
    g = torch.randn(2, n_new, cfg.hidden_size, generator=gen, dtype=F64).to(dtype).to(F64)
    xp, xn = (x_all[:, :n_prefix] if n_prefix else None), x_all[:, n_prefix:]
    cast = (lambda t: None if t is None else t.to(dtype))
    ref, ref_g = _run(master, xp, xn, "eager", g)
    base, base_g = _run(m, cast(xp), cast(xn), "eager", g)
    for path in ("absorbed", "expanded"):
        cand, cand_g = _run(m, cast(xp), cast(xn), path, g)
        assert cand.dtype == dtype
        assert_within_budget(cand, ref, base, floor=_floor(dtype, ref), what=f"{path} output {scenario} {dtype}")
        assert set(cand_g) == set(ref_g) and all(v is not None for v in cand_g.values())
        for name in ref_g:
            assert_within_budget(cand_g[name], ref_g[name], base_g[name], floor=_floor(dtype, ref_g[name]),
                                 what=f"{path} grad {name} {scenario} {dtype}")


def test_paths_are_exact_in_float64():
    """In float64 the two paths differ only by rounding: a defect in either would show here at 1e-3."""
    m = _master(_config(16), seed=5)
    x = torch.randn(2, 9, 40, dtype=F64)
    a, e = m(x, path="absorbed").out, m(x, path="expanded").out
    assert (a - e).abs().max() < 1e-12 * e.abs().max(), f"max diff {(a - e).abs().max():.3e}"


@pytest.mark.parametrize("case", ["window-mask", "padding-rows", "bidirectional"])
def test_absorbed_matches_expanded_functional(case):
    """``window-mask``: an extra mask keeps the (B, H, Nq) multi-query layout instead of stacking heads.
    ``padding-rows``: positions -1 (padding queries and keys) under the stacked layout give zero rows,
    ``lse = -inf`` and no NaN, in both paths. ``bidirectional``: no mask at all. Forward, lse and
    gradients of every input agree."""
    torch.manual_seed(0)
    B, H, Nq, Nk, dn, dr, dv, r = 2, 3, 4, 11, 5, 4, 6, 9
    leaves = (torch.randn(B, H, Nq, dn, dtype=F64), torch.randn(B, H, Nq, dr, dtype=F64),
              torch.randn(B, Nk, r, dtype=F64), torch.randn(B, Nk, dr, dtype=F64),
              torch.randn(H * (dn + dv), r, dtype=F64) / 3)
    q_pos = torch.arange(Nk - Nq, Nk).repeat(B, 1)
    kv_pos = torch.arange(Nk).repeat(B, 1)
    extra, causal = None, True
    if case == "window-mask":
        extra = masks.sliding_window(3)
    elif case == "padding-rows":
        q_pos[1, :2] = -1
        kv_pos[1, 7:] = -1
    else:
        q_pos = kv_pos = None
        causal = False
    results = {}
    for name, fn in (("expanded", mla_expanded), ("absorbed", mla_absorbed)):
        ins = [t.clone().requires_grad_(True) for t in leaves]
        res = fn(*ins, q_positions=q_pos, kv_positions=kv_pos, causal=causal, mask=extra, return_lse=True)
        res.out.sum().backward()
        results[name] = (res.out, res.lse, [t.grad for t in ins])
    (e_out, e_lse, e_grads), (a_out, a_lse, a_grads) = results["expanded"], results["absorbed"]
    assert not torch.isnan(a_out).any() and not torch.isnan(e_out).any()
    assert torch.allclose(a_out, e_out, atol=1e-12), f"out differs by {(a_out - e_out).abs().max():.3e}"
    assert torch.equal(torch.isinf(a_lse), torch.isinf(e_lse))
    fin = torch.isfinite(e_lse)
    assert torch.allclose(a_lse[fin].double(), e_lse[fin].double(), atol=1e-5)
    for i, (ga, gb) in enumerate(zip(a_grads, e_grads)):
        assert not torch.isnan(ga).any()
        assert torch.allclose(ga, gb, atol=1e-11), f"grad of input {i} differs by {(ga - gb).abs().max():.3e}"
    if case == "padding-rows":
        assert a_out[1, :, :2].abs().max() == 0 and torch.isinf(a_lse[1, :, :2]).all()


def test_folded_heads_match_unfolded_layout():
    """Stacking the H query heads as rows of one kv head (positions tiled) equals the MQA layout."""
    torch.manual_seed(1)
    B, H, Nq, Nk, dn, dr, dv, r = 2, 4, 3, 8, 5, 4, 6, 9
    args = (torch.randn(B, H, Nq, dn, dtype=F64), torch.randn(B, H, Nq, dr, dtype=F64),
            torch.randn(B, Nk, r, dtype=F64), torch.randn(B, Nk, dr, dtype=F64),
            torch.randn(H * (dn + dv), r, dtype=F64))
    q_pos, kv_pos = torch.tensor([[5, 6, 7], [3, 4, -1]]), torch.tensor([list(range(8)), [0, 1, 2, 3, 4, -1, -1, -1]])
    folded = mla_absorbed(*args, q_positions=q_pos, kv_positions=kv_pos)
    mqa = mla_absorbed(*args, q_positions=q_pos, kv_positions=kv_pos, mask=masks.padding(Nk))  # no-op extra mask
    expanded = mla_expanded(*args, q_positions=q_pos, kv_positions=kv_pos)
    assert torch.allclose(folded.out, mqa.out, atol=1e-12) and torch.allclose(folded.out, expanded.out, atol=1e-12)
    assert folded.out[1, :, 2].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cache_holds_only_latent_and_rope_key(dtype):
    """Per token and layer the cache stores ``kv_lora_rank + qk_rope_head_dim`` elements, never per-head K/V."""
    cfg = _config(16)
    m = _cast(_master(cfg), dtype)
    written = []

    class Spy:  # no update(): calling the K/V path would raise
        def __init__(self, inner):
            self.inner = inner

        def update_latent(self, layer_idx, c_kv, k_rope, **kw):
            written.append((c_kv, k_rope))
            view = self.inner.update_latent(layer_idx, c_kv, k_rope, **kw)
            written.append(view)
            return view

    cache = KVCache([m.cache_spec()])
    spy = Spy(cache)
    B, N = 2, 9
    x = torch.randn(B, N + 3, cfg.hidden_size).to(dtype)
    with torch.no_grad():
        m(x[:, :N], positions=torch.arange(N), cache=spy)
        for t in range(N, N + 3):
            m(x[:, t:t + 1], positions=torch.tensor([t]), cache=spy)
    expect = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()
    for c_kv, k_rope in written[0::2]:  # what the module handed over: (B, n, r) and (B, n, dr), nothing per head
        assert c_kv.shape[-1] == cfg.kv_lora_rank and k_rope.shape[-1] == cfg.qk_rope_head_dim
        assert c_kv.dim() == k_rope.dim() == 3
    view = written[-1]
    tokens = view.c_kv.shape[1]
    assert tokens == N + 3 and view.kv_positions.shape == (B, tokens)
    measured_row = view.c_kv.shape[-1] * view.c_kv.element_size() + view.k_rope.shape[-1] * view.k_rope.element_size()
    used = cache.memory().layers[0].used_bytes
    assert measured_row == expect, f"stored row {measured_row} B != {expect} B"
    assert used == B * tokens * expect, f"cache uses {used} B for {B}x{tokens} tokens, expected {expect} B each"
    assert m.cache_spec().bytes_per_token(dtype) == expect == mla_kv_bytes_per_token(
        cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype])
    expanded_row = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * view.c_kv.element_size()
    assert expect < expanded_row


@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["q_proj", "q_lora16"])
def test_cached_decode_equals_full_recompute(q_lora_rank):
    cfg = _config(q_lora_rank)
    master = _master(cfg, seed=7)
    m = _cast(master, torch.float32)
    B, N, n_prompt = 2, 13, 7
    x64 = torch.randn(B, N, cfg.hidden_size, dtype=F64).float().double()
    pos = torch.arange(N).repeat(B, 1)
    pos[1] = torch.arange(N) - 2  # row 1: two left-padding tokens (position -1 is padding; -2 clamps too)
    pos[1, :2] = -1
    with torch.no_grad():
        ref = master(x64, positions=pos).out
        base = m(x64.float(), positions=pos).out
        cache = KVCache([m.cache_spec()])
        steps = [m(x64[:, :n_prompt].float(), positions=pos[:, :n_prompt], cache=cache)]
        for t in range(n_prompt, N):
            steps.append(m(x64[:, t:t + 1].float(), positions=pos[:, t:t + 1], cache=cache))
    assert [s.path for s in steps] == ["expanded"] + ["absorbed"] * (N - n_prompt)
    out = torch.cat([s.out for s in steps], dim=1)
    assert not torch.isnan(out).any()
    assert_within_budget(out, ref, base, what="cached decode vs full recompute")


def test_explain_path_and_crossover():
    cfg = LatentConfig(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512)
    m = LatentAttention(cfg, causal=False, device="meta")
    n_star = crossover_queries(cfg)
    assert abs(n_star - 512 * 256 / 768) < 1e-9
    nk = 10**6
    below, above = math.floor(n_star), math.ceil(n_star)
    assert below * nk / (nk - below) < n_star < above * nk / (nk - above)
    assert m.explain_path(below, nk).path == "absorbed" and m.explain_path(above, nk).path == "expanded"
    causal = LatentAttention(cfg, device="meta")
    decode, prefill = causal.explain_path(1, 32768), causal.explain_path(4096, 4096)
    assert decode.path == "absorbed" and prefill.path == "expanded"
    assert decode.expanded_flops > 100 * decode.absorbed_flops
    assert (decode.expanded_flops, decode.absorbed_flops) == path_flops(cfg, 1, 32768)
    text = str(decode)
    assert "absorbed" in text and "GFLOP" in text and "N*=170.7" in text
    assert causal.explain_path(1, 10, path="expanded").path == "expanded"
    assert "forced" in causal.explain_path(1, 10, path="expanded").reason


def test_config_from_hf_deepseek_v2_json():
    """The hub's DeepSeek-V2 config.json (transformers 4 names: ``rope_scaling`` with ``type``): YaRN's
    ``mscale_all_dim`` multiplies the softmax scale by ``(0.1 * 0.707 * ln 40 + 1) ** 2``."""
    cfg = LatentConfig.from_hf({
        "hidden_size": 5120, "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
        "max_position_embeddings": 163840, "attention_bias": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}})
    assert cfg.rope_type == "yarn" and cfg.q_lora_rank == 1536 and cfg.qk_head_dim == 192
    assert math.isclose(cfg.softmax_scale, 192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2, rel_tol=1e-12)
    plain = LatentConfig.from_hf({"hidden_size": 8, "num_attention_heads": 2, "kv_lora_rank": 4,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})
    assert plain.rope_scaling is None and plain.rope_theta == 500.0 and plain.softmax_scale == 192 ** -0.5


def test_errors_name_the_fix():
    m = LatentAttention(_config())
    x = torch.randn(1, 3, 40)
    with pytest.raises(ValueError, match="path must be one of"):
        m(x, path="fast")
    with pytest.raises(TypeError, match="update_latent"):
        m(x, positions=torch.arange(3), cache=object())
    with pytest.raises(ValueError, match="needs positions"):
        m(x, cache=KVCache([m.cache_spec()]))
    with pytest.raises(ValueError, match=r"\(B, N, hidden_size=40\)"):
        m(torch.randn(1, 3, 41))
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        _config(qk_rope_head_dim=5)
    with pytest.raises(TypeError, match="LatentConfig"):
        LatentAttention({"hidden_size": 40})


HF_CASES = {
    "q_proj": dict(q_lora_rank=None, attention_bias=False, rope=None),
    "q_lora-bias": dict(q_lora_rank=24, attention_bias=True, rope=None),
    "q_lora-yarn-mscale": dict(q_lora_rank=24, attention_bias=False,
                               rope={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 16, "mscale": 1.0,
                                     "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_parity_with_hf_deepseek_v2_attention(case):
    hf = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")
    from transformers import DeepseekV2Config

    spec = HF_CASES[case]
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              q_lora_rank=spec["q_lora_rank"], qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
              attention_bias=spec["attention_bias"], max_position_embeddings=64, num_hidden_layers=1, vocab_size=16,
              intermediate_size=32, moe_intermediate_size=16, n_routed_experts=2, attn_implementation="eager")
    if spec["rope"] is not None:
        kw["rope_parameters"] = spec["rope"]
    hf_cfg = DeepseekV2Config(**kw)
    torch.manual_seed(0)
    theirs = hf.DeepseekV2Attention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "layernorm" in name else 0.2 * torch.randn_like(p))
    rotary = hf.DeepseekV2RotaryEmbedding(hf_cfg)
    B, N, offset = 2, 11, 5
    x = torch.randn(B, N, 64)
    position_ids = (torch.arange(N) + offset).expand(B, N)
    causal = torch.full((N, N), float("-inf")).triu(1)[None, None]

    def hf_forward(module, inp):
        with torch.no_grad():
            return module(inp, attention_mask=causal.to(inp.dtype), position_embeddings=rotary(inp, position_ids))[0]

    ref = hf_forward(copy.deepcopy(theirs).double(), x.double())  # HF rotates in float32 even then
    base = hf_forward(theirs, x)

    cfg = LatentConfig.from_hf(hf_cfg)
    ours = LatentAttention(cfg).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)  # same parameter names, nothing to rename
    with torch.no_grad():
        for path in ("expanded", "absorbed"):
            out = ours(x, positions=position_ids, path=path).out
            assert_within_budget(out, ref, base, what=f"{case} {path} vs HF DeepseekV2Attention")
        cache = KVCache([ours.cache_spec()])
        prompt = ours(x[:, :8], positions=position_ids[:, :8], cache=cache)
        steps = [ours(x[:, t:t + 1], positions=position_ids[:, t:t + 1], cache=cache) for t in range(8, N)]
    decoded = torch.cat([prompt.out] + [s.out for s in steps], dim=1)
    assert [s.path for s in steps] == ["absorbed"] * (N - 8)
    assert_within_budget(decoded, ref, base, what=f"{case} cached decode vs HF DeepseekV2Attention")
    if spec["rope"] is not None:
        assert cfg.softmax_scale != cfg.qk_head_dim ** -0.5  # the mscale_all_dim adjustment is exercised


def test_parity_with_hf_kimi_linear_nope_attention():
    """Kimi Linear's MLA rotates nothing: both paths and a cached decode against HF's KimiLinearAttention, and the
    layer is blind to positions (shifted positions give the same output)."""
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig

    hf_cfg = KimiLinearConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_hidden_layers=1,
                              vocab_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              attn_implementation="eager")
    torch.manual_seed(0)
    theirs = hf.KimiLinearAttention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "layernorm" in name else 0.3 * torch.randn_like(p))
    B, N = 2, 11
    x = torch.randn(B, N, 64)
    causal = torch.full((N, N), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = theirs.double()(x.double(), attention_mask=causal.double())[0]
        base = theirs.float()(x, attention_mask=causal)[0]
    cfg = LatentConfig.from_hf(hf_cfg)
    assert not cfg.use_rope and cfg.softmax_scale == cfg.qk_head_dim ** -0.5
    ours = LatentAttention(cfg).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    with torch.no_grad():
        for path in ("expanded", "absorbed"):
            for offset in (0, 7):
                out = ours(x, positions=torch.arange(N) + offset, path=path).out
                assert_within_budget(out, ref, base, what=f"NoPE {path} offset {offset} vs HF KimiLinearAttention")
        cache = KVCache([ours.cache_spec()])
        prompt = ours(x[:, :8], positions=torch.arange(8), cache=cache)
        steps = [ours(x[:, t:t + 1], positions=torch.tensor([t]), cache=cache) for t in range(8, N)]
    assert "nope" in repr(ours)
    assert_within_budget(torch.cat([prompt.out] + [s.out for s in steps], dim=1), ref, base,
                         what="NoPE cached decode vs HF KimiLinearAttention")


def test_nope_config_errors_name_the_fix():
    cfg = _config(use_rope=False)
    with pytest.raises(ValueError, match="use_rope is False"):
        LatentAttention(cfg, rope=lambda t, pos: t)
    with pytest.raises(ValueError, match="rope_scaling must be None"):
        _config(use_rope=False, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(TypeError, match="use_rope must be a bool"):
        _config(use_rope="no")
    assert _config(use_rope=False, qk_rope_head_dim=5).qk_rope_head_dim == 5  # nothing rotates: odd widths are fine
    from qkv.nn import DecoderConfig

    kw = dict(vocab_size=10, hidden_size=40, num_hidden_layers=1, num_attention_heads=3, intermediate_size=8)
    with pytest.raises(ValueError, match=r"needs position='none' \(its use_rope is False: NoPE\), got position='rope'"):
        DecoderConfig(**kw, latent=cfg)
    with pytest.raises(ValueError, match=r"needs position='rope', got position='none'"):
        DecoderConfig(**kw, latent=_config(), position="none")
    assert DecoderConfig(**kw, latent=cfg, position="none").latent.use_rope is False
    with pytest.raises(ValueError, match="mla_use_nope=False"):
        LatentConfig.from_hf({"model_type": "kimi_linear", "hidden_size": 8, "num_attention_heads": 2,
                              "kv_lora_rank": 4, "mla_use_nope": False})
