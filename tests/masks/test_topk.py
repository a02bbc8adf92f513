"""masks.topk: a query row may attend exactly the keys its list names (duplicates once, -1 none), on every view of
the mask (dense, predicate, block map) and on every backend, forward and backward, against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import qkv
from _helpers import make_qkv, reference64, shape_id
from qkv import masks as M
from qkv.masks.base import predicate_block_map


def _lists(B, H, Nq, Nk, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, Nk, (B, H, Nq, K), generator=g)
    idx[0, 0, min(2, Nq - 1)] = -1  # a row that lists nothing
    idx[..., -1] = idx[..., 0]  # duplicates count once
    return idx


def _by_definition(idx, Nk):
    B, H, Nq, K = idx.shape
    out = torch.zeros(B, H, Nq, Nk, dtype=torch.bool)
    for b, h, i in torch.cartesian_prod(torch.arange(B), torch.arange(H), torch.arange(Nq)).tolist():
        for j in idx[b, h, i].tolist():
            if j >= 0:
                out[b, h, i, j] = True
    return out


CASES = [(2, 3, 37, 53, 5), (1, 1, 16, 16, 16), (2, 1, 10, 100, 7), (1, 2, 33, 9, 4),
         (1, 2, 20, 90, 70)]  # K > 64: looked up by a reduction


@pytest.mark.parametrize("B,H,Nq,Nk,K", CASES, ids=[f"B{b}-H{h}-Nq{q}-Nk{k}-K{kk}" for b, h, q, k, kk in CASES])
def test_dense_predicate_and_block_map_mean_the_lists(B, H, Nq, Nk, K):
    idx = _lists(B, H, Nq, Nk, K)
    mask = M.topk(idx)
    truth = _by_definition(idx, Nk)
    assert torch.equal(mask.dense(B, H, Nq, Nk), truth)
    b, h = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
    qi, kj = torch.arange(Nq).view(1, 1, -1, 1), torch.arange(Nk).view(1, 1, 1, -1)
    assert torch.equal(torch.broadcast_to(mask.allowed(b, h, qi, kj, Nq, Nk), truth.shape), truth)
    for bq, bk in ((4, 4), (8, 16), (16, 3)):
        fast = mask.block_map(Nq, Nk, bq, bk, B=B, H=H)
        slow = predicate_block_map(mask, B, H, Nq, Nk, bq, bk, None)
        assert torch.equal(fast, slow.view(slow.shape[0], 1, *slow.shape[1:]).expand_as(fast)), (bq, bk)
    assert mask.sparsity(Nq, Nk, B=B) == pytest.approx(1 - truth.float().mean().item())


def test_full_tiles_and_composition():
    idx = torch.arange(8).expand(1, 1, 8, 8).clone()  # every row lists every key: all tiles FULL
    assert bool((M.topk(idx).block_map(8, 8, 4, 4) == M.FULL).all())
    idx[0, 0, 5, 3] = -1
    bm = M.topk(idx).block_map(8, 8, 4, 4)
    assert bm[0, 0, 1, 0] == M.PARTIAL and bm[0, 0, 1, 1] == M.FULL
    both = M.topk(idx) & M.causal()
    assert torch.equal(both.dense(1, 1, 8, 8), M.topk(idx).dense(1, 1, 8, 8) & M.causal().dense(1, 1, 8, 8))
    assert "x" in both.draw(8)


BACKENDS = ["sdpa", "tiled", "gather"]
SHAPES = [(2, 4, 2, 37, 53, 16, 5, True), (2, 4, 1, 40, 40, 16, 9, False), (1, 2, 2, 17, 30, 8, 3, False)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,K,per_head", SHAPES,
                         ids=[shape_id(*s[:6]) + f"-K{s[6]}-{'per_head' if s[7] else 'shared'}" for s in SHAPES])
def test_backends_match_the_reference_forward_and_backward(backend, B, Hq, Hkv, Nq, Nk, D, K, per_head):
    idx = _lists(B, Hq if per_head else 1, Nq, Nk, K, seed=Nq)
    mask = M.topk(idx) & M.causal()
    master, cast = make_qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, requires_grad=True)
    ref = reference64(master, mask=mask)
    out = qkv.attention(*cast, mask=mask, backend=backend)
    err = (out.double() - ref).abs().max().item()
    assert err < 1e-5, f"{backend}: forward off by {err:.3g}"
    empty = out[0, 0, min(2, Nq - 1)]
    assert bool((empty == 0).all()), "a row that lists nothing returns zeros"
    g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_grads = torch.autograd.grad(ref, master, g)
    grads = torch.autograd.grad(out, cast, g.float())
    for name, a, b in zip("qkv", grads, ref_grads):
        e = (a.double() - b).abs().max().item()
        assert e < 1e-4, f"{backend}: d{name} off by {e:.3g}"


def test_empty_rows_have_minus_infinite_lse():
    idx = torch.full((1, 1, 4, 2), -1)
    idx[0, 0, 1] = torch.tensor([0, 3])
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    for backend in ("reference", "tiled", "gather"):
        out, lse = qkv.attention(q, k, v, mask=M.topk(idx), backend=backend, return_lse=True)
        assert bool(torch.isneginf(lse[:, :, [0, 2, 3]]).all()) and bool(torch.isfinite(lse[:, :, 1]).all()), backend
        assert bool((out[:, :, [0, 2, 3]] == 0).all()), backend


@pytest.mark.parametrize("bad, error, words", [
    (torch.zeros(1, 1, 4, 2), TypeError, "integer tensor"),
    (torch.zeros(1, 4, 2, dtype=torch.int64), ValueError, "4-D"),
    (torch.full((1, 1, 4, 2), -2), ValueError, "-1 for no key"),
    ([[0, 1]], TypeError, "integer tensor"),
])
def test_bad_lists_are_refused(bad, error, words):
    with pytest.raises(error, match=words):
        M.topk(bad)


def test_lists_that_do_not_fit_the_call_are_refused():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="only 4 keys"):
        qkv.attention(q, k, v, mask=M.topk(torch.full((1, 1, 4, 1), 4)))
    with pytest.raises(ValueError, match="3 query rows"):
        qkv.attention(q, k, v, mask=M.topk(torch.zeros(1, 1, 3, 1, dtype=torch.int64)))
    with pytest.raises(ValueError, match="3 heads"):
        qkv.attention(q, k, v, mask=M.topk(torch.zeros(1, 3, 4, 1, dtype=torch.int64)))


def test_long_lists_are_read_as_bitmaps_equal_to_the_comparison_and_small_at_long_context():
    """Lists longer than the unrolled length are read through one bitmap per row when that is smaller than
    comparing every asked key with every listed one: the same answer as the comparison (dense keys, and keys
    asked per row as the gather backend asks them), and 64 rows of 2,048 listed keys over 32K keys cost a
    (64, 32K) bitmap, not a (64, 32K, 2048) comparison (17 GB)."""
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(-1, 70, (2, 3, 9, 80), generator=g)
    m = qkv.masks.topk(idx)
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(3).view(1, -1, 1, 1)
    q = torch.arange(9).view(1, 1, -1, 1)
    rows = idx[b, h, q]
    for kv in (torch.arange(70).view(1, 1, 1, -1), torch.randint(0, 70, (2, 3, 9, 5), generator=g)):
        assert torch.equal(m.allowed(b, h, q, kv, 9, 70), (rows == kv.unsqueeze(-1)).any(-1))
    assert torch.equal(m.allowed(b, h, q, torch.arange(70).view(1, 1, 1, -1), 9, 70), m.dense(2, 3, 9, 70))
    big = qkv.masks.topk(torch.randint(0, 32768, (1, 1, 64, 2048), generator=g))
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    hit = big.allowed(zero, zero, torch.arange(64).view(1, 1, -1, 1), torch.arange(32768).view(1, 1, 1, -1), 64, 32768)
    assert hit.shape == (1, 1, 64, 32768) and int(hit.sum(-1).max()) <= 2048
