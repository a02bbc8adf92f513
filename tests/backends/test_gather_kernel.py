"""The compiled CPU kernel of the gather backend (qkv/cpu/csrc/gather_attention.cpp): calls that need no gradient
read the listed keys in place. It equals the float64 reference on every layout it takes (lists shared or per head,
GQA/MHA/MQA, groups of whole vectors (heads in lanes) or not (BLAS products), a list batch of 1, strided queries,
repeats and -1, empty rows, causal terms of either alignment, sinks, lists longer than a tile), float32 within the
budget; explain says when it runs and why not; with the
kernel switched off or unbuildable the torch ops give the same values."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.cpu import kernels

pytestmark = pytest.mark.xdist_group("cpu_kernels")  # one worker builds the kernels; the others' tests need none

LAYOUTS = {  # (B, Hq, Hkv, Nq, Nk, K, per_head, list batch)
    "mqa-shared": (2, 4, 1, 19, 40, 9, False, 2),
    "gqa-shared-batch1": (3, 6, 2, 13, 30, 7, False, 1),
    "mha-per-head": (2, 3, 3, 11, 25, 6, True, 2),
    "gqa-per-head": (1, 4, 2, 16, 16, 20, True, 1),  # K > Nk: repeats certain
    # groups of whole vectors (16 float32 / 8 float64 lanes with AVX-512): the heads-in-lanes products
    "lanes-mqa-16": (1, 16, 1, 9, 50, 13, False, 1),
    "lanes-gqa-32": (2, 64, 2, 7, 40, 22, False, 2),
}
CAUSAL = {"none": None, "bottom_right": M.causal(), "top_left": M.causal("top_left"),
          "both": M.causal() & M.causal("top_left")}


def _inputs(layout, dtype, seed=0):
    B, Hq, Hkv, Nq, Nk, K, per_head, Bi = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Nq, Hq, 16, dtype=dtype, generator=g).transpose(1, 2)  # strided, as a (B, N, H, D) model
    k = torch.randn(B, Hkv, Nk, 16, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Nk, 12, dtype=dtype, generator=g)
    idx = torch.randint(-1, Nk, (Bi, Hq if per_head else 1, Nq, K), generator=g)
    idx[..., 1] = idx[..., 0]  # a repeat counts once
    idx[:, :, 2] = -1  # a row that lists nothing
    return q, k, v, idx


def _check(got, ref, dtype):
    out, lse = got
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert (out.double() - ref.out.double()).abs().max() < tol
    finite = torch.isfinite(ref.lse)
    assert torch.equal(finite, torch.isfinite(lse)), "empty rows: lse -inf, the same rows"
    if finite.any():
        assert (lse[finite].double() - ref.lse[finite].double()).abs().max() < max(tol, 1e-6)
    assert (out[~finite.unsqueeze(-1).expand_as(out)] == 0).all(), "empty rows return zeros"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", list(CAUSAL))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_equals_the_reference(layout, causal, dtype):
    if kernels.unavailable_reason():
        pytest.fail(f"the compiled kernels must build on this machine: {kernels.unavailable_reason()}")
    q, k, v, idx = _inputs(layout, dtype)
    mask = M.topk(idx) if CAUSAL[causal] is None else M.topk(idx) & CAUSAL[causal]
    sinks = torch.randn(q.shape[1], dtype=dtype, generator=torch.Generator().manual_seed(3))
    for s in (None, sinks):
        report = qkv.explain(q, k, v, mask=mask, sinks=s, return_lse=True)
        assert "compiled CPU kernel" in str(report.estimates["gather"]), report
        got = qkv.attention(q, k, v, mask=mask, sinks=s, backend="gather", return_lse=True)
        ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference", return_lse=True,
                            sinks=None if s is None else s.double())
        _check(got, ref, dtype)
        assert got.out.dtype == dtype and got.lse.dtype == dtype


@pytest.mark.parametrize("heads", [(4, 4), (16, 1)], ids=["blas", "lanes"])
def test_lists_longer_than_a_tile_merge_exactly(monkeypatch, heads):
    monkeypatch.setattr(kernels, "TILE_BYTES", 16)  # 16 keys per tile: every row spans many tiles
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, heads[0], 50, 32, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, heads[1], 300, 32, dtype=torch.float64, generator=g) for _ in range(2))
    idx = torch.randint(-1, 300, (2, 1, 50, 200), generator=g)
    mask = M.topk(idx) & M.causal()
    # scores far apart between tiles: the running maximum must rescale what came before
    q = q * torch.linspace(0.1, 8.0, 50, dtype=torch.float64).view(1, 1, 50, 1)
    ref = qkv.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    _check(qkv.attention(q, k, v, mask=mask, backend="gather", return_lse=True), ref, torch.float64)


def test_gradients_take_the_torch_ops_and_stay_exact():
    q, k, v, idx = _inputs("gqa-shared-batch1", torch.float64)
    q.requires_grad_(True)
    mask = M.topk(idx) & M.causal()
    why = str(qkv.explain(q, k, v, mask=mask).estimates["gather"])
    assert "as torch ops (gradients needed" in why, why
    out = qkv.attention(q, k, v, mask=mask, backend="gather")
    (g,) = torch.autograd.grad(out.square().sum(), q)
    qr = q.detach().clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(qkv.attention(qr, k, v, mask=mask, backend="reference").square().sum(), qr)
    assert (g - gr).abs().max() < 1e-12
    with torch.no_grad():  # the same request without autograd: the kernel
        assert "compiled CPU kernel" in str(qkv.explain(q, k, v, mask=mask).estimates["gather"])


@pytest.mark.parametrize("term", ["window", "padding", "softcap", "bfloat16"])
def test_what_the_kernel_does_not_take_is_said_and_computed_by_torch_ops(term):
    q, k, v, idx = _inputs("mqa-shared", torch.float32)
    mask, kw = M.topk(idx), {}
    if term == "window":
        mask = mask & M.causal() & M.sliding_window(5)
    elif term == "padding":
        mask = mask & M.padding(torch.tensor([30, 40]))
    elif term == "softcap":
        kw = {"score_mod": qkv.mods.softcap(5.0)}
    else:
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    why = str(qkv.explain(q, k, v, mask=mask, **kw).estimates["gather"])
    assert "as torch ops (" in why and "compiled" not in why, why
    got = qkv.attention(q, k, v, mask=mask, backend="gather", **kw)
    ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference", **kw)
    assert (got.double() - ref).abs().max() < (2e-2 if term == "bfloat16" else 2e-6)


def test_switched_off_by_the_environment(monkeypatch):
    q, k, v, idx = _inputs("gqa-per-head", torch.float32)
    mask = M.topk(idx) & M.causal()
    on = qkv.attention(q, k, v, mask=mask, backend="gather", return_lse=True)
    monkeypatch.setenv(kernels.ENV, "0")
    assert kernels.unavailable_reason() == f"{kernels.ENV}=0 in the environment"
    assert f"as torch ops ({kernels.ENV}=0" in str(qkv.explain(q, k, v, mask=mask).estimates["gather"])
    off = qkv.attention(q, k, v, mask=mask, backend="gather", return_lse=True)
    assert (on.out - off.out).abs().max() < 2e-6
    assert torch.equal(torch.isfinite(on.lse), torch.isfinite(off.lse))


def test_a_failed_build_is_reported_once_and_the_torch_ops_run(monkeypatch):
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_failure", None)

    def broken():
        raise OSError("no compiler here")

    monkeypatch.setattr(kernels, "_build", broken)
    with pytest.warns(RuntimeWarning, match="building qkv's CPU kernels failed .OSError: no compiler here"):
        assert kernels.load() is None
    assert "no compiler here" in kernels.unavailable_reason()
    q, k, v, idx = _inputs("mqa-shared", torch.float64)
    mask = M.topk(idx)
    assert "no compiler here" in str(qkv.explain(q, k, v, mask=mask).estimates["gather"])
    ref = qkv.attention(q, k, v, mask=mask, backend="reference")
    assert (qkv.attention(q, k, v, mask=mask, backend="gather") - ref).abs().max() < 1e-12


def test_random_requests_match_the_reference():
    """Seeded random shapes, lists and terms: no layout the cases above name."""
    g = torch.Generator().manual_seed(7)
    for trial in range(25):
        r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
        Hkv, G, B = r(1, 3), (r(1, 5) if trial % 3 else 8 * r(1, 4)), r(1, 3)
        Hq, Nq, Nk, K, D, Dv = Hkv * G, r(1, 40), r(0, 90), r(0, 70) if trial else 0, r(1, 40), r(1, 40)
        per_head = bool(r(0, 1))
        idx = torch.randint(-1, max(Nk, 1), (r(0, 1) * (B - 1) + 1, Hq if per_head else 1, Nq, K), generator=g)
        if Nk == 0:
            idx.fill_(-1)
        q = torch.randn(B, Hq, Nq, D, dtype=torch.float64, generator=g) * r(1, 6)
        k = torch.randn(B, Hkv, Nk, D, dtype=torch.float64, generator=g)
        v = torch.randn(B, Hkv, Nk, Dv, dtype=torch.float64, generator=g)
        mask = M.topk(idx)
        if r(0, 1):
            mask = mask & M.causal("top_left" if r(0, 1) else "bottom_right")
        sinks = torch.randn(Hq, dtype=torch.float64, generator=g) if r(0, 1) else None
        got = qkv.attention(q, k, v, mask=mask, sinks=sinks, backend="gather", return_lse=True)
        ref = qkv.attention(q, k, v, mask=mask, sinks=sinks, backend="reference", return_lse=True)
        _check(got, ref, torch.float64)
        assert not math.isnan(float(got.out.sum())), trial


@pytest.mark.parametrize("heads", [(16, 1), (6, 2)], ids=["lanes", "blas"])
def test_row_blocks_and_key_windows(heads):
    """More query rows than one block (64) and keys across several windows (4,096): each row's keys are bucketed
    by window and the block's rows walk the windows together; the result is the same attention."""
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(11)
    Nq, Nk, K = 150, 9000, 300
    q = torch.randn(1, Hq, Nq, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, Hkv, Nk, 16, dtype=torch.float64, generator=g) for _ in range(2))
    idx = torch.randint(-1, Nk, (1, 1, Nq, K), generator=g)
    idx[0, 0, :, :50] = torch.arange(Nk - 50, Nk)  # the newest keys, listed by every row
    mask = M.topk(idx) & M.causal()
    ref = qkv.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    _check(qkv.attention(q, k, v, mask=mask, backend="gather", return_lse=True), ref, torch.float64)
