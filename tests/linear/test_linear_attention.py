"""Linear attention: four forms against the float64 parallel reference, state carry, errors, module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.linear import (
    LinearAttentionOutput,
    LinearState,
    linear_attention_chunked,
    linear_attention_parallel,
    linear_attention_recurrent,
    linear_attention_step,
)
from qkv.nn.linear import LinearAttention
from qkv.testing import assert_within_budget

# (B, H, N, D, Dv): awkward lengths, Dv != D, one token.
CASES = [(1, 1, 1, 8, 8), (2, 3, 63, 16, 16), (1, 2, 113, 32, 8), (2, 2, 64, 8, 12)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def case_id(c) -> str:
    B, H, N, D, Dv = c
    return f"B{B}-H{H}-N{N}-D{D}" + (f"-Dv{Dv}" if Dv != D else "")


def _inputs(B, H, N, D, Dv, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, Dv, generator=g, dtype=torch.float64)
    return q, k, v


def _step_loop(q, k, v, *, initial_state=None, **kw):
    """Decode token by token with linear_attention_step: the fourth form."""
    state, outs = initial_state, []
    for t in range(q.shape[2]):
        out, state = linear_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, **kw)
        outs.append(out)
    return LinearAttentionOutput(torch.cat(outs, dim=2), state)


FORMS = {
    "chunked-C16": lambda q, k, v, **kw: linear_attention_chunked(q, k, v, causal=True, chunk_size=16, **kw),
    "chunked-C64": lambda q, k, v, **kw: linear_attention_chunked(q, k, v, causal=True, chunk_size=64, **kw),
    "recurrent": lambda q, k, v, **kw: linear_attention_recurrent(q, k, v, **kw),
    "step": _step_loop,
}


def _fwd_bwd(fn, q, k, v, g_out, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    res = fn(q, k, v, **kw)
    grads = torch.autograd.grad(res.out, (q, k, v), g_out.to(res.out.dtype))
    return res, grads


def _floor(dtype, ref):
    # float64 against float64: the baseline is exact, so the allowance is a relative floor.
    return 1e-12 * max(1.0, float(ref.detach().abs().max())) if dtype == torch.float64 else None


# The token-by-token step loop runs at the shorter sizes only (it is one Python call per token).
FORM_CASES = [pytest.param(c, f, id=f"{case_id(c)}-{f}") for c in CASES for f in FORMS if f != "step" or c[2] <= 64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case, form", FORM_CASES)
def test_causal_forms_agree_fwd_bwd(case, form, dtype):
    B, H, N, D, Dv = case
    q, k, v = _inputs(*case)
    g_out = torch.randn(B, H, N, Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    lo = [t.to(dtype) for t in (q, k, v)]
    # The reference sees exactly the rounded inputs the candidate sees.
    ref, ref_g = _fwd_bwd(lambda *a: linear_attention_parallel(*a, causal=True), *[t.double() for t in lo], g_out)
    base, base_g = _fwd_bwd(lambda *a: linear_attention_parallel(*a, causal=True), *lo, g_out)
    cand, cand_g = _fwd_bwd(FORMS[form], *lo, g_out)

    assert cand.out.dtype == dtype
    assert cand.state.S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_within_budget(cand.out, ref.out, base.out, floor=_floor(dtype, ref.out), what=f"{form} out")
    for name, c, r, b in zip("qkv", cand_g, ref_g, base_g):
        assert_within_budget(c, r, b, floor=_floor(dtype, r), what=f"{form} d{name}")
    for name in ("S", "z"):
        r, b, c = getattr(ref.state, name), getattr(base.state, name), getattr(cand.state, name)
        assert_within_budget(c, r, b, floor=_floor(dtype, r), what=f"{form} state.{name}")


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "unnormalized"])
@pytest.mark.parametrize("feature_map", ["elu_plus_one", "relu", "pos-neg"])
def test_forms_agree_float64_feature_maps(feature_map, normalize):
    """Each feature map (two built in, one user callable with F = 2D) in every causal form, float64."""
    if feature_map == "pos-neg":
        def feature_map(x):
            return torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    q, k, v = _inputs(2, 2, 45, 8, 6)
    kw = {"feature_map": feature_map, "normalize": normalize}
    ref = linear_attention_parallel(q, k, v, causal=True, **kw)
    for name, form in FORMS.items():
        got = form(q, k, v, **kw)
        torch.testing.assert_close(got.out, ref.out, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(got.state.S, ref.state.S, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("Nq, Nk", [(17, 17), (5, 33), (40, 1)], ids=lambda n: f"N{n}")
def test_noncausal_chunked_matches_parallel(Nq, Nk):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, Nq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, Nk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, Nk, 5, generator=g, dtype=torch.float64)
    S0 = LinearState(torch.rand(2, 3, 8, 5, dtype=torch.float64), torch.rand(2, 3, 8, dtype=torch.float64))
    for state in (None, S0):
        ref = linear_attention_parallel(q, k, v, initial_state=state)
        got = linear_attention_chunked(q, k, v, initial_state=state)
        torch.testing.assert_close(got.out, ref.out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.state.S, ref.state.S, rtol=1e-12, atol=1e-12)
    # Non-causal output is the last causal row's state read by every query.
    causal_last = linear_attention_parallel(k, k, v, causal=True).state
    torch.testing.assert_close(linear_attention_chunked(q, k, v).state.S, causal_last.S)


SPLIT_FORMS = {
    "parallel": lambda q, k, v, s: linear_attention_parallel(q, k, v, causal=True, initial_state=s),
    "chunked-C5": lambda q, k, v, s: linear_attention_chunked(q, k, v, causal=True, chunk_size=5, initial_state=s),
    "chunked-C64": lambda q, k, v, s: linear_attention_chunked(q, k, v, causal=True, initial_state=s),
    "recurrent": lambda q, k, v, s: linear_attention_recurrent(q, k, v, initial_state=s),
}


@settings(max_examples=12, deadline=None)
@given(split=st.integers(0, 37), first=st.sampled_from(list(SPLIT_FORMS)), second=st.sampled_from(list(SPLIT_FORMS)))
def test_state_carry_across_any_split(split, first, second):
    """Run tokens [0, split) and [split, N) in two calls with the carried state: same as one call."""
    q, k, v = _inputs(2, 2, 37, 8, 8, seed=4)
    ref = linear_attention_parallel(q, k, v, causal=True)
    lo = [t.float() for t in (q, k, v)]
    base = linear_attention_parallel(*lo, causal=True)
    a = SPLIT_FORMS[first](*(t[:, :, :split] for t in lo), None)
    b = SPLIT_FORMS[second](*(t[:, :, split:] for t in lo), a.state)
    out = torch.cat([a.out, b.out], dim=2)
    assert_within_budget(out, ref.out, base.out, what=f"{first} | {second} split at {split}")
    assert_within_budget(b.state.S, ref.state.S, base.state.S, what="final state.S")


def test_prefill_then_decode_matches_one_call():
    q, k, v = _inputs(1, 4, 70, 16, 16, seed=5)
    full = linear_attention_chunked(q, k, v, causal=True)
    state = linear_attention_chunked(q[:, :, :66], k[:, :, :66], v[:, :, :66], causal=True).state
    for t in range(66, 70):
        out, state = linear_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        torch.testing.assert_close(out, full.out[:, :, t:t + 1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.S, full.state.S)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_gradients_flow_into_initial_state(form):
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 9, 3, 2, seed=6))
    S = torch.rand(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    z = torch.rand(1, 2, 3, dtype=torch.float64, requires_grad=True)
    fn = {
        "chunked": lambda q, k, v, S, z: linear_attention_chunked(q, k, v, causal=True, chunk_size=4,
                                                                  initial_state=LinearState(S, z)),
        "recurrent": lambda q, k, v, S, z: linear_attention_recurrent(q, k, v, initial_state=LinearState(S, z)),
    }[form]
    assert torch.autograd.gradcheck(lambda *a: fn(*a).out, (q, k, v, S, z), fast_mode=True)
    assert torch.autograd.gradcheck(lambda *a: fn(*a).state.S, (q, k, v, S, z), fast_mode=True)


def test_zero_normalizer_gives_zeros_not_nan():
    """relu features that are all zero: the row's normalizer is 0 and eps keeps it finite."""
    q = -torch.rand(1, 1, 6, 4).requires_grad_()  # relu(q) == 0 on every row
    k, v = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    for fn in (lambda: linear_attention_chunked(q, k, v, feature_map="relu", causal=True, chunk_size=4),
               lambda: linear_attention_recurrent(q, k, v, feature_map="relu"),
               lambda: linear_attention_parallel(q, k, v, feature_map="relu")):
        out = fn().out
        assert torch.equal(out, torch.zeros_like(out))
        (grad,) = torch.autograd.grad(out.sum(), q)
        assert torch.isfinite(grad).all()


