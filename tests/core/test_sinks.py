"""Learnable attention sinks (``sinks=``) on every backend, against the definition in float64.

The expected result is written out here, independent of qkv: the sink logit is one more softmax column
with no value. Forward, the log-sum-exp (which includes the sink) and gradients of q, k, v and the sinks.
"""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from _helpers import make_qkv, shape_id
from qkv import backends
from qkv import masks as M
from qkv._request import AttentionOutput
from qkv.backends.base import Backend, Estimate
from qkv.backends.reference import reference_attention
from qkv.testing import assert_within_budget


def by_definition(q, k, v, sinks, allowed, scale=None):
    """softmax over [scores of allowed keys, sink] in the inputs' dtype; the sink column is dropped."""
    B, Hq, Nq, D = q.shape
    g = Hq // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kr.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(B, Hq, Nq, 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1)[..., :-1]
    return p @ vr, lse


SHAPES = [(2, 4, 2, 9, 9, 16), (1, 6, 3, 5, 13, 8), (2, 2, 2, 33, 17, 32)]


def _sinks(Hq, dtype, seed=5):
    z = torch.randn(Hq, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    return z.to(dtype).to(torch.float64).requires_grad_(), z.to(dtype).requires_grad_()


@pytest.mark.parametrize("backend", ["reference", "tiled", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: shape_id(*s))
def test_sinks_forward_lse_and_gradients(shape, dtype, backend):
    B, Hq, Hkv, Nq, Nk, D = shape
    master, cast = make_qkv(*shape, dtype=dtype, requires_grad=True)
    z64, z = _sinks(Hq, dtype)
    lengths = torch.tensor([Nk, 0])[:B]  # batch 1 has no key at all: all its mass goes to the sink
    mask = M.causal() & M.padding(lengths)
    allowed = mask.materialize(B, Hq, Nq, Nk)
    want_lse = backend != "sdpa"
    res = qkv.attention(*cast, mask=mask, sinks=z, backend=backend, return_lse=want_lse)
    out = res.out if want_lse else res
    ref_out, ref_lse = by_definition(*master, z64, allowed)
    base_leaves = [t.detach().clone().requires_grad_() for t in cast]
    zb = z.detach().clone().requires_grad_()
    base_out, base_lse = by_definition(*base_leaves, zb, allowed)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_within_budget(out.detach(), ref_out.detach(), base_out.detach(), what="out")
    if B > 1:
        assert (out[1] == 0).all(), "a row with no key puts all its mass on the sink: zeros"
    if want_lse:
        assert res.lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert_within_budget(res.lse.detach(), ref_lse.detach(), base_lse.detach().float(), what="lse")
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    loss = lambda o, lse: (o * w.to(o.dtype)).sum() + (lse.sum() if want_lse else 0)  # noqa: E731
    g = torch.autograd.grad(loss(out, res.lse if want_lse else None), [*cast, z])
    gr = torch.autograd.grad(loss(ref_out, ref_lse), [*master, z64])
    gb = torch.autograd.grad(loss(base_out, base_lse), [*base_leaves, zb])
    for name, a, r, b in zip(["q", "k", "v", "sinks"], g, gr, gb):
        assert_within_budget(a, r, b, what=f"d{name}")


class _LseOnly(Backend):
    """The reference without native sinks: exercises qkv.attention's generic merge from the lse."""

    name = "lse_only"

    def decline(self, req):
        return None

    def estimate(self, req):
        return Estimate(math.inf, "test backend, never chosen by auto")

    def run(self, req):
        assert req.sinks is None and req.return_lse, "a backend without native sinks gets neither"
        res = reference_attention(req)
        return AttentionOutput(res.out, res.lse)


def test_backends_without_native_sinks_get_them_merged_from_the_lse(monkeypatch):
    monkeypatch.setitem(backends._loaded, "lse_only", _LseOnly())
    master, cast = make_qkv(2, 4, 2, 7, 11, 8, dtype=torch.float32, requires_grad=True)
    z64, z = _sinks(4, torch.float32)
    mask = M.sliding_window(3)
    res = qkv.attention(*cast, mask=mask, sinks=z, backend="lse_only", return_lse=True)
    ref_out, ref_lse = by_definition(*master, z64, mask.materialize(2, 4, 7, 11))
    assert torch.allclose(res.out, ref_out.float(), atol=1e-5) and torch.allclose(res.lse, ref_lse.float(), atol=1e-5)
    gz = torch.autograd.grad(res.out.sum() + res.lse.sum(), z)[0]
    gz_ref = torch.autograd.grad(ref_out.sum() + ref_lse.sum(), z64)[0]
    assert torch.allclose(gz.double(), gz_ref, atol=1e-4), (gz, gz_ref)


@pytest.mark.parametrize("nk", [200, 256, 1], ids=["ragged-tile", "new-tile", "one-key"])
def test_flex_sink_key_block_map_is_exact(nk):
    """Flex runs sinks as one more key; its block map (from the mask's, O(tiles)) equals the dense count."""
    from qkv.backends.flex import _SinkKey
    from qkv.masks.base import block_map_from_dense

    for inner in (None, M.causal() & M.padding(torch.tensor([nk, min(3, nk)])), M.sliding_window(40)):
        sk = _SinkKey(inner, nk)
        got = sk.block_map(200, nk + 1, 128, 128)
        want = block_map_from_dense(sk.dense(2, 1, 200, nk + 1)[:, 0], 128, 128)
        assert torch.equal(got[:, 0], want.expand(got.shape[0], -1, -1)), (inner, got, want)


@pytest.mark.slow
def test_flex_runs_sinks_as_one_more_key():
    """Flex compiles (tens of seconds on CPU): forward with sinks, a mask with an empty row and softcap."""
    if qkv.backends.get("flex").decline(qkv._request.build_request(*make_qkv(1, 2, 2, 8, 8, 16)[1])) is not None:
        pytest.skip("FlexAttention cannot run here")
    master, cast = make_qkv(2, 4, 2, 200, 200, 32)
    z64, z = _sinks(4, torch.float32)
    mask = M.causal() & M.padding(torch.tensor([200, 0]))
    with torch.no_grad():
        out = qkv.attention(*cast, mask=mask, sinks=z, backend="flex")
    ref_out, _ = by_definition(*master, z64.detach(), mask.materialize(2, 4, 200, 200))
    base_out, _ = by_definition(*cast, z.detach(), mask.materialize(2, 4, 200, 200))
    assert_within_budget(out, ref_out.detach(), base_out.detach(), what="flex out")
    assert (out[1] == 0).all()


def test_probabilities_with_sinks_leave_the_sink_its_share():
    _, (q, k, v) = make_qkv(1, 2, 2, 6, 6, 8)
    z = torch.tensor([0.0, 3.0])
    p = qkv.attention_probs(q, k, v, mask=M.causal(), sinks=z)
    lse = qkv.attention(q, k, v, mask=M.causal(), sinks=z, return_lse=True, backend="reference").lse
    sink_share = torch.exp(z.view(1, 2, 1) - lse)
    assert torch.allclose(p.sum(-1) + sink_share, torch.ones_like(sink_share), atol=1e-5)


def test_sinks_equal_to_minus_large_change_nothing():
    _, (q, k, v) = make_qkv(2, 2, 2, 5, 5, 8)
    plain = qkv.attention(q, k, v, mask=M.causal())
    for backend in ("reference", "tiled", "sdpa"):
        out = qkv.attention(q, k, v, mask=M.causal(), sinks=torch.full((2,), -1e4), backend=backend)
        assert torch.allclose(out, plain, atol=1e-6), backend


@pytest.mark.parametrize("sinks,err,match", [
    (torch.zeros(3), ValueError, "shape \\(Hq,\\)"),
    (torch.zeros(2, 1), ValueError, "shape \\(Hq,\\)"),
    (torch.zeros(2, dtype=torch.long), TypeError, "float tensor"),
    ([0.0, 0.0], TypeError, "float tensor"),
], ids=["heads", "rank", "dtype", "list"])
def test_bad_sinks_are_named(sinks, err, match):
    _, (q, k, v) = make_qkv(1, 2, 2, 4, 4, 8)
    with pytest.raises(err, match=match):
        qkv.attention(q, k, v, sinks=sinks)


NO_GRAD_SHAPES = SHAPES + [(2, 8, 2, 1, 40, 16), (1, 8, 1, 1, 7, 8), (3, 4, 4, 1, 129, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", NO_GRAD_SHAPES, ids=lambda s: shape_id(*s))
def test_sdpa_sinks_without_gradient_from_the_lse(shape, dtype, monkeypatch):
    """Without autograd the SDPA backend applies the sinks after the CPU flash kernel, from its log-sum-exp
    (query heads folded into rows for one-query GQA); against the definition in float64 and the sink-as-a-key
    path, with a keyless row (zeros), a window and padding."""
    from qkv.backends import sdpa

    B, Hq, Hkv, Nq, Nk, D = shape
    master, cast = make_qkv(*shape, dtype=dtype)
    z64, z = (t.detach() for t in _sinks(Hq, dtype))
    lengths = torch.tensor([Nk, 0, max(Nk - 3, 1)])[:B]
    mask = M.causal() & M.padding(lengths) & M.sliding_window(max(Nk // 2, 1))
    allowed = mask.materialize(B, Hq, Nq, Nk)
    taken = []
    real = sdpa._sinks_by_lse
    monkeypatch.setattr(sdpa, "_sinks_by_lse", lambda req: taken.append(1) or real(req))
    with torch.no_grad():
        out = qkv.attention(*cast, mask=mask, sinks=z, backend="sdpa")
        ref_out, _ = by_definition(*master, z64, allowed)
        base_out, _ = by_definition(*cast, z, allowed)
        monkeypatch.setattr(sdpa, "_sinks_by_lse", lambda req: None)
        as_key = qkv.attention(*cast, mask=mask, sinks=z, backend="sdpa")
    assert taken and out.dtype == dtype and torch.isfinite(out).all()
    assert_within_budget(out, ref_out, base_out, what="out")
    assert_within_budget(out, ref_out, as_key, what="out against the sink-as-a-key path")
    if B > 1:
        assert (out[1] == 0).all(), "a row with no key puts all its mass on the sink: zeros"


def test_sdpa_sinks_with_gradient_keep_the_key_path(monkeypatch):
    """With a gradient to record, the sinks stay one more key (the flash kernel's lse has no backward)."""
    from qkv.backends import sdpa

    _, cast = make_qkv(1, 4, 2, 1, 9, 8, dtype=torch.float32, requires_grad=True)
    assert sdpa._sinks_by_lse(_request(cast, _sinks(4, torch.float32)[1])) is None
    with torch.no_grad():
        assert sdpa._sinks_by_lse(_request(cast, _sinks(4, torch.float32)[1])) is not None


def _request(qkv_tensors, sinks):
    from qkv._request import Request

    q, k, v = qkv_tensors
    return Request(q=q, k=k, v=v, mask=None, score_mod=None, scale=q.shape[-1] ** -0.5, sinks=sinks)
