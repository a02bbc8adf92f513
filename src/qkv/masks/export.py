"""Mask exports to the block-sparse formats kernels take, from the analytic block map (no (N, N) tensor).

Every export reads :meth:`Mask.block_map` (EMPTY / PARTIAL / FULL per tile, computed in O(tiles) for the
analytic masks), so a 128K-token packed-document mask costs its tile grid, not 16G pairs:

- :func:`to_flex_block_mask`: a ``torch.nn.attention.flex_attention.BlockMask`` (``BlockMask.from_kv_blocks``
  with PARTIAL tiles as ``kv_indices`` and FULL tiles as ``full_kv_indices``, the mask as its ``mask_mod``),
  equal to ``create_block_mask`` on the same predicate.
- :func:`to_block_sparse`: FlashAttention-4's block-sparse tensors, the same (count, index) pairs per query
  block: ``(mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx)``, (B, H, TQ) and (B, H, TQ, TK).
- :func:`to_bsr`: FlashInfer's block-sparse row format, ``(indptr, indices)`` int32 over the non-empty tiles
  of one (batch, head) map.
- :func:`to_block_list`: the plain ``(row, col)`` list of non-empty tiles, int64 (n, 2).

A head-dependent mask is exported per head (its predicate evaluated per head); the others report H = 1 and
broadcast.

Example:
    >>> from qkv import masks
    >>> indptr, indices = masks.causal().to_bsr(256, 256, block=128)
    >>> indptr.tolist(), indices.tolist()
    ([0, 1, 3], [0, 0, 1])
"""

from __future__ import annotations

import torch

from .base import EMPTY, FULL, PARTIAL, Mask, predicate_block_map

__all__ = ["tile_map", "to_flex_block_mask", "to_block_sparse", "to_bsr", "to_block_list"]


def tile_map(mask: Mask, B: int, H: int, Nq: int, Nk: int, block_q: int, block_k: int, device=None) -> torch.Tensor:
    """Tile classes (B or 1, H or 1, TQ, TK) int8: per head when the mask reads the head."""
    _check(B, H, Nq, Nk, block_q, block_k)
    mask.check(B, H, Nq, Nk)
    if mask.depends_on_head and H > 1:
        rows = B if mask.depends_on_batch else (1 if mask.batch is None else mask.batch)
        maps = [predicate_block_map(_OneHead(mask, h), rows, 1, Nq, Nk, block_q, block_k, device) for h in range(H)]
        maps = [m.expand(rows, *m.shape[1:]) for m in maps]
        return torch.stack(maps, 1)
    bm = mask.block_map(Nq, Nk, block_q, block_k, B=B, H=H, device=device)
    return bm


def _check(B, H, Nq, Nk, bq, bk) -> None:
    for name, v in (("B", B), ("H", H), ("Nq", Nq), ("Nk", Nk), ("block_q", bq), ("block_k", bk)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"mask export: {name} must be a positive int, got {v!r}")


class _OneHead(Mask):
    """The mask as seen by head ``h`` only (for per-head block maps of head-dependent masks)."""

    def __init__(self, inner: Mask, h: int) -> None:
        self.inner, self.h = inner, h
        self.batch, self.depends_on_batch = inner.batch, inner.depends_on_batch

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return self.inner.allowed(b, torch.full_like(h, self.h), q_idx, kv_idx, nq, nk)


def to_block_sparse(mask: Mask, B: int, H: int, Nq: int, Nk: int, *, block_q: int = 128, block_k: int = 128,
                    device=None):
    """FlashAttention-4 block-sparse tensors: ``(mask_cnt, mask_idx, full_cnt, full_idx)``.

    ``mask_cnt`` (B', H', TQ) int32 counts the PARTIAL key blocks of each query block and ``mask_idx``
    (B', H', TQ, TK) int32 lists them first, in ascending order (the rest of the row is padding); likewise
    ``full_*`` for FULL blocks. ``B'``/``H'`` are 1 where the mask is the same for every batch row / head.
    """
    bm = tile_map(mask, B, H, Nq, Nk, block_q, block_k, device)
    return (*_count_index(bm == PARTIAL), *_count_index(bm == FULL))


