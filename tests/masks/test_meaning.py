"""What each mask means, from its definition: every pair (b, i, j) decided by a plain Python loop written
from the paper or the docstring (qkv's positions: query row ``i`` sits at ``p = i + Nk - Nq``, key ``j``
at ``j``), never from ``allowed``. The backend tests only show that backends agree with one another
on ``allowed``; these show that ``allowed`` says what the mask's name promises. The masks' docstring
drawings run as doctests."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch

from qkv import masks as M

# (Nq, Nk): square, a chunk over a cache (Nq < Nk), one query, and more queries than keys.
SIZES = [(7, 7), (3, 11), (1, 9), (9, 4)]
SIZE_IDS = [f"Nq{a}-Nk{b}" for a, b in SIZES]


def brute(rule, B: int, nq: int, nk: int) -> torch.Tensor:
    """(B, nq, nk) bool from ``rule(b, i, j, p)`` evaluated pair by pair."""
    out = torch.zeros(B, nq, nk, dtype=torch.bool)
    for b in range(B):
        for i in range(nq):
            p = i + nk - nq
            for j in range(nk):
                out[b, i, j] = bool(rule(b, i, j, p))
    return out


def check(mask: M.Mask, rule, B: int, nq: int, nk: int) -> None:
    got = mask.materialize(B, 2, nq, nk)
    assert got.shape == (B, 2, nq, nk) and got.dtype == torch.bool
    want = brute(rule, B, nq, nk)
    for h in range(2):
        bad = (got[:, h] != want).nonzero().tolist()
        assert not bad, f"{mask!r} Nq={nq} Nk={nk}: (b, i, j) wrong at {bad[:6]}\nwant\n{want[0].int()}\ngot\n" \
                        f"{got[0, h].int()}"


@pytest.mark.parametrize("nq,nk", SIZES, ids=SIZE_IDS)
def test_causal_bottom_right(nq, nk):
    check(M.causal(), lambda b, i, j, p: j <= i + nk - nq, 1, nq, nk)


@pytest.mark.parametrize("nq,nk", SIZES, ids=SIZE_IDS)
def test_causal_top_left(nq, nk):
    check(M.causal(align="top_left"), lambda b, i, j, p: j <= i, 1, nq, nk)


@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (1, 3), (0, 2), (4, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("nq,nk", SIZES, ids=SIZE_IDS)
def test_sliding_window(nq, nk, left, right):
    """Position ``p`` sees keys ``p - left .. p + right`` inclusive (left + right + 1 keys away from edges)."""
    check(M.sliding_window(left, right), lambda b, i, j, p: p - left <= j <= p + right, 1, nq, nk)


@pytest.mark.parametrize("nq,nk", SIZES, ids=SIZE_IDS)
def test_padding(nq, nk):
    lengths = [nk, 0, min(3, nk)]
    check(M.padding(torch.tensor(lengths)), lambda b, i, j, p: j < lengths[b], 3, nq, nk)


@pytest.mark.parametrize("nq,nk", SIZES, ids=SIZE_IDS)
def test_prefix_lm(nq, nk):
    """Bidirectional over the first ``n[b]`` keys, causal after (T5's prefix LM)."""
    n = [2, 0]
    check(M.prefix_lm(torch.tensor(n)), lambda b, i, j, p: j <= p or j < n[b], 2, nq, nk)


@pytest.mark.parametrize("nq,nk", SIZES, ids=SIZE_IDS)
def test_global_tokens(nq, nk):
    """Global positions see every key and are seen by every query."""
    g = {0, 3}
    check(M.global_tokens(sorted(g)), lambda b, i, j, p: p in g or j in g, 1, nq, nk)


@pytest.mark.parametrize("nq,nk", SIZES, ids=SIZE_IDS)
def test_longformer_window_or_global(nq, nk):
    g = {1}
    check(M.sliding_window(1, 1) | M.global_tokens([1]), lambda b, i, j, p: abs(p - j) <= 1 or p in g or j in g,
          1, nq, nk)


@pytest.mark.parametrize("nq,nk", [(7, 7), (3, 11), (1, 9)], ids=["Nq7-Nk7", "Nq3-Nk11", "Nq1-Nk9"])
def test_document_reads_the_query_id_at_its_position(nq, nk):
    ids = torch.tensor([[0] * 3 + [1] * (nk - 5) + [2] * 2, [5] * nk])
    check(M.document(ids), lambda b, i, j, p: ids[b, p] == ids[b, j], 2, nq, nk)


def test_document_with_query_ids_and_cu_seqlens():
    kv = torch.tensor([0, 0, 1, 1, 1, 2])
    q = torch.tensor([1, 2, 0])
    check(M.document(kv, q_ids=q), lambda b, i, j, p: q[i] == kv[j], 1, 3, 6)
    check(M.document_from_cu_seqlens(torch.tensor([0, 2, 5, 6])), lambda b, i, j, p: kv[p] == kv[j], 1, 6, 6)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 2), (False, None), (False, 3)],
                         ids=["causal", "causal-W2", "bidirectional", "bidirectional-W3"])