def test_empty_sequence_returns_the_initial_state():
    q = k = v = torch.randn(1, 2, 0, 4)
    S0 = LinearState(torch.rand(1, 2, 4, 4), torch.rand(1, 2, 4))
    for fn in (linear_attention_chunked, linear_attention_parallel):
        res = fn(q, k, v, causal=True, initial_state=S0)
        assert res.out.shape == (1, 2, 0, 4)
        torch.testing.assert_close(res.state.S, S0.S)
    assert linear_attention_recurrent(q, k, v, initial_state=S0).out.shape == (1, 2, 0, 4)


def _good():
    return torch.randn(2, 3, 8, 4), torch.randn(2, 3, 8, 4), torch.randn(2, 3, 8, 5)


@pytest.mark.parametrize("fn", [linear_attention_parallel, linear_attention_chunked, linear_attention_recurrent],
                         ids=lambda f: f.__name__)
def test_bad_inputs_name_the_argument(fn):
    q, k, v = _good()
    with pytest.raises(ValueError, match=r"q must have rank 4 .*got shape \(3, 8, 4\)"):
        fn(q[0], k, v)
    with pytest.raises(ValueError, match=r"v must have rank 4"):
        fn(q, k, v[..., 0])
    with pytest.raises(ValueError, match=r"share \(B, H\)"):
        fn(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match=r"k and v must have the same number of tokens"):
        fn(q, k, v[:, :, :7])
    with pytest.raises(TypeError, match=r"share a dtype"):
        fn(q, k.double(), v)
    with pytest.raises(TypeError, match=r"q must be a floating tensor"):
        fn(q.long(), k, v)
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor"):
        fn(q, k.tolist(), v)
    with pytest.raises(ValueError, match=r"initial_state must have S \(B, H, F, Dv\) = \(2, 3, 4, 5\)"):
        fn(q, k, v, initial_state=LinearState(torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4)))
    with pytest.raises(TypeError, match=r"initial_state must be a LinearState"):
        fn(q, k, v, initial_state=torch.zeros(2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"not a known feature map.*elu_plus_one"):
        fn(q, k, v, feature_map="softmax")
    with pytest.raises(ValueError, match=r"eps must be a float >= 0"):
        fn(q, k, v, eps=-1.0)
    with pytest.raises(ValueError, match=r"feature_map\(q\) must return \(B, H, N, F\)"):
        fn(q, k, v, feature_map=lambda x: x.flatten(-2))
    with pytest.raises(TypeError, match=r"feature_map\(q\) must return a torch.Tensor"):
        fn(q, k, v, feature_map=lambda x: x.tolist())
    with pytest.raises(ValueError, match=r"feature_map\(q\) must return .* \(B, H, N\) = \(2, 3, 8\)"):
        fn(q, k, v, feature_map=lambda x: x[:, :, :1])


def test_bad_causal_lengths_and_chunk_size():
    q, k, v = _good()
    with pytest.raises(ValueError, match=r"causal=True needs as many queries as keys, got Nq=3, Nk=8"):
        linear_attention_chunked(q[:, :, :3], k, v, causal=True)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match=rf"chunk_size must be a positive int, got {bad!r}"):
            linear_attention_chunked(q, k, v, causal=True, chunk_size=bad)
    with pytest.raises(ValueError, match=r"one token \(B, H, 1, D\), got shape \(2, 3, 8, 4\).*chunked"):
        linear_attention_step(q, k, v, None)
    with pytest.raises(ValueError, match=r"linear_attention_step: state must have S \(B, H, F, Dv\)"):
        bad = LinearState(torch.zeros(2, 3, 4), torch.zeros(2, 3))
        linear_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], bad)
    calls = []

    def phi(x):  # the first call (q) gets 8 features, the second (k) 4
        calls.append(x)
        return torch.cat([x, x], -1) if len(calls) == 1 else x

    with pytest.raises(ValueError, match=r"feature_map gave q 8 features and k 4"):
        linear_attention_parallel(q, k, v, feature_map=phi)


