"""Masks: materialize, block maps (exact where analytic), sparsity, drawings, composition, errors."""

import copy

import pytest
import torch

from _helpers import mask_catalogue
from qkv import masks as M
from qkv.masks import EMPTY, FULL, PARTIAL


def _tiles(d, bq, bk):
    """Per-tile any/all from a dense (Bm, Nq, Nk) boolean, by brute force."""
    Bm, nq, nk = d.shape
    out_any, out_all = [], []
    for b in range(Bm):
        ra, rl = [], []
        for i in range(0, nq, bq):
            ca, cl = [], []
            for j in range(0, nk, bk):
                t = d[b, i:i + bq, j:j + bk]
                ca.append(bool(t.any()))
                cl.append(bool(t.all()))
            ra.append(ca)
            rl.append(cl)
        out_any.append(ra)
        out_all.append(rl)
    return torch.tensor(out_any), torch.tensor(out_all)


# Masks whose block map must be exact (not just conservative).
EXACT = {"causal", "causal_top_left", "window", "window_lr", "padding", "prefix_lm", "bigbird", "graph", "dense",
         "from_fn", "causal&padding"}


@pytest.mark.parametrize("kind", [k for k in mask_catalogue(2, 8, 8) if k != "none"])
@pytest.mark.parametrize("nq,nk,bq,bk", [(37, 37, 8, 8), (19, 45, 4, 16), (45, 45, 16, 7), (1, 30, 1, 8)],
                         ids=lambda x: str(x))
def test_block_map_agrees_with_dense(kind, nq, nk, bq, bk):
    m = mask_catalogue(2, nq, nk, seed=nq + nk)[kind]
    d = m.materialize(2, 1, nq, nk)[:, 0]
    bm = m.block_map(nq, nk, bq, bk, B=2, H=1).expand(2, 1, -1, -1)[:, 0]
    any_, all_ = _tiles(d, bq, bk)
    # Sound: FULL tiles are all allowed, EMPTY tiles have nothing allowed.
    assert not ((bm == FULL) & ~all_).any(), "a FULL tile has a masked pair"
    assert not ((bm == EMPTY) & any_).any(), "an EMPTY tile has an allowed pair"
    if kind in EXACT:
        assert torch.equal(bm == FULL, all_) and torch.equal(bm == EMPTY, ~any_), "analytic block map not exact"


def _counting(mask: M.Mask, calls: list) -> M.Mask:
    """The same mask, as a subclass of its own class whose predicate records each call."""
    cls = type(mask)
    counting = type(f"Counting{cls.__name__}", (cls,), {
        "allowed": lambda self, *a: calls.append(cls.__name__) or cls.allowed(self, *a)})
    spy = copy.copy(mask)
    spy.__class__ = counting
    return spy


ANALYTIC = {
    "causal": lambda: M.causal(),
    "window": lambda: M.sliding_window(256),
    "padding": lambda: M.padding([3, 100_000]),
    "bigbird": lambda: M.bigbird(64, 3, 1, 2),
    "strided": lambda: M.strided(128),
    "fixed": lambda: M.fixed(128, 8),
    "global": lambda: M.global_tokens([0, 5]),
    "prefix": lambda: M.prefix_lm([7, 300]),
}


@pytest.mark.parametrize("kind", list(ANALYTIC))
def test_block_map_is_analytic_for_structured_masks(kind):
    """Block maps of analytic masks never evaluate the predicate (so cost is O(tiles)), alone or composed."""
    calls: list = []
    spy = _counting(ANALYTIC[kind](), calls)
    other = _counting(M.sliding_window(64), calls)
    for m in (spy, spy & other, spy | ~other, ~(spy & other) | spy):
        bm = m.block_map(100_000, 100_000, 128, 128)
        assert bm.shape[-2:] == (782, 782)
        assert not calls, f"{m!r}: block_map evaluated the predicate of {calls}"
    (spy | ~other).materialize(2, 1, 4, 100_000)  # the control: the spies are wired into the composition
    assert sorted(set(calls)) == sorted({type(ANALYTIC[kind]()).__name__, "SlidingWindow"}), calls


def test_window_sparsity_and_draw():
    m = M.sliding_window(2)
    assert m.draw(4) == "x...\nxx..\nxxx.\n.xxx"
    assert m.sparsity(4, 4) == pytest.approx(1 - 9 / 16)
    assert M.causal().sparsity(8, 8) == pytest.approx(1 - 36 / 64)


def test_causal_alignments():
    assert M.causal().draw(2, 4) == "xxx.\nxxxx"
    assert M.causal(align="top_left").draw(2, 4) == "x...\nxx.."
    bm = M.causal().block_map(4, 8, 2, 2)[0, 0]
    assert bm.tolist() == [[FULL, FULL, PARTIAL, EMPTY], [FULL, FULL, FULL, PARTIAL]]