def test_positions_with_explicit_ids(causal, window):
    """Slots out of position order (a ring buffer) and padding (-1): the rule goes by the ids alone."""
    qp = torch.tensor([[5, 6], [-1, 2]])
    kp = torch.tensor([[4, 0, 5, 6, 3, -1], [0, 1, 2, -1, -1, -1]])

    def rule(b, i, j, p):
        a, k = int(qp[b, i]), int(kp[b, j])
        return a >= 0 and k >= 0 and (not causal or k <= a) and (window is None or a - k < window)

    check(M.positions(qp, kp, causal=causal, window=window), rule, 2, 2, 6)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_strided(causal):
    """Sparse Transformer strided: the previous ``stride`` positions, or a multiple of ``stride`` back."""
    s = 3

    def rule(b, i, j, p):
        ok = abs(p - j) < s or (p - j) % s == 0
        return ok and j <= p if causal else ok

    check(M.strided(s, causal=causal), rule, 1, 10, 10)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_fixed(causal):
    """Sparse Transformer fixed: the query's own block, or the last ``summary`` keys of every block."""
    block, summary = 4, 1

    def rule(b, i, j, p):
        ok = p // block == j // block or j % block >= block - summary
        return ok and j <= p if causal else ok

    check(M.fixed(block, summary, causal=causal), rule, 1, 11, 11)


@pytest.mark.parametrize("nk,block,window,glob,rand", [(40, 4, 3, 1, 2), (37, 5, 1, 2, 1), (24, 3, 3, 0, 1)],
                         ids=["NB10-W3-G1-R2", "NB8-ragged-W1-G2-R1", "NB8-W3-G0-R1"])
def test_bigbird_pattern(nk, block, window, glob, rand):
    """Zaheer et al. 2020: per query block, the centred window of ``window`` blocks, the first ``glob`` blocks
    (which also see every block), and exactly ``rand`` further blocks chosen at random outside those; every
    token pair follows its block pair; the same seed gives the same draw."""
    mask = M.bigbird(block, window, glob, rand, seed=7)
    d = mask.materialize(1, 1, nk, nk)[0, 0]
    nb = -(-nk // block)
    blocks = torch.zeros(nb, nb, dtype=torch.bool)
    for qb in range(nb):
        for kb in range(nb):
            tile = d[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block]
            assert tile.all() or not tile.any(), f"tile ({qb}, {kb}) is not uniform"
            blocks[qb, kb] = bool(tile.any())
    for qb in range(nb):
        fixed = {kb for kb in range(nb) if abs(qb - kb) <= window // 2 or kb < glob or qb < glob}
        seen = {kb for kb in range(nb) if blocks[qb, kb]}
        assert fixed <= seen, f"query block {qb}: window/global blocks {sorted(fixed - seen)} missing"
        extra = seen - fixed
        want = 0 if qb < glob else min(rand, nb - len(fixed))
        assert len(extra) == want, f"query block {qb}: {len(extra)} random blocks {sorted(extra)}, want {want}"
    draws = {tuple(M.bigbird(block, window, glob, rand, seed=s).materialize(1, 1, nk, nk).flatten().tolist())
             for s in range(4)}
    assert torch.equal(M.bigbird(block, window, glob, rand, seed=7).materialize(1, 1, nk, nk)[0, 0], d)
    assert len(draws) > 1, "different seeds never changed the random blocks"


def test_bigbird_bottom_right_chunk_reads_the_same_rows():
    """A chunk of queries at the end sees the rows the full square mask gives those positions."""
    mask = M.bigbird(4, 3, 1, 1, seed=3)
    full = mask.materialize(1, 1, 32, 32)[0, 0]
    assert torch.equal(mask.materialize(1, 1, 5, 32)[0, 0], full[-5:])


@pytest.mark.parametrize("module", ["qkv.masks", "qkv.masks.base", "qkv.masks.causal", "qkv.masks.sequence",
                                    "qkv.masks.sparse", "qkv.masks.explicit"])
def test_mask_docstring_drawings(module):
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{module}: {result.failed} of {result.attempted} doctest examples failed"
    if module != "qkv.masks.base":
        assert result.attempted > 0, f"{module} has no runnable example"
