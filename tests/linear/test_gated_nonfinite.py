"""The chunked gated rules on gates and inputs the recurrence defines and the chunked algebra does not take as is
(#46 items 3 and 6), on the compiled kernel and on the torch ops: a gate of ``-inf`` (a full reset, ``exp(g) = 0``)
or of ``-1e30`` gives the recurrence's values, where it once turned every token NaN; a NaN (in a gate, a key, a
value) reaches exactly the tokens and state the recurrence says, never the earlier tokens of its chunk; a zero key
dimension gives zeros (the kernel once returned heap garbage). With gradients asked only of ``g``, ``beta`` or the
initial state, the compiled kernel (no backward) is not taken and the gradients are float64's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.cpu import kernels
from qkv.cpu.fused import DELTA
from qkv.linear import gated_delta_chunked, gated_delta_recurrent, gated_linear_chunked, gated_linear_recurrent
from qkv.linear.gated_chunk import delta_path
from qkv.testing import assert_within_budget

pytestmark = pytest.mark.xdist_group("cpu_kernels")

B, HK, H, N, DK, DV = 2, 1, 2, 45, 8, 6


@pytest.fixture(params=["compiled", "torch"])
def path(request, monkeypatch):
    """The kernel given to the chunked delta rule: qkv.cpu.fused.DELTA (as qkv.cpu.optimize gives a model's mixers),
    or None for the torch ops."""
    if request.param == "torch":
        monkeypatch.setenv(kernels.ENV, "0")
        return None
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build here: {kernels.unavailable_reason()}")
    return DELTA


def _inputs(gate: str, seed: int = 0):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HK, N, DK, generator=g_, dtype=torch.float64) * DK ** -0.5
    k = F.normalize(torch.randn(B, HK, N, DK, generator=g_, dtype=torch.float64), dim=-1)
    v = torch.randn(B, H, N, DV, generator=g_, dtype=torch.float64)
    shape = (B, H, N) if gate == "head" else (B, H, N, DK)
    g = -0.3 * torch.rand(*shape, generator=g_, dtype=torch.float64)
    beta = torch.rand(B, H, N, generator=g_, dtype=torch.float64)
    S0 = torch.randn(B, H, DK, DV, generator=g_, dtype=torch.float64)
    return q, k, v, g, beta, S0


RESETS = {  # token indices (of row (0, 0)) whose gate resets the state; chunks are 16 (kernel) or 64 (torch ops)
    "one": [20], "first": [0], "two_in_a_chunk": [17, 30], "chunk_edge": [15, 16], "run": list(range(33, 41)),
}


@pytest.mark.parametrize("value", [float("-inf"), -1e30], ids=["-inf", "-1e30"])
@pytest.mark.parametrize("where", list(RESETS))
@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_a_reset_gate_gives_the_recurrence(dtype, gate, where, value, path):
    q, k, v, g, beta, S0 = _inputs(gate)
    for t in RESETS[where]:
        g[0, 0, t] = value
        if gate == "channel":
            g[1, 1, t, 3] = value  # one channel only
    ref = gated_delta_recurrent(q, k, v, g, beta, initial_state=S0)
    lo = [x.to(dtype) for x in (q, k, v, g, beta, S0)]
    base = gated_delta_recurrent(*lo[:5], initial_state=lo[5])
    got = gated_delta_chunked(*lo[:5], initial_state=lo[5], kernel=path)
    assert got.out.isfinite().all(), f"{int((~got.out.isfinite()).sum())} non-finite outputs"
    floor = 1e-11 if dtype == torch.float64 else None
    assert_within_budget(got.out, ref.out, base.out, floor=floor, what="out")
    assert_within_budget(got.state, ref.state, base.state, floor=floor, what="state")
    lin = gated_linear_chunked(*lo[:4], initial_state=lo[5])
    lin_ref = gated_linear_recurrent(q, k, v, g, initial_state=S0)
    lin_base = gated_linear_recurrent(*lo[:4], initial_state=lo[5])
    assert_within_budget(lin.out, lin_ref.out, lin_base.out, floor=floor, what="gated linear out")


def _same_nan(got, ref, what):
    assert torch.equal(got.isnan(), ref.isnan()), (
        f"{what}: NaN at tokens {got.isnan().any(-1).nonzero()[:, 2].unique().tolist()[:8]}, the recurrence at "
        f"{ref.isnan().any(-1).nonzero()[:, 2].unique().tolist()[:8]}")
    torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), atol=1e-9, rtol=1e-9, msg=what)


@pytest.mark.parametrize("poison", ["gate", "gate+inf", "key", "value", "beta", "state"])
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_nan_reaches_what_the_recurrence_says(gate, poison, path):
    q, k, v, g, beta, S0 = _inputs(gate, seed=1)
    t = 37  # inside a chunk: tokens 32..36 (torch ops) or 32..36 (kernel) come before it in its chunk
    if poison == "gate":
        g[0, 1, t] = float("nan")
    elif poison == "gate+inf":
        g[0, 1, t] = float("inf")
    elif poison == "key":
        k[1, 0, t, 2] = float("nan")
    elif poison == "value":
        v[1, 1, t, 0] = float("nan")
    elif poison == "beta":
        beta[0, 0, t] = float("nan")
    else:
        S0[1, 0, 2, 3] = float("nan")
    ref = gated_delta_recurrent(q, k, v, g, beta, initial_state=S0)
    got = gated_delta_chunked(q, k, v, g, beta, initial_state=S0, kernel=path)
    assert ref.out.isnan().any() and not ref.out.isnan().all(), "the case must poison some tokens, not all"
    _same_nan(got.out, ref.out, f"delta out, NaN in {poison}")
    _same_nan(got.state, ref.state, f"delta state, NaN in {poison}")
    if poison not in ("beta",):
        lin = gated_linear_chunked(q, k, v, g, initial_state=S0)
        _same_nan(lin.out, gated_linear_recurrent(q, k, v, g, initial_state=S0).out, f"linear out, NaN in {poison}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(("dk", "dv"), [(0, 6), (8, 0), (0, 0)], ids=["Dk0", "Dv0", "both0"])
def test_zero_head_dims_give_zeros(dk, dv, dtype, path):
    q = k = torch.randn(1, 1, 20, dk, dtype=dtype)
    v = torch.randn(1, 2, 20, dv, dtype=dtype)
    g, beta = -torch.rand(1, 2, 20, dtype=dtype), torch.rand(1, 2, 20, dtype=dtype)
    for _ in range(3):  # garbage differed call to call
        got = gated_delta_chunked(q, k, v, g, beta, kernel=path)
        assert got.out.shape == (1, 2, 20, dv) and got.state.shape == (1, 2, dk, dv)
        assert torch.equal(got.out, torch.zeros_like(got.out)), f"largest |out| {float(got.out.abs().max())}"


@pytest.mark.parametrize("wants", ["g", "beta", "state"])
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_gradients_of_gate_beta_or_state_alone_take_the_torch_ops(gate, wants):
    """Only ``g``, ``beta`` or the initial state requires a gradient: the kernel (which has no backward) must not
    run, and the gradient equals the float64 recurrence's."""
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build here: {kernels.unavailable_reason()}")
    q, k, v, g, beta, S0 = _inputs(gate, seed=2)
    lo = dict(q=q.float(), k=k.float(), v=v.float(), g=g.float(), beta=beta.float(), state=S0.float())
    lo[wants].requires_grad_()
    assert delta_path(lo["q"], lo["k"], lo["v"], lo["g"], lo["beta"], initial_state=lo["state"],
                      kernel=DELTA).startswith("torch ops (autograd")
    dout = torch.randn(B, H, N, DV, dtype=torch.float64)
    out = gated_delta_chunked(lo["q"], lo["k"], lo["v"], lo["g"], lo["beta"], initial_state=lo["state"],
                              kernel=DELTA).out
    (out.double() * dout).sum().backward()
    hi = dict(q=q, k=k, v=v, g=g.clone(), beta=beta.clone(), state=S0.clone())
    hi[wants].requires_grad_()
    ref = gated_delta_recurrent(hi["q"], hi["k"], hi["v"], hi["g"], hi["beta"], initial_state=hi["state"]).out
    (ref * dout).sum().backward()
    base_in = {n: t.detach().clone().float().requires_grad_(n == wants) for n, t in hi.items()}
    base = gated_delta_recurrent(base_in["q"], base_in["k"], base_in["v"], base_in["g"], base_in["beta"],
                                 initial_state=base_in["state"]).out
    (base.double() * dout).sum().backward()
    assert_within_budget(lo[wants].grad, hi[wants].grad, base_in[wants].grad, what=f"d{wants}")
