"""Non-finite values against the operator contract, on every backend that takes the call: a NaN score (a NaN in
q, in a listed key, in a sink) gives a NaN row and a NaN lse, never the empty-row marker (zeros, ``lse = -inf``,
kept for rows with no allowed key); a key holding ``inf`` or NaN that a row's mask excludes leaves that row as
the float64 reference has it (#46 items 1 and 5). The gather backend runs twice: compiled kernel and torch ops."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M

pytestmark = [pytest.mark.xdist_group("cpu_kernels")]

B, HQ, HKV, NQ, NK, D, K = 2, 4, 2, 70, 90, 16, 6
NAN, INF = float("nan"), float("inf")


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, NQ, D, generator=g)
    k = torch.randn(B, HKV, NK, D, generator=g)
    v = torch.randn(B, HKV, NK, D, generator=g)
    idx = torch.randint(0, NK, (B, 1, NQ, K), generator=g)
    idx[:, :, 5] = -1  # row 5 lists no key: the one empty row
    idx[:, :, 6, :2] = -1
    return q, k, v, idx


def _check_rows(out, lse, ref, what):
    """NaN exactly where the float64 reference has it, equal values elsewhere; lse likewise when given."""
    nan_ref, nan_out = ref.out.isnan(), out.isnan()
    assert torch.equal(nan_out, nan_ref), (f"{what}: NaN in {int(nan_out.any(-1).sum())} rows, the reference in "
                                           f"{int(nan_ref.any(-1).sum())}")
    torch.testing.assert_close(out.double().nan_to_num(), ref.out.nan_to_num(), atol=2e-5, rtol=1e-4, msg=what)
    if lse is not None:
        assert torch.equal(lse.isnan(), ref.lse.isnan()), f"{what}: lse NaN pattern differs from the reference"
        assert torch.equal(lse == -INF, ref.lse == -INF), f"{what}: lse = -inf (the empty-row marker) where the " \
                                                          f"reference has a value or NaN"
        torch.testing.assert_close(lse.double().nan_to_num(neginf=-1e9), ref.lse.nan_to_num(neginf=-1e9),
                                   atol=2e-5, rtol=1e-5, msg=what)


def _listed_key(k, idx, b, h, row, j, value):
    idx[b, 0, row, 0] = j  # listed, and before every row's causal bound
    k[b, h, j] = value


POISON = {  # each poisons in place, before the mask is built
    "q": lambda q, k, v, idx, s: q.__setitem__((0, 1, 9, 3), NAN),
    "listed_key": lambda q, k, v, idx, s: _listed_key(k, idx, 1, 0, 12, 4, NAN),
    "inf_key": lambda q, k, v, idx, s: _listed_key(k, idx, 0, 1, 20, 3, INF),  # scores of +inf and -inf: NaN
    "sink": lambda q, k, v, idx, s: s.__setitem__(2, NAN),
}


@pytest.mark.parametrize(("where", "sinks"), [(w, s) for w in POISON for s in (False, True) if s or w != "sink"],
                         ids=lambda x: x if isinstance(x, str) else ("sinks" if x else "no_sinks"))
def test_gather_keeps_nan_rows_nan(where, sinks, kernel_path):
    """The gather backend (``auto``'s choice for large ``masks.topk`` calls): a NaN score makes its row NaN with
    ``lse`` NaN; the empty row stays zeros with ``lse = -inf``; the other rows are untouched."""
    q, k, v, idx = _inputs(1)
    s = torch.randn(HQ) if sinks else None
    POISON[where](q, k, v, idx, s)
    mask = M.topk(idx) & M.causal()
    ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, sinks=None if s is None else s.double(),
                        backend="reference", return_lse=True)
    out, lse = qkv.attention(q, k, v, mask=mask, sinks=s, backend="gather", return_lse=True)
    assert ref.out.isnan().any(), "the poisoned input must reach some row"
    if s is None:
        assert (ref.lse == -INF).any(), "the case must keep an empty row"
    _check_rows(out, lse, ref, f"gather ({kernel_path}), NaN in {where}")


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("where", ["q", "listed_key", "sink"])
def test_every_backend_reports_nan_not_empty(backend, where):
    q, k, v, idx = _inputs(2)
    s = torch.randn(HQ)
    POISON[where](q, k, v, idx, s)
    mask = M.topk(idx)
    ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, sinks=s.double(), backend="reference",
                        return_lse=True)
    out, lse = qkv.attention(q, k, v, mask=mask, sinks=s, backend=backend, return_lse=True)
    _check_rows(out, lse, ref, f"{backend}, NaN in {where}")


def _masks(idx):
    dense = torch.rand(B, 1, NQ, NK, generator=torch.Generator().manual_seed(3)) > 0.5
    dense[..., 0] = True
    return {"topk": M.topk(idx), "padding": M.padding(torch.tensor([NK - 3, NK])),
            "dense": M.dense(dense), "window": M.sliding_window(8), "causal": M.causal()}


@pytest.mark.parametrize("value", [INF, -INF, NAN], ids=["+inf", "-inf", "nan"])
@pytest.mark.parametrize("mask_name", ["topk", "padding", "dense", "window", "causal"])
@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_a_nonfinite_key_behind_a_mask_leaves_other_rows_alone(backend, mask_name, value):
    """A key holding inf or NaN poisons exactly the rows the reference says (those allowed to see it), on sdpa
    (whose additive mask gave ``inf + -inf = NaN`` to every row) and on ``auto``."""
    q, k, v, idx = _inputs(4)
    k[0, 1, NK - 1, 2] = value  # the last key: excluded by padding's row 0, by causal and window for early rows
    k[1, 0, 7, 5] = value
    mask = _masks(idx)[mask_name]
    ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference", return_lse=True)
    out = qkv.attention(q, k, v, mask=mask, backend=backend)
    fine = ~ref.out.isnan().any(-1)
    assert fine.any(), "some rows must not see the poisoned keys"
    _check_rows(out, None, ref, f"{backend} with {mask_name}, key = {value}")


@pytest.mark.parametrize(("backend", "mask_name"), [(b, m) for b in ("sdpa", "auto", "reference", "tiled", "gather")
                                                   for m in ("topk", "padding", "dense", "causal")
                                                   if b != "gather" or m == "topk"])
def test_batch_zero_gives_an_empty_result(backend, mask_name):
    """Batch 0 (``masks.topk`` and the other masks carrying per-row data) is an empty result on every backend that
    takes the mask, not a raw broadcast error (#46 item 8)."""
    q = torch.randn(0, HQ, 5, D)
    kv = torch.randn(0, HKV, 7, D)
    masks = {"topk": M.topk(torch.zeros(0, 1, 5, 3, dtype=torch.long)), "padding": M.padding(torch.zeros(0).long()),
             "dense": M.dense(torch.ones(0, 1, 5, 7, dtype=torch.bool)), "causal": M.causal()}
    out = qkv.attention(q, kv, kv, mask=masks[mask_name], backend=backend)
    assert out.shape == (0, HQ, 5, D)


def test_sdpa_on_meta_tensors_gives_the_shape():
    """The non-finite row repair reads values; meta tensors have none (shape tracing, the docs' matrix on meta)."""
    import qkv
    from qkv import masks

    q = torch.empty(1, 4, 6, 8, device="meta")
    k = v = torch.empty(1, 2, 9, 8, device="meta")
    out = qkv.attention(q, k, v, mask=masks.causal(), backend="sdpa")
    assert out.shape == (1, 4, 6, 8) and out.device.type == "meta"
