"""Nothing silently wrong, round three (issue 29): the operator, masks and backends.

One test per finding, each named after what it checks. Every numerical check compares against a float64
computation written out here (not qkv's reference backend) with an error budget (qkv.testing).
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.masks.base import EMPTY
from qkv.testing import assert_within_budget


def _by_definition(q, k, v, allowed, dtype):
    """softmax(scale q k^T, masked) v in ``dtype``; ``allowed`` (Nq, Nk) or broadcastable to (B, H, Nq, Nk)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def _dilated(b, h, q, k):
    """A user mask on positions: causal, every other key (the dilated window of the finding)."""
    return (k <= q) & ((q - k) % 2 == 0)


def _positions_mask(nq, nk):
    qp = torch.arange(nq).view(-1, 1) + nk - nq
    kp = torch.arange(nk).view(1, -1)
    return (kp <= qp) & ((qp - kp) % 2 == 0)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("nq", [1, 5], ids=["decode", "chunk"])
def test_user_mask_sees_positions_so_decode_matches_the_full_pass(backend, nq):
    """from_fn's predicate gets query positions (bottom-right): the last rows decoded alone or in a chunk
    equal the same rows of the full pass, alone and composed with causal()."""
    torch.manual_seed(0)
    N = 13
    q, k, v = (torch.randn(2, 2, N, 16) for _ in range(3))
    want64 = _by_definition(q.double(), k.double(), v.double(), _positions_mask(N, N), torch.float64)[:, :, -nq:]
    base = _by_definition(q, k, v, _positions_mask(N, N), torch.float32)[:, :, -nq:]
    for mask in (M.from_fn(_dilated), M.from_fn(lambda b, h, q, k: (q - k) % 2 == 0) & M.causal()):
        got = qkv.attention(q[:, :, -nq:], k, v, mask=mask, backend=backend)
        assert_within_budget(got, want64, base, what=f"{backend} {mask!r} Nq={nq} of Nk={N}")


def test_user_mask_top_left_alignment_passes_row_indices():
    m = M.from_fn(lambda b, h, q, k: k <= q, align="top_left")
    assert torch.equal(m.dense(1, 1, 2, 4)[0, 0], M.causal(align="top_left").dense(1, 1, 2, 4)[0, 0])
    assert torch.equal(M.from_fn(lambda b, h, q, k: k <= q).dense(1, 1, 2, 4)[0, 0], M.causal().dense(1, 1, 2, 4)[0, 0])
    with pytest.raises(ValueError, match="align"):
        M.from_fn(lambda b, h, q, k: k <= q, align="top")


def test_user_mask_decode_on_flex_matches_the_full_pass():
    """One tiny compiled Flex case: a decode step with a user mask equals the last row of the full pass."""
    from qkv._request import build_request
    from qkv.backends.flex import FlexBackend

    torch.manual_seed(1)
    N = 13
    q, k, v = (torch.randn(1, 2, N, 16) for _ in range(3))
    req = build_request(q[:, :, -1:], k, v, mask=M.from_fn(_dilated))
    reason = FlexBackend().decline(req)
    if reason is not None:
        pytest.skip(f"flex declines here: {reason}")
    with torch.no_grad():
        got = qkv.attention(q[:, :, -1:], k, v, mask=M.from_fn(_dilated), backend="flex")
    want64 = _by_definition(q.double(), k.double(), v.double(), _positions_mask(N, N), torch.float64)[:, :, -1:]
    base = _by_definition(q, k, v, _positions_mask(N, N), torch.float32)[:, :, -1:]
    assert_within_budget(got, want64, base, what="flex decode, from_fn dilated causal")


def _head_reader(b, h, q, k):
    """Head 0 sees only key 0; head 1 sees every key at or before its position."""
    return torch.where(h == 0, k == 0, k <= q)


def test_block_map_refuses_a_head_dependent_mask_without_the_head_count():
    m = M.from_fn(_head_reader)
    with pytest.raises(ValueError, match=r"block_map.*H="):
        m.block_map(32, 32, 8, 8)
    with pytest.raises(ValueError, match=r"sparsity.*H="):
        m.sparsity(32, 32)
    bm = m.block_map(32, 32, 8, 8, H=2)[0, 0]
    assert int((bm == EMPTY).sum()) == 6, "tiles head 1 reads must not be EMPTY"  # strictly above the diagonal


def test_sparsity_reads_every_head():
    m = M.from_fn(_head_reader)
    N = 16
    want = 1 - (N + N * (N + 1) / 2) / (2 * N * N)  # head 0: one key per row; head 1: causal
    assert m.sparsity(N, N, H=2) == pytest.approx(want)


def test_triton_lowering_covers_every_head_of_a_head_reading_mask():
    """The Triton lowering lists the tiles of every head: head 1's causal tiles must be visited."""
    from qkv.backends.triton._lower import lower_mask

    plan = lower_mask(M.from_fn(_head_reader), 1, 2, 64, 64, 16, 16, "cpu")
    assert plan.visited == 10, f"visited {plan.visited} tiles; the causal tiles of head 1 are 10"
    assert plan.tile_heads, "partial tiles must be kept per head"
