"""Gated linear attention and the gated delta rule: four forms against the float64 reference, both gate shapes,
grouped key heads, state carry, gradients (including g and beta), large decays, HF's own torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.linear import (
    LinearAttentionOutput,
    gated_delta_chunked,
    gated_delta_parallel,
    gated_delta_recurrent,
    gated_delta_step,
    gated_linear_chunked,
    gated_linear_parallel,
    gated_linear_recurrent,
    gated_linear_step,
)
from qkv.testing import assert_within_budget

# (B, Hk, H, N, Dk, Dv): one token, awkward lengths, grouped key heads (H = 2 Hk), Dv != Dk.
CASES = [(1, 1, 1, 1, 8, 8), (2, 2, 2, 63, 8, 8), (1, 1, 2, 113, 16, 8), (2, 2, 4, 64, 8, 12)]
GATES = ["head", "channel"]


def case_id(c) -> str:
    B, Hk, H, N, Dk, Dv = c
    return f"B{B}-Hk{Hk}-H{H}-N{N}-Dk{Dk}" + (f"-Dv{Dv}" if Dv != Dk else "")


def _inputs(B, Hk, H, N, Dk, Dv, *, gate="head", seed=0, decay=1.0):
    """float64 inputs as the models feed them: unit-norm keys, log-decays <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hk, N, Dk, generator=gen, dtype=torch.float64) * Dk ** -0.5
    k = F.normalize(torch.randn(B, Hk, N, Dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, N, Dv, generator=gen, dtype=torch.float64)
    shape = (B, H, N) if gate == "head" else (B, H, N, Dk)
    g = -decay * torch.rand(*shape, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, H, N, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64) * 0.5
    return q, k, v, g, beta, S0


def _steps(step):
    def run(q, k, v, g, *rest, initial_state=None):
        state, outs = initial_state, []
        for t in range(q.shape[2]):
            tok = [x[:, :, t:t + 1] for x in (q, k, v, g, *rest)]
            out, state = step(*tok, state)
            outs.append(out)
        return LinearAttentionOutput(torch.cat(outs, dim=2), state)
    return run


RULES = {
    "linear": {
        "parallel": gated_linear_parallel,
        "chunked-C16": lambda *a, **kw: gated_linear_chunked(*a, chunk_size=16, **kw),
        "chunked-C64": gated_linear_chunked,
        "recurrent": gated_linear_recurrent,
        "step": _steps(gated_linear_step),
    },
    "delta": {
        "parallel": gated_delta_parallel,
        "chunked-C16": lambda *a, **kw: gated_delta_chunked(*a, chunk_size=16, **kw),
        "chunked-C64": gated_delta_chunked,
        "recurrent": gated_delta_recurrent,
        "step": _steps(gated_delta_step),
    },
}


def _args(rule, q, k, v, g, beta):
    return (q, k, v, g) if rule == "linear" else (q, k, v, g, beta)


def _fwd_bwd(fn, args, S0, g_out):
    args = [t.detach().requires_grad_() for t in args]
    S0 = S0.detach().requires_grad_()
    res = fn(*args, initial_state=S0)
    grads = torch.autograd.grad((res.out * g_out.to(res.out.dtype)).sum() + res.state.sum(), (*args, S0))
    return res, grads


def _floor(dtype, ref):
    return 1e-11 * max(1.0, float(ref.detach().abs().max())) if dtype == torch.float64 else None


FORM_CASES = [pytest.param(rule, c, gate, form, id=f"{rule}-{case_id(c)}-{gate}-{form}")
              for rule in RULES for c in CASES for gate in GATES for form in RULES[rule]
              if form != "parallel" and (form != "step" or c[3] <= 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rule, case, gate, form", FORM_CASES)
def test_forms_agree_fwd_bwd(rule, case, gate, form, dtype):
    """Every form against the float64 reference within the budget of the reference run in the same dtype:
    output, final state, and the gradients with respect to q, k, v, g, beta and the initial state."""
    q, k, v, g, beta, S0 = _inputs(*case, gate=gate)
    g_out = torch.randn_like(v)
    args = _args(rule, q, k, v, g, beta)
    lo = [t.to(dtype) for t in args]
    ref, ref_g = _fwd_bwd(RULES[rule]["parallel"], [t.double() for t in lo], S0, g_out)
    base, base_g = _fwd_bwd(RULES[rule]["parallel"], lo, S0.to(dtype), g_out)
    cand, cand_g = _fwd_bwd(RULES[rule][form], lo, S0.to(dtype), g_out)
    assert cand.out.dtype == dtype and cand.state.dtype == dtype
    assert cand.state.shape == (case[0], case[2], case[4], case[5])
    assert_within_budget(cand.out, ref.out, base.out, floor=_floor(dtype, ref.out), what=f"{form} out")
    assert_within_budget(cand.state, ref.state, base.state, floor=_floor(dtype, ref.state), what=f"{form} state")
    for name, c, r, b in zip(["q", "k", "v", "g", "beta"][:len(args)] + ["S0"], cand_g, ref_g, base_g):
        assert_within_budget(c, r, b, floor=_floor(dtype, r), what=f"{form} d{name}")


@pytest.mark.parametrize("gate", GATES)
def test_linear_reference_is_the_recurrence(gate):
    """The quadratic form (gated_linear_parallel) against the recurrence written out in a few lines."""
    q, k, v, g, _, S0 = _inputs(2, 1, 2, 9, 4, 3, gate=gate, seed=3)
    S, outs = S0.clone(), []
    kk, qq = k.repeat_interleave(2, dim=1), q.repeat_interleave(2, dim=1)
    for t in range(9):
        d = g[:, :, t].exp()
        S = S * (d.unsqueeze(-1) if gate == "channel" else d[..., None, None])
        S = S + kk[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qq[:, :, t]))
    ref = gated_linear_parallel(q, k, v, g, initial_state=S0)
    torch.testing.assert_close(ref.out, torch.stack(outs, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.state, S, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("decay", [30.0, 3.0, 0.02], ids=lambda d: f"decay{d:g}")
@pytest.mark.parametrize("rule", ["linear", "delta"])
def test_chunked_per_channel_large_decays(rule, decay, dtype):
    """Per-channel decays that spread by hundreds of nats inside a chunk (the sub-block and full-product paths)
    and tiny ones (one factored GEMM per chunk): finite, and within budget of the float64 reference, forward and
    backward."""
    q, k, v, g, beta, S0 = _inputs(1, 2, 2, 96, 8, 8, gate="channel", seed=5, decay=decay)
    args = [t.to(dtype) for t in _args(rule, q, k, v, g, beta)]
    g_out = torch.randn_like(v)
    ref, ref_g = _fwd_bwd(RULES[rule]["parallel"], [t.double() for t in args], S0, g_out)
    base, base_g = _fwd_bwd(RULES[rule]["parallel"], args, S0.to(dtype), g_out)
    got, got_g = _fwd_bwd(RULES[rule]["chunked-C64"], args, S0.to(dtype), g_out)
    assert torch.isfinite(got.out).all() and torch.isfinite(got.state).all()
    assert_within_budget(got.out, ref.out, base.out, floor=_floor(dtype, ref.out), what="out")
    assert_within_budget(got.state, ref.state, base.state, floor=_floor(dtype, ref.state), what="state")
    for name, c, r, b in zip(["q", "k", "v", "g", "beta"][:len(args)] + ["S0"], got_g, ref_g, base_g):
        assert torch.isfinite(c).all(), f"d{name} is not finite"
        assert_within_budget(c, r, b, floor=_floor(dtype, r), what=f"d{name}")


SPLIT_FORMS = ["parallel", "chunked-C16", "chunked-C64", "recurrent"]


@settings(max_examples=10, deadline=None)
@given(split=st.integers(0, 41), first=st.sampled_from(SPLIT_FORMS), second=st.sampled_from(SPLIT_FORMS),
       rule=st.sampled_from(["linear", "delta"]), gate=st.sampled_from(GATES))
def test_state_carry_across_any_split(split, first, second, rule, gate):
    """Tokens [0, split) and [split, N) in two calls with the carried state give the one-call result."""
    q, k, v, g, beta, S0 = _inputs(2, 1, 2, 41, 8, 8, gate=gate, seed=4)
    args = _args(rule, q, k, v, g, beta)
    ref = RULES[rule]["parallel"](*args, initial_state=S0)
    a = RULES[rule][first](*(t[:, :, :split] for t in args), initial_state=S0)
    b = RULES[rule][second](*(t[:, :, split:] for t in args), initial_state=a.state)
    torch.testing.assert_close(torch.cat([a.out, b.out], dim=2), ref.out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(b.state, ref.state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("rule", ["linear", "delta"])
def test_chunked_gradcheck(rule, gate):
    q, k, v, g, beta, S0 = _inputs(1, 1, 2, 11, 3, 2, gate=gate, seed=6)
    args = (*_args(rule, q, k, v, g, beta), S0)
    args = tuple(t.requires_grad_() for t in args)
    fn = gated_linear_chunked if rule == "linear" else gated_delta_chunked

    def f(*a):
        res = fn(*a[:-1], chunk_size=4, initial_state=a[-1])
        return res.out, res.state

    assert torch.autograd.gradcheck(f, args, fast_mode=True)


def test_grouped_heads_equal_repeated_heads():
    """H = 2 Hk equals q and k repeated to H heads (value head h reads key head h // 2)."""
    q, k, v, g, beta, S0 = _inputs(2, 2, 4, 30, 8, 8, seed=7)
    rep = [t.repeat_interleave(2, dim=1) for t in (q, k)]
    for fn in (gated_delta_chunked, gated_delta_recurrent):
        a, b = fn(q, k, v, g, beta, initial_state=S0), fn(*rep, v, g, beta, initial_state=S0)
        torch.testing.assert_close(a.out, b.out, rtol=1e-12, atol=1e-12)


def test_empty_sequence_returns_the_initial_state():
    q, k, v, g, beta, S0 = _inputs(1, 1, 2, 0, 4, 4)
    for rule in RULES:
        for form in ("parallel", "chunked-C64", "recurrent"):
            res = RULES[rule][form](*_args(rule, q, k, v, g, beta), initial_state=S0)
            assert res.out.shape == (1, 2, 0, 4)
            torch.testing.assert_close(res.state, S0)


def test_low_precision_accumulates_in_float32():
    q, k, v, g, beta, S0 = _inputs(1, 1, 1, 40, 8, 8, seed=8)
    lo = [t.bfloat16() for t in (q, k, v, g, beta)]
    ref = gated_delta_parallel(*[t.double() for t in lo])
    base = gated_delta_parallel(*lo)
    got = gated_delta_chunked(*lo, chunk_size=16)
    assert got.out.dtype == torch.bfloat16 and got.state.dtype == torch.float32
    assert_within_budget(got.out, ref.out, base.out, what="bf16 out")


# ---------------------------------------------------------------------------------------------- HF references

def _hf(name):
    try:
        return pytest.importorskip(f"transformers.models.{name}", reason="transformers is not installed")
    except Exception as e:  # noqa: BLE001 - any import failure means the reference is unavailable here
        pytest.skip(f"transformers.models.{name} cannot be imported: {e}")


@pytest.mark.parametrize("Hk, H", [(2, 2), (1, 4)], ids=["H2", "Hk1-H4"])
def test_matches_hf_qwen3_next_gated_delta_rule(Hk, H):
    """HF's torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (float32 inside, q scaled by
    Dk^-0.5 inside, use_qk_l2norm_in_kernel=False) on the same inputs, grouped value heads included."""
    m = _hf("qwen3_next.modeling_qwen3_next")
    B, N, Dk, Dv = 2, 70, 16, 8
    q, k, v, g, beta, S0 = _inputs(B, Hk, H, N, Dk, Dv, seed=9)
    q = q * Dk ** 0.5  # HF scales q itself
    lo = [t.float() for t in (q, k, v, g, beta, S0)]
    q, k, v, g, beta, S0 = (t.double() for t in lo)
    ours = gated_delta_chunked(q * Dk ** -0.5, k, v, g, beta, initial_state=S0)
    to_hf = [x.transpose(1, 2) for x in lo[:5]]
    for fn in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule):
        out, state = fn(*to_hf, initial_state=lo[5], output_final_state=True, use_qk_l2norm_in_kernel=False)
        torch.testing.assert_close(out.transpose(1, 2).double(), ours.out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state.double(), ours.state, rtol=1e-4, atol=1e-4)


def test_matches_hf_kimi_delta_attention():
    """HF's chunk_kimi_delta_attention / recurrent_kimi_delta_attention (per-channel gates)."""
    m = _hf("kimi_linear.modeling_kimi_linear")
    B, H, N, D = 1, 2, 70, 16
    q, k, v, g, beta, S0 = _inputs(B, H, H, N, D, D, gate="channel", seed=10)
    lo = [t.float() for t in (q * D ** 0.5, k, v, g, beta, S0)]
    q, k, v, g, beta, S0 = (t.double() for t in lo)
    ours = gated_delta_chunked(q * D ** -0.5, k, v, g, beta, initial_state=S0)
    to_hf = [x.transpose(1, 2) for x in lo[:5]]
    for fn in (m.chunk_kimi_delta_attention, m.recurrent_kimi_delta_attention):
        out, state = fn(*to_hf, initial_state=lo[5], output_final_state=True, use_qk_l2norm_in_kernel=False)
        torch.testing.assert_close(out.transpose(1, 2).double(), ours.out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state.double(), ours.state, rtol=1e-4, atol=1e-4)


def test_matches_hf_mamba2_chunk_scan():
    """Mamba2's SSD is the gated linear rule with q = C, k = B dt, v = x, g = A dt (one decay per head), the
    state transposed; n_groups key heads serve the value heads. HF's mamba2_chunk_scan without D."""
    m = _hf("mamba2.modeling_mamba2")
    gen = torch.Generator().manual_seed(11)
    Bt, N, H, P, G, Ns = 2, 50, 4, 8, 2, 6  # batch, tokens, heads, head dim, groups, state size
    x = torch.randn(Bt, N, H, P, generator=gen)
    dt = F.softplus(torch.randn(Bt, N, H, generator=gen))
    A = -torch.rand(H, generator=gen) - 0.5
    Bm, Cm = torch.randn(Bt, N, G, Ns, generator=gen), torch.randn(Bt, N, G, Ns, generator=gen)
    S0 = torch.randn(Bt, H, P, Ns, generator=gen)
    out, state = m.mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk_size=16, initial_states=S0, return_final_states=True)
    q, k = Cm.double().transpose(1, 2), Bm.double().transpose(1, 2)  # (B, G, N, Ns)
    v = (x.double() * dt.double()[..., None]).transpose(1, 2)  # (B, H, N, P): dt folded into the value
    g = (dt.double() * A.double()).transpose(1, 2)  # (B, H, N)
    ours = gated_linear_chunked(q, k, v, g, initial_state=S0.double().transpose(-1, -2))
    torch.testing.assert_close(out.transpose(1, 2).double(), ours.out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.double(), ours.state.transpose(-1, -2), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- errors

def _good():
    return _inputs(2, 1, 2, 8, 4, 5)


@pytest.mark.parametrize("form", ["parallel", "chunked-C64", "recurrent"])
@pytest.mark.parametrize("rule", ["linear", "delta"])
def test_bad_inputs_name_the_argument(rule, form):
    fn = RULES[rule][form]
    q, k, v, g, beta, S0 = _good()

    def call(q=q, k=k, v=v, g=g, beta=beta, **kw):
        return fn(*_args(rule, q, k, v, g, beta), **kw)

    with pytest.raises(ValueError, match=r"q must have rank 4 .*got shape \(1, 8, 4\)"):
        call(q=q[0])
    with pytest.raises(ValueError, match=r"q and k must have the same shape"):
        call(k=k[..., :3])
    with pytest.raises(ValueError, match=r"v must be \(B, H, N, Dv\) with k's B=2 and N=8"):
        call(v=v[:, :, :7])
    with pytest.raises(ValueError, match=r"v has 3 heads, which is not a multiple of the 2 heads"):
        call(q=q.expand(2, 2, 8, 4), k=k.expand(2, 2, 8, 4), v=v[:, :1].expand(2, 3, 8, 5))
    with pytest.raises(ValueError, match=r"g must be \(B, H, N\) = \(2, 2, 8\) .* or \(B, H, N, Dk\)"):
        call(g=g[:, :1])
    with pytest.raises(TypeError, match=r"share a dtype"):
        call(k=k.float())
    with pytest.raises(TypeError, match=r"g must be a floating tensor"):
        call(g=g.long())
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor"):
        call(v=v.tolist())
    with pytest.raises(ValueError, match=r"initial_state must be \(B, H, Dk, Dv\) = \(2, 2, 4, 5\), got \(2, 2, 5"):
        call(initial_state=S0.transpose(-1, -2))
    with pytest.raises(TypeError, match=r"initial_state must be a tensor"):
        call(initial_state=(S0,))
    if rule == "delta":
        with pytest.raises(ValueError, match=r"beta must be \(B, H, N\) = \(2, 2, 8\)"):
            call(beta=beta[..., None])
        with pytest.raises(TypeError, match=r"beta must be a torch.Tensor"):
            call(beta=0.5)


def test_bad_step_and_chunk_size():
    q, k, v, g, beta, S0 = _good()
    with pytest.raises(ValueError, match=r"gated_delta_step: q must hold one token .*gated_delta_chunked"):
        gated_delta_step(q, k, v, g, beta, S0)
    with pytest.raises(ValueError, match=r"gated_linear_step: g must hold one token"):
        gated_linear_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], g, S0)
    with pytest.raises(ValueError, match=r"gated_delta_step: state must be \(B, H, Dk, Dv\)"):
        gated_delta_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], beta[:, :, :1], S0[0])
    for bad in (0, -4, 2.5, True):
        said = rf"chunk_size must be a positive int or None \(the path's own\), got {bad!r}"
        with pytest.raises(ValueError, match=said):
            gated_delta_chunked(q, k, v, g, beta, chunk_size=bad)
        with pytest.raises(ValueError, match=said):
            gated_linear_chunked(q, k, v, g, chunk_size=bad)


@pytest.mark.parametrize("module", ["qkv.linear.gated_naive", "qkv.linear.gated_chunk", "qkv.linear.gated_recurrent",
                                    "qkv.nn.gated_deltanet", "qkv.nn.kda", "qkv.nn.mamba2"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, f"{module}: {result}"


def test_log_decays_stay_float32_only_within_the_bound():
    """float32 gates keep float32 cumulative log-decays while every chunk stays within FLOAT32_LOG_DECAY nats (the
    large-decay test above checks both sides against the float64 reference); beyond it, and for float64 gates,
    float64."""
    from qkv.linear.gated_chunk import FLOAT32_LOG_DECAY, _log_decays

    weak = torch.full((2, 3, 64), -FLOAT32_LOG_DECAY / 64)
    assert _log_decays(weak).dtype == torch.float32
    assert _log_decays(weak * 1.5).dtype == torch.float64
    assert _log_decays(weak.double()).dtype == torch.float64
    torch.testing.assert_close(_log_decays(weak).double(), weak.double().cumsum(2))
