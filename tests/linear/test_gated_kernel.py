"""The compiled CPU kernel of the chunked gated delta rule (qkv/cpu/csrc/gated_delta.cpp, given to
``gated_delta_chunked`` as ``kernel=qkv.cpu.fused.DELTA``, as ``qkv.cpu.optimize`` gives it to a model's mixers): calls
that need no gradient run it. It equals the float64 reference (``gated_delta_parallel``) for both gate shapes, grouped
key heads, any chunk size (longer or shorter than the sequence, not dividing it), an initial state, per-channel
log-decays far beyond the factored form's range (chunks end early; a lone token beyond it takes the pairwise form),
strided and low-precision inputs; ``delta_path`` says when it runs and why not; switched off, the torch ops give the
same values."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from qkv.cpu import kernels
from qkv.cpu.fused import DELTA
from qkv.linear import gated_delta_chunked as plain_chunked
from qkv.linear import gated_delta_parallel
from qkv.linear.gated_chunk import delta_path as plain_path
from qkv.testing import assert_within_budget

gated_delta_chunked = functools.partial(plain_chunked, kernel=DELTA)
delta_path = functools.partial(plain_path, kernel=DELTA)

pytestmark = pytest.mark.xdist_group("cpu_kernels")

KERNEL = "compiled CPU kernel"

# (B, Hk, H, N, Dk, Dv)
CASES = {"one-token": (1, 1, 1, 1, 8, 8), "mha": (2, 2, 2, 70, 16, 16), "gqa-dv": (1, 1, 3, 113, 16, 8),
         "gqa-wide": (2, 2, 4, 64, 32, 40)}


def _inputs(B, Hk, H, N, Dk, Dv, *, gate, decay=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hk, N, Dk, generator=gen, dtype=torch.float64) * Dk ** -0.5
    k = F.normalize(torch.randn(B, Hk, N, Dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, N, Dv, generator=gen, dtype=torch.float64)
    g = -decay * torch.rand(*((B, H, N) if gate == "head" else (B, H, N, Dk)), generator=gen, dtype=torch.float64)
    beta = torch.rand(B, H, N, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64) * 0.5
    return q, k, v, g, beta, S0


def _check(args, S0, dtype, **kw):
    lo = [t.to(dtype) for t in args]
    assert delta_path(*lo, initial_state=S0.to(dtype)) == KERNEL
    ref = gated_delta_parallel(*[t.double() for t in lo], initial_state=S0)
    base = gated_delta_parallel(*lo, initial_state=S0.to(dtype))
    got = gated_delta_chunked(*lo, initial_state=S0.to(dtype), **kw)
    assert got.out.dtype == dtype and got.state.dtype == dtype and got.state.shape == S0.shape
    floor = 1e-11 * max(1.0, float(ref.out.abs().max())) if dtype == torch.float64 else None
    assert_within_budget(got.out, ref.out, base.out, floor=floor, what="out")
    assert_within_budget(got.state, ref.state, base.state, floor=floor, what="state")
    return got


@pytest.fixture(autouse=True)
def _kernels_built():
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build in the test environment: {kernels.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("chunk", [None, 1, 5, 16, 64, 200])
@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_reference(case, gate, chunk, dtype):
    q, k, v, g, beta, S0 = _inputs(*CASES[case], gate=gate)
    with torch.no_grad():
        _check((q, k, v, g, beta), S0, dtype, chunk_size=chunk)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("decay", [0.02, 3.0, 30.0, 400.0])
def test_per_channel_decays_far_beyond_the_factored_range(decay, dtype):
    """Chunks whose channels decay by up to thousands of nats: they end where the factored scores would overflow,
    with no loss of accuracy; at 400 nats per token and channel each token is its own chunk."""
    q, k, v, g, beta, S0 = _inputs(1, 2, 2, 96, 8, 8, gate="channel", decay=decay, seed=5)
    got = _check((q, k, v, g, beta), S0, dtype, chunk_size=64)
    assert torch.isfinite(got.out).all() and torch.isfinite(got.state).all()


def test_a_lone_extreme_token_takes_the_pairwise_form():
    """One token whose gate alone leaves the factored range (-700 nats in float64, -90 in float32) among mild ones."""
    q, k, v, g, beta, S0 = _inputs(1, 1, 2, 40, 8, 8, gate="channel", decay=0.5, seed=7)
    g[:, :, 17, ::2] = -700.0
    g[:, :, 30, 1] = -90.0
    for dtype in (torch.float64, torch.float32):
        _check((q, k, v, g.clamp_min(-90.0 if dtype == torch.float32 else -700.0), beta), S0, dtype, chunk_size=32)


def test_strided_bfloat16_and_the_state_given_is_not_changed():
    B, Hk, H, N, Dk, Dv = 1, 2, 2, 50, 16, 8
    q, k, v, g, beta, S0 = _inputs(B, Hk, H, N, Dk, Dv, gate="head", seed=2)
    as_model = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # (B, N, H, D) storage
    assert not as_model[0].is_contiguous()
    keep = S0.clone()
    got = gated_delta_chunked(*as_model, g, beta, initial_state=S0)
    assert torch.equal(S0, keep)
    ref = gated_delta_parallel(q, k, v, g, beta, initial_state=S0)
    torch.testing.assert_close(got.out, ref.out, rtol=1e-12, atol=1e-12)
    lo = gated_delta_chunked(*(t.bfloat16() for t in (q, k, v, g, beta)), initial_state=S0.float())
    assert lo.out.dtype == torch.bfloat16 and lo.state.dtype == torch.float32
    assert (lo.out.double() - ref.out).abs().max() < 0.1


def test_chunks_split_anywhere_carry_the_state():
    q, k, v, g, beta, S0 = _inputs(2, 1, 2, 77, 16, 16, gate="channel", seed=3)
    ref = gated_delta_parallel(q, k, v, g, beta, initial_state=S0)
    for split in (1, 16, 40, 76):
        a = gated_delta_chunked(*(t[:, :, :split] for t in (q, k, v, g, beta)), initial_state=S0)
        b = gated_delta_chunked(*(t[:, :, split:] for t in (q, k, v, g, beta)), initial_state=a.state)
        torch.testing.assert_close(torch.cat([a.out, b.out], 2), ref.out, rtol=1e-11, atol=1e-11)
        torch.testing.assert_close(b.state, ref.state, rtol=1e-11, atol=1e-11)


def test_path_named_and_the_torch_ops_agree(monkeypatch):
    q, k, v, g, beta, S0 = _inputs(1, 1, 2, 45, 8, 8, gate="channel", seed=4)
    assert delta_path(q, k, v, g, beta) == KERNEL
    fast = gated_delta_chunked(q, k, v, g, beta, initial_state=S0)
    leaf = q.clone().requires_grad_()
    assert delta_path(leaf, k, v, g, beta) == "torch ops (autograd records this call (the kernel has no backward))"
    with torch.no_grad():
        assert delta_path(leaf, k, v, g, beta) == KERNEL
    monkeypatch.setenv(kernels.ENV, "0")
    assert delta_path(q, k, v, g, beta) == f"torch ops ({kernels.ENV}=0 in the environment)"
    slow = gated_delta_chunked(q, k, v, g, beta, initial_state=S0)
    torch.testing.assert_close(fast.out, slow.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast.state, slow.state, rtol=1e-12, atol=1e-12)


def test_gradients_keep_the_torch_ops():
    q, k, v, g, beta, S0 = _inputs(1, 1, 1, 20, 4, 4, gate="head", seed=6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    got = gated_delta_chunked(*leaves, initial_state=S0)
    grads = torch.autograd.grad(got.out.sum(), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    ref = gated_delta_parallel(*ref_leaves, initial_state=S0)
    for a, b in zip(grads, torch.autograd.grad(ref.out.sum(), ref_leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_without_a_kernel_the_torch_ops_run_and_say_so():
    q, k, v, g, beta, S0 = _inputs(1, 1, 2, 45, 8, 8, gate="head", seed=5)
    why = "torch ops (no compiled kernel given (qkv.cpu.optimize gives a model's mixers qkv.cpu.fused.DELTA))"
    assert plain_path(q, k, v, g, beta) == why
    fast, slow = gated_delta_chunked(q, k, v, g, beta, initial_state=S0), plain_chunked(q, k, v, g, beta,
                                                                                      initial_state=S0)
    torch.testing.assert_close(fast.out, slow.out, rtol=1e-12, atol=1e-12)


def test_delta_path_checks_its_inputs():
    q, k, v, g, beta, _ = _inputs(1, 1, 1, 4, 4, 4, gate="head")
    with pytest.raises(ValueError, match=r"delta_path: beta must be \(B, H, N\)"):
        delta_path(q, k, v, g, beta[..., :2])
    with pytest.raises(TypeError, match=r"delta_path: q must be a torch.Tensor"):
        delta_path(q.tolist(), k, v, g, beta)