def test_module_forward_and_decode_match():
    torch.manual_seed(0)
    attn = LinearAttention(32, 4, causal=True, chunk_size=8)
    x = torch.randn(2, 21, 32)
    full = attn(x)
    assert full.out.shape == (2, 21, 32) and full.state.S.shape == (2, 4, 8, 8)
    out, state = attn(x[:, :17])
    steps = [out]
    for t in range(17, 21):
        y, state = attn.step(x[:, t:t + 1], state)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full.out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.S, full.state.S, rtol=1e-5, atol=1e-5)


def test_module_matches_functional_and_trains():
    torch.manual_seed(0)
    attn = LinearAttention(24, 3, feature_map="relu", causal=False, dtype=torch.float64)
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    B, N, E = x.shape
    split = [p(x).view(B, N, 3, 8).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    ref = linear_attention_parallel(*split, feature_map="relu").out
    want = attn.o_proj(ref.transpose(1, 2).reshape(B, N, E))
    torch.testing.assert_close(attn(x).out, want)
    attn(x).out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())


def test_module_state_dict_round_trip_and_errors():
    torch.manual_seed(0)
    a, b = LinearAttention(16, 2, causal=True), LinearAttention(16, 2, causal=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 5, 16)
    assert torch.equal(a(x).out, b(x).out)
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, d_model=16\), got \(5, 16\)"):
        a(x[0])
    with pytest.raises(ValueError, match=r"one token \(B, 1, d_model\)"):
        a.step(x, None)
    with pytest.raises(ValueError, match=r"step decodes causally"):
        LinearAttention(16, 2).step(x[:, :1], None)
    with pytest.raises(ValueError, match=r"d_model=16 must be divisible by n_heads=3"):
        LinearAttention(16, 3)
