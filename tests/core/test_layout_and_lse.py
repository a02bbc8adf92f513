"""``layout="bnhd"`` (read through views, stated by explain) and the log-sum-exp contract (``qkv.lse``)."""

from __future__ import annotations

import pytest
import torch

import qkv
from _helpers import make_qkv
from qkv import backends
from qkv import lse as L
from qkv import masks as M


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_bnhd_equals_bhnd_and_returns_bnhd(backend):
    _, (q, k, v) = make_qkv(2, 4, 2, 9, 13, 8, 12, requires_grad=True)
    mask = M.causal() & M.padding(torch.tensor([13, 7]))
    want_lse = backend != "sdpa"
    ref = qkv.attention(q, k, v, mask=mask, backend=backend, return_lse=want_lse)
    qb, kb, vb = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))  # (B, N, H, D)
    got = qkv.attention(qb, kb, vb, mask=mask, backend=backend, return_lse=want_lse, layout="bnhd")
    out, out_ref = (got.out, ref.out) if want_lse else (got, ref)
    assert out.shape == (2, 9, 4, 12)
    assert torch.allclose(out, out_ref.transpose(1, 2), atol=1e-6)
    if want_lse:
        assert got.lse.shape == (2, 4, 9) and torch.allclose(got.lse, ref.lse, atol=1e-6)
    g = torch.autograd.grad(out.sum(), (qb, kb, vb))
    g_ref = torch.autograd.grad(out_ref.sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        assert torch.allclose(a, b.transpose(1, 2), atol=1e-5)


def test_bnhd_reaches_the_backend_as_a_view_without_a_copy(monkeypatch):
    sdpa = backends.get("sdpa")
    seen = {}
    original = sdpa.run

    def spy(req):
        seen["ptrs"] = [t.data_ptr() for t in (req.q, req.k, req.v)]
        seen["shape"] = tuple(req.q.shape)
        return original(req)

    monkeypatch.setattr(sdpa, "run", spy)
    q = torch.randn(2, 5, 4, 8)
    qkv.attention(q, q, q, layout="bnhd", backend="sdpa")
    assert seen["ptrs"] == [q.data_ptr()] * 3 and seen["shape"] == (2, 4, 5, 8)


def test_explain_states_the_layout():
    q = torch.randn(1, 6, 2, 8)
    assert "layout (B, N, H, D)" in qkv.explain(q, q, q, layout="bnhd").request
    assert "layout (B, H, N, D)" in qkv.explain(q, q, q).request


def test_shape_error_suggests_the_layout_that_fits():
    q, k = torch.randn(1, 7, 4, 8), torch.randn(1, 9, 2, 8)  # (B, N, H, D), GQA 4:2
    with pytest.raises(ValueError, match="pass layout='bnhd'"):
        qkv.attention(q, k, k)
    out = qkv.attention(q, k, k, layout="bnhd")
    assert out.shape == (1, 7, 4, 8)
    with pytest.raises(ValueError, match="layout must be one of"):
        qkv.attention(q, k, k, layout="nhd")
    with pytest.raises(ValueError, match="rank-4"):
        qkv.attention(q[0], k[0], k[0], layout="bnhd")


def test_base2_and_token_major_round_trip_and_keep_minus_inf():
    lse = torch.tensor([[[0.5, float("-inf"), 3.0]], [[-2.0, 1.0, 0.0]]])  # (B=2, H=1, N=3)
    assert torch.allclose(L.from_base2(L.to_base2(lse)), lse)
    assert torch.isneginf(L.to_base2(lse)[0, 0, 1])
    assert torch.allclose(L.to_base2(lse)[torch.isfinite(lse)], lse[torch.isfinite(lse)] / 0.6931471805599453)
    assert L.to_token_major(lse).shape == (2, 3, 1) and torch.equal(L.from_token_major(L.to_token_major(lse)), lse)


def _split():
    (q, k, v), _ = make_qkv(2, 4, 2, 6, 20, 8, dtype=torch.float64)
    mask = M.causal() & M.padding(torch.tensor([20, 9]))  # batch 1: the second half has no allowed key
    whole = qkv.attention(q, k, v, mask=mask, backend="reference")
    parts = []
    for lo, hi in ((0, 12), (12, 20)):
        kvp = torch.arange(lo, hi).expand(2, hi - lo).clone()
        kvp[1, kvp[1] >= 9] = -1
        sub = M.positions(torch.arange(14, 20).expand(2, 6), kvp)
        parts.append(qkv.attention(q, k[:, :, lo:hi], v[:, :, lo:hi], mask=sub, return_lse=True, backend="reference"))
    return whole, parts


def test_merging_a_base2_token_major_partial_equals_the_single_call():
    whole, (a, b) = _split()
    assert torch.isneginf(b.lse[1]).all(), "the second part of batch 1 is empty: lse -inf"
    # What a base-2, (B, N, H, D)-layout kernel would hand over for part b:
    foreign_out, foreign_lse = b.out.transpose(1, 2), L.to_token_major(L.to_base2(b.lse))
    merged = qkv.merge_states([a.out, foreign_out.transpose(1, 2)],
                              [a.lse, L.from_base2(L.from_token_major(foreign_lse))])
    assert torch.allclose(merged.out, whole, atol=1e-6), (merged.out - whole).abs().max()
    # In the token-major layout throughout, merge_states works the same (it only needs lse = out.shape[:-1]).
    merged_t = qkv.merge_states([a.out.transpose(1, 2), foreign_out],
                                [L.to_token_major(a.lse), L.from_base2(foreign_lse)])
    assert torch.allclose(merged_t.out.transpose(1, 2), whole, atol=1e-6)


def test_reading_a_base2_lse_as_natural_is_wrong_and_detectable():
    """The silent error the contract exists for: unconverted base-2 partials mis-weight the merge."""
    whole, (a, b) = _split()
    wrong = qkv.merge_states([a.out, b.out], [a.lse, L.to_base2(b.lse)])
    assert (wrong.out - whole).abs().max() > 1e-3


@pytest.mark.parametrize("fn,arg,err", [
    (L.to_base2, [1.0], TypeError), (L.from_base2, torch.tensor([1]), TypeError),
    (L.to_token_major, torch.zeros(2, 3), ValueError), (L.from_token_major, torch.zeros(1, 2, 3, 4), ValueError),
], ids=["list", "int", "rank2", "rank4"])
def test_bad_lse_input_is_named(fn, arg, err):
    with pytest.raises(err, match=fn.__name__):
        fn(arg)