def test_composition_operators():
    c, w = M.causal(), M.sliding_window(1, 1)
    d = lambda m: m.materialize(1, 1, 6, 6)[0, 0]
    assert torch.equal(d(c & w), d(c) & d(w))
    assert torch.equal(d(c | w), d(c) | d(w))
    assert torch.equal(d(~c), ~d(c))
    with pytest.raises(TypeError, match="qkv mask"):
        c & torch.ones(2, 2, dtype=torch.bool)


def test_document_from_cu_seqlens_equals_ids():
    a = M.document_from_cu_seqlens(torch.tensor([0, 3, 4, 9]))
    b = M.document(torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2]))
    assert torch.equal(a.materialize(1, 1, 9, 9), b.materialize(1, 1, 9, 9))
    with pytest.raises(ValueError, match="non-decreasing"):
        M.document_from_cu_seqlens(torch.tensor([0, 5, 3]))


def test_bigbird_is_deterministic_for_a_seed():
    a = M.bigbird(4, 3, 1, 2, seed=7).materialize(1, 1, 64, 64)
    b = M.bigbird(4, 3, 1, 2, seed=7).materialize(1, 1, 64, 64)
    c = M.bigbird(4, 3, 1, 2, seed=8).materialize(1, 1, 64, 64)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # Each non-global query block sees window (3) + global (1) + random (2) key blocks, where available.
    coarse = M.bigbird(4, 3, 1, 2, seed=7).coarse(64)
    assert (coarse[1:].sum(1) <= 6).all() and (coarse[2:-2].sum(1) == 6).all()


def test_sparse_transformer_patterns_match_paper_definitions():
    n, s = 20, 4
    p = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    strided = ((p - j < s) | ((p - j) % s == 0)) & (j <= p)
    fixed = ((p // s == j // s) | (j % s >= s - 1)) & (j <= p)
    assert torch.equal(M.strided(s).materialize(1, 1, n, n)[0, 0], strided)
    assert torch.equal(M.fixed(s, 1).materialize(1, 1, n, n)[0, 0], fixed)


def test_graph_from_edges_and_dense_shapes():
    g = M.graph_from_edges(torch.tensor([[0, 1], [1, 2]]), 3)
    assert g.draw(3) == "xx.\n.xx\n..x"
    d = M.dense(torch.ones(2, 3, dtype=torch.bool))
    assert d.materialize(4, 2, 2, 3).shape == (4, 2, 2, 3)


@pytest.mark.parametrize("bad,match", [
    (lambda: M.sliding_window(-1), "left must be >= 0"),
    (lambda: M.sliding_window(2, -3), "right must be >= 0"),
    (lambda: M.sliding_window(2.5), "must be an int"),
    (lambda: M.causal(align="top"), "align must be one of"),
    (lambda: M.padding(torch.tensor([1.0])), "integer"),
    (lambda: M.padding([-1]), ">= 0"),
    (lambda: M.dense(torch.ones(3, 3)), "bool tensor"),
    (lambda: M.strided(0), "stride must be > 0"),
    (lambda: M.fixed(4, 5), "summary"),
    (lambda: M.bigbird(4, window_blocks=2), "odd"),
    (lambda: M.graph(torch.ones(2, 3, dtype=torch.bool)), "square"),
], ids=["neg-left", "neg-right", "float-window", "align", "float-lengths", "neg-lengths", "float-dense",
        "stride0", "summary>block", "bigbird-even", "graph-rect"])
def test_bad_mask_arguments(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bad()


def test_mask_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="batch"):
        M.padding([1, 2, 3]).check(2, 1, 4, 4)
    with pytest.raises(ValueError, match="exceeds the key length"):
        M.padding([9]).check(1, 1, 4, 4)
    with pytest.raises(ValueError, match="length"):
        M.document(torch.zeros(5, dtype=torch.long)).check(1, 1, 4, 4)


def test_from_fn_block_map_covers_every_head_and_batch_row():
    """A predicate that reads b and h must not have tiles skipped on the strength of batch 0 / head 0 alone."""
    m = M.from_fn(lambda b, h, q, k: (k <= q) | (h == 1) | (b == 1))
    before = dict(vars(m))
    m.check(2, 3, 40, 40)
    assert vars(m) == before, "check() must not change the mask"
    bm = m.block_map(40, 40, 8, 8, B=2, H=3)
    d = m.materialize(2, 3, 40, 40)
    any_, all_ = _tiles(d.any(1), 8, 8)
    assert bm.shape[0] == 2
    assert not ((bm[:, 0] == EMPTY) & any_).any()
    assert not ((bm[:, 0] == FULL) & ~_tiles(d.all(1), 8, 8)[1]).any()


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_positions_dense_equals_the_predicate(causal, window):
    """Positions.dense (broadcast rows) equals the generic dense built from allowed() index grids."""
    g = torch.Generator().manual_seed(0)
    for qb, kb in ((1, 3), (3, 3), (3, 1)):
        qp = torch.randint(-1, 9, (qb, 4), generator=g)
        kp = torch.randint(-1, 9, (kb, 7), generator=g)
        m = M.positions(qp, kp, causal=causal, window=window)
        assert torch.equal(m.dense(3, 2, 4, 7), M.Mask.dense(m, 3, 2, 4, 7))