def _count_index(sel: torch.Tensor):
    """Per row: how many True, and their column indices first (ascending), then the others (ascending)."""
    tk = sel.shape[-1]
    cols = torch.arange(tk, device=sel.device).expand_as(sel)
    # True columns sort before False ones, each group ascending: key = (not sel) * tk + col
    order = torch.argsort((~sel).to(torch.int64) * tk + cols, dim=-1)
    return sel.sum(-1).to(torch.int32), order.to(torch.int32)


def to_flex_block_mask(mask: Mask, B: int, H: int, Nq: int, Nk: int, *, block_size: int | tuple[int, int] = 128,
                       device=None):
    """A FlexAttention ``BlockMask`` for ``mask``, built from the block map (FlexAttention's ``mask_mod`` is the
    mask's predicate, in bottom-right positions as every qkv mask). Equal to
    ``create_block_mask(mask_mod, B, H, Nq, Nk, BLOCK_SIZE=block_size)`` on the same predicate."""
    from torch.nn.attention.flex_attention import BlockMask

    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    bm = tile_map(mask, B, H, Nq, Nk, bq, bk, device)
    # Flex pads the grid to whole blocks and counts a ragged edge tile as never FULL: do the same
    if Nq % bq or Nk % bk:
        bm = bm.clone()
        edge = torch.zeros(bm.shape[-2:], dtype=torch.bool, device=bm.device)
        if Nq % bq:
            edge[-1, :] = True
        if Nk % bk:
            edge[:, -1] = True
        bm = torch.where(edge & (bm == FULL), torch.tensor(PARTIAL, dtype=bm.dtype, device=bm.device), bm)
    mask_cnt, mask_idx, full_cnt, full_idx = (*_count_index(bm == PARTIAL), *_count_index(bm == FULL))
    shape = (B, H, mask_cnt.shape[-1])
    mask_cnt, full_cnt = mask_cnt.expand(shape).contiguous(), full_cnt.expand(shape).contiguous()
    mask_idx = mask_idx.expand(*shape, mask_idx.shape[-1]).contiguous()
    full_idx = full_idx.expand(*shape, full_idx.shape[-1]).contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return mask.allowed(b, h, q_idx, kv_idx, Nq, Nk)

    return BlockMask.from_kv_blocks(mask_cnt, mask_idx, full_cnt, full_idx, BLOCK_SIZE=(bq, bk), mask_mod=mask_mod,
                                    seq_lengths=(Nq, Nk))


def to_bsr(mask: Mask, Nq: int, Nk: int, *, block: int | tuple[int, int] = 128, b: int = 0, h: int = 0,
           B: int = 1, H: int = 1, device=None):
    """FlashInfer's BSR of the non-empty tiles of batch row ``b``, head ``h``: ``indptr`` (TQ + 1,) and
    ``indices`` (nnz,) int32, column indices ascending within each row."""
    bq, bk = (block, block) if isinstance(block, int) else block
    if not (0 <= b < B and 0 <= h < H):
        raise ValueError(f"to_bsr: b={b}, h={h} must index B={B}, H={H}")
    bm = tile_map(mask, B, H, Nq, Nk, bq, bk, device)
    sel = bm[min(b, bm.shape[0] - 1), min(h, bm.shape[1] - 1)] != EMPTY  # (TQ, TK)
    indptr = torch.zeros(sel.shape[0] + 1, dtype=torch.int32, device=sel.device)
    indptr[1:] = sel.sum(-1).cumsum(0)
    return indptr, sel.nonzero()[:, 1].to(torch.int32)


def to_block_list(mask: Mask, Nq: int, Nk: int, *, block: int | tuple[int, int] = 128, b: int = 0, h: int = 0,
                  B: int = 1, H: int = 1, device=None) -> torch.Tensor:
    """The non-empty tiles of batch row ``b``, head ``h`` as an int64 (n, 2) tensor of (query block, key block)."""
    bq, bk = (block, block) if isinstance(block, int) else block
    if not (0 <= b < B and 0 <= h < H):
        raise ValueError(f"to_block_list: b={b}, h={h} must index B={B}, H={H}")
    bm = tile_map(mask, B, H, Nq, Nk, bq, bk, device)
    return (bm[min(b, bm.shape[0] - 1), min(h, bm.shape[1] - 1)] != EMPTY).nonzero()
