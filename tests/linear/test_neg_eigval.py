"""The gated delta rule with negative eigenvalues (Grazzi et al. 2025, arXiv:2411.12537; OLMo-hybrid's
``allow_neg_eigval``): write strengths ``beta`` in ``[0, 2]``, so the transition ``I - beta k k^T`` of a unit key has
the eigenvalue ``1 - beta`` in ``[-1, 1]``. Every form of ``qkv.linear``'s gated delta rule takes ``beta`` as given;
these tests drive all four with betas across ``[0, 2]`` (half of them above 1) against the float64 reference
(``gated_delta_parallel``): the chunked torch form (chunks of 16 and 64) and the recurrent and one-token forms, forward
and backward (q, k, v, g, beta, initial state); the compiled chunk kernel and the compiled decode step
(``qkv/cpu/csrc/gated_delta.cpp``, ``delta_decode.cpp``; no backward, refused under autograd) forward, in float64
and float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.cpu import kernels
from qkv.cpu.fused import DELTA
from qkv.linear import (
    LinearAttentionOutput,
    gated_delta_chunked,
    gated_delta_parallel,
    gated_delta_recurrent,
    gated_delta_step,
)
from qkv.linear.gated_chunk import delta_path
from qkv.nn._recurrent import RecurrentState, delta_mix
from qkv.testing import assert_within_budget

# (B, Hk, H, N, Dk, Dv)
CASES = {"B1-Hk1-H1-N1-Dk8": (1, 1, 1, 1, 8, 8), "B2-Hk2-H2-N63-Dk8": (2, 2, 2, 63, 8, 8),
         "B1-Hk1-H2-N113-Dk16-Dv8": (1, 1, 2, 113, 16, 8)}


def _inputs(B, Hk, H, N, Dk, Dv, *, gate="head", seed=0):
    """float64 inputs as OLMo-hybrid feeds them: unit-norm keys, log-decays <= 0, beta = 2 sigmoid(.) in [0, 2]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hk, N, Dk, generator=gen, dtype=torch.float64) * Dk ** -0.5
    k = F.normalize(torch.randn(B, Hk, N, Dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, N, Dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(*((B, H, N) if gate == "head" else (B, H, N, Dk)), generator=gen, dtype=torch.float64)
    beta = 2 * torch.rand(B, H, N, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64) * 0.5
    return q, k, v, g, beta, S0


def _steps(q, k, v, g, beta, initial_state=None):
    state, outs = initial_state, []
    for t in range(q.shape[2]):
        out, state = gated_delta_step(*(x[:, :, t:t + 1] for x in (q, k, v, g, beta)), state)
        outs.append(out)
    return LinearAttentionOutput(torch.cat(outs, dim=2), state)


FORMS = {"chunked-C16": lambda *a, **kw: gated_delta_chunked(*a, chunk_size=16, **kw),
         "chunked-C64": gated_delta_chunked, "recurrent": gated_delta_recurrent, "step": _steps}


def _fwd_bwd(fn, args, S0, g_out):
    args = [t.detach().requires_grad_() for t in args]
    S0 = S0.detach().requires_grad_()
    res = fn(*args, initial_state=S0)
    return res, torch.autograd.grad((res.out * g_out).sum() + res.state.sum(), (*args, S0))


def _close(got, want, what, rel=1e-11):
    err = float((got - want).detach().abs().max()) / max(1.0, float(want.detach().abs().max()))
    assert err < rel, f"{what}: max error {err:.2e} relative to the reference's scale"


def test_betas_above_one_make_negative_eigenvalues():
    """The premise: the inputs reach beta > 1, where the transition I - beta k k^T has a negative eigenvalue, and
    the rule's output there differs from the same inputs with beta clipped to 1."""
    q, k, v, g, beta, S0 = _inputs(*CASES["B2-Hk2-H2-N63-Dk8"])
    assert (beta > 1.5).float().mean() > 0.2 and beta.min() >= 0 and beta.max() <= 2
    T = torch.eye(8, dtype=torch.float64) - beta[0, 0, 0] * torch.outer(k[0, 0, 0], k[0, 0, 0])
    assert (torch.linalg.eigvalsh(T).min() < 0) == bool(beta[0, 0, 0] > 1)
    clipped = gated_delta_parallel(q, k, v, g, beta.clamp(max=1), initial_state=S0).out
    assert (gated_delta_parallel(q, k, v, g, beta, initial_state=S0).out - clipped).abs().max() > 0.1


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case", list(CASES))
def test_forms_agree_with_the_reference_fwd_bwd(case, form, gate):
    """Output, state and the gradients of q, k, v, g, beta and the initial state, float64, to 1e-11 of the scale."""
    q, k, v, g, beta, S0 = _inputs(*CASES[case], gate=gate)
    g_out = torch.randn_like(v)
    ref, ref_g = _fwd_bwd(gated_delta_parallel, [q, k, v, g, beta], S0, g_out)
    got, got_g = _fwd_bwd(FORMS[form], [q, k, v, g, beta], S0, g_out)
    _close(got.out, ref.out, f"{form} out")
    _close(got.state, ref.state, f"{form} state")
    for name, c, r in zip(["q", "k", "v", "g", "beta", "S0"], got_g, ref_g):
        _close(c, r, f"{form} d{name}")


def _kernels():
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build in the test environment: {kernels.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_chunk_kernel_agrees(case, gate, dtype):
    _kernels()
    q, k, v, g, beta, S0 = _inputs(*CASES[case], gate=gate, seed=1)
    lo = [t.to(dtype) for t in (q, k, v, g, beta)]
    assert delta_path(*lo, initial_state=S0.to(dtype), kernel=DELTA) == "compiled CPU kernel"
    ref = gated_delta_parallel(*[t.double() for t in lo], initial_state=S0.to(dtype).double())
    base = gated_delta_parallel(*lo, initial_state=S0.to(dtype))
    got = gated_delta_chunked(*lo, initial_state=S0.to(dtype), kernel=DELTA)
    floor = 1e-11 * max(1.0, float(ref.out.abs().max())) if dtype == torch.float64 else None
    assert_within_budget(got.out, ref.out, base.out, floor=floor, what="compiled chunk out")
    assert_within_budget(got.state, ref.state, base.state, floor=floor, what="compiled chunk state")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_compiled_decode_step_agrees(gate, dtype):
    """The compiled decode step (convolution, L2 norms and the rule in one call) against the torch ops, token by
    token over 12 steps with betas in [0, 2]; it is refused under autograd, which the torch ops then run."""
    _kernels()
    B, Hk, H, Dk, Dv, K = 2, 2, 4, 8, 8, 4
    gen = torch.Generator().manual_seed(3)
    Cc = 2 * Hk * Dk + H * Dv
    w = torch.randn(Cc, 1, K, generator=gen, dtype=torch.float64).to(dtype)
    fused = plain = RecurrentState(torch.zeros(B, Cc, K - 1, dtype=dtype), torch.zeros(B, H, Dk, Dv, dtype=dtype))
    for t in range(12):
        mixed = torch.randn(B, 1, Cc, generator=gen, dtype=torch.float64).to(dtype)
        g = -torch.rand(*((B, H, 1) if gate == "head" else (B, H, 1, Dk)), generator=gen, dtype=torch.float64)
        beta = 2 * torch.rand(B, H, 1, generator=gen, dtype=torch.float64)
        g, beta = g.to(dtype), beta.to(dtype)
        kw = dict(Hk=Hk, Dk=Dk, Dv=Dv, chunk_size=None, one_token=True)
        o1, fused = delta_mix(mixed, w, g, beta, fused, kernel=DELTA, **kw)
        o2, plain = delta_mix(mixed, w, g, beta, plain, kernel=None, **kw)
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o1, o2, **tol, msg=lambda m, t=t: f"step {t}: {m}")
        torch.testing.assert_close(fused.recurrent, plain.recurrent, **tol)
    assert DELTA.step_declines(mixed.requires_grad_(), w, g, beta) is not None
