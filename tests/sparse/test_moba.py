"""MoBA (qkv.sparse.moba) equals its dense float64 definition (moba_reference), forward and backward, on the
gather path; the selection follows the paper (own block always, causal candidates, top-k by mean-key affinity)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.sparse import moba, moba_blocks, moba_reference

CASES = [  # B, Hq, Hkv, Nq, Nk, D, block_size, topk, causal
    (2, 4, 2, 63, 63, 16, 8, 3, True),
    (1, 2, 1, 20, 53, 8, 7, 2, True),
    (1, 3, 3, 33, 33, 8, 4, 4, False),
    (2, 2, 2, 1, 40, 16, 16, 2, True),
    (1, 2, 2, 30, 30, 8, 8, 10, True),  # topk beyond the number of blocks: every candidate
]


def _id(c):
    B, Hq, Hkv, Nq, Nk, D, bs, t, causal = c
    return f"B{B}-Hq{Hq}-Hkv{Hkv}-Nq{Nq}-Nk{Nk}-D{D}-bs{bs}-top{t}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_moba_equals_its_definition_forward_and_backward(case):
    B, Hq, Hkv, Nq, Nk, D, bs, t, causal = case
    g = torch.Generator().manual_seed(Nq + Nk)
    q64 = torch.randn(B, Hq, Nq, D, dtype=torch.float64, generator=g)
    k64 = torch.randn(B, Hkv, Nk, D, dtype=torch.float64, generator=g)
    v64 = torch.randn(B, Hkv, Nk, D + 3, dtype=torch.float64, generator=g)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        leaves = [x.to(dtype).requires_grad_() for x in (q64, k64, v64)]
        ref_leaves = [x.clone().requires_grad_() for x in (q64, k64, v64)]
        out, lse = moba(*leaves, block_size=bs, topk=t, causal=causal, return_lse=True)
        ref, ref_lse = moba_reference(*ref_leaves, block_size=bs, topk=t, causal=causal)
        assert out.dtype == dtype and out.shape == ref.shape
        err = (out.double() - ref).abs().max().item()
        assert err < tol, f"{dtype}: forward off by {err:.3g}"
        assert (lse.double() - ref_lse).abs().max().item() < 1e-5  # lse may be float32 (auto's backend)
        cot = torch.randn(ref.shape, dtype=torch.float64, generator=g)
        grads = torch.autograd.grad(out, leaves, cot.to(dtype))
        ref_grads = torch.autograd.grad(ref, ref_leaves, cot)
        for name, a, b in zip("qkv", grads, ref_grads):
            e = (a.double() - b).abs().max().item()
            assert e < tol * 10, f"{dtype}: d{name} off by {e:.3g}"


def test_selection_follows_the_paper():
    B, H, N, bs = 1, 1, 32, 8
    q = torch.zeros(B, H, N, 4)
    q[..., 0] = 1.0
    k = torch.zeros(B, H, N, 4)
    k[0, 0, 8:16, 0] = 5.0  # block 1 has the largest mean affinity, block 2 the second
    k[0, 0, 16:24, 0] = 2.0
    ids = moba_blocks(q, k, block_size=bs, topk=2)
    assert ids[0, 0, 3].tolist() == [0, -1], "the first block's queries have only their own block"
    assert ids[0, 0, 12].tolist() == [1, 0], "own block first, then the only past block"
    assert ids[0, 0, 30].tolist() == [3, 1], "own block, then the best past block"
    full = moba_blocks(q, k, block_size=bs, topk=2, causal=False)
    assert full[0, 0, 3].tolist() == [0, 1], "without causality future blocks compete"


def test_moba_reads_only_the_selected_keys_through_the_gather_backend():
    q, k, v = torch.randn(3, 1, 2, 2048, 16).unbind(0)
    ids = moba_blocks(q, k, block_size=16, topk=2)
    keys = ids.unsqueeze(-1) * 16 + torch.arange(16)
    mask = qkv.masks.topk(torch.where(ids.unsqueeze(-1) < 0, -1, keys).flatten(-2)) & qkv.masks.causal()
    assert qkv.explain(q, k, v, mask=mask).chosen == "gather"
    assert torch.equal(moba(q, k, v, block_size=16, topk=2), qkv.attention(q, k, v, mask=mask, backend="gather"))


@pytest.mark.parametrize("kw, words", [
    (dict(block_size=0, topk=1), "block_size"),
    (dict(block_size=4, topk=0), "topk"),
    (dict(block_size=4.0, topk=1), "block_size"),
])
def test_bad_arguments_are_refused(kw, words):
    x = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match=words):
        moba(x, x, x, **kw)


def test_bad_shapes_are_refused():
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        moba(x, x[:, :, :4], x[:, :, :4], block_size=2, topk=1)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        moba(x, torch.randn(1, 3, 8, 4), torch.randn(1, 3, 8, 4), block_size=2, topk=1)
    with pytest.raises(ValueError, match=r"q must be a \(B, H, N, D\)"):
        moba(x[0], x, x, block_size=2, topk=1)
