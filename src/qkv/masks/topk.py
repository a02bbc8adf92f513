"""Sparse attention by selection: every query row lists the keys it may read.

A scorer outside the mask (DeepSeek Sparse Attention's lightning indexer, DeepSeek-AI 2025; MoBA's block
affinities, Lu et al. 2025, arXiv:2502.13189) picks, for each query, the K keys worth reading; the mask says
exactly that. ``indices[b, h, i]`` lists the keys of query row ``i`` (one list per query head, or one shared by
all heads), ``-1`` meaning "no key" (a row shorter than K pads with it), and duplicates count once.

Shape legend: B batch, H heads (or 1), Nq query rows, K listed keys per row, Nk keys, TQ/TK tiles.

The dense view and the block map are computed by scattering the lists, O(B·H·Nq·K) work plus the output
(a ``(B, H, Nq, TK)`` count of listed keys per tile): a tile is FULL when every row lists every key of it, EMPTY
when no row lists any. The predicate is exact for any index tensors, so the tiled, Flex and Triton paths see
the same mask as the reference.

Example:
    >>> import torch
    >>> from qkv import masks
    >>> idx = torch.tensor([[[[0, -1], [0, 1], [2, 2], [-1, -1]]]])   # (B=1, H=1, Nq=4, K=2)
    >>> print((masks.topk(idx) & masks.causal()).draw(4))
    x...
    xx..
    ..x.
    ....
"""

from __future__ import annotations

import math

import torch

from .base import Mask, Not, _Combined, classify, row_index

__all__ = ["TopK", "topk", "longest_list", "UNROLL"]

#: Lists up to this long are looked up entry by entry (pointwise; compiles under Flex), longer ones by a reduction.
UNROLL = 64


class TopK(Mask):
    """Query row ``i`` may attend key ``j`` exactly when ``j`` is listed in ``indices[b, h, i]`` (see the module)."""

    def __init__(self, indices: torch.Tensor) -> None:
        if not isinstance(indices, torch.Tensor) or indices.dtype.is_floating_point or indices.dtype == torch.bool:
            seen = f"a {indices.dtype} tensor" if isinstance(indices, torch.Tensor) else type(indices).__name__
            raise TypeError(f"masks.topk: indices must be an integer tensor (B, H or 1, Nq, K) of key indices, "
                            f"-1 for no key; got {seen}")
        if indices.dim() != 4:
            raise ValueError(f"masks.topk: indices must be 4-D (B, H or 1, Nq, K), got shape {tuple(indices.shape)}; "
                             f"for one list shared by every head use H = 1 (indices[:, None])")
        if indices.numel() and int(indices.min()) < -1:
            raise ValueError(f"masks.topk: indices must be key indices >= 0, or -1 for no key; got a minimum of "
                             f"{int(indices.min())}")
        self.indices = indices.to(torch.int64)
        self.batch = indices.shape[0]
        self.depends_on_head = indices.shape[1] > 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.indices,)

    def check(self, B: int, H: int, nq: int, nk: int) -> None:
        super().check(B, H, nq, nk)
        Bi, Hi, Nqi, K = self.indices.shape
        if Hi not in (1, H):
            raise ValueError(f"masks.topk: indices list keys for {Hi} heads but q has {H} heads; pass one list per "
                             f"query head or H = 1 to share the lists")
        if Nqi != nq:
            raise ValueError(f"masks.topk: indices list keys for {Nqi} query rows but q has {nq}; the lists are "
                             f"per query row of this call")
        if self.indices.numel() and int(self.indices.max()) >= nk:
            raise ValueError(f"masks.topk: indices list key {int(self.indices.max())} but there are only {nk} keys "
                             f"(valid: 0 .. {nk - 1}, or -1 for no key)")

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        idx = self.indices
        hh = h if idx.shape[1] > 1 else torch.zeros_like(h)
        bb, qq = row_index(idx, b), q_idx.clamp(0, idx.shape[2] - 1)
        if not 0 < idx.shape[-1] <= UNROLL:
            rows = idx[bb, hh, qq]  # broadcast of (b, h, q) + (K,)
            shape = torch.broadcast_shapes(rows.shape[:-1], kv_idx.shape)
            if math.prod(rows.shape[:-1]) * (nk + 1) <= math.prod(shape) * rows.shape[-1]:
                # each row's keys as a bitmap over the nk keys (one spill column for -1), read at kv_idx: memory
                # O(rows * nk) instead of O(rows * keys asked * K)
                cols = torch.where(rows < 0, torch.full_like(rows, nk), rows)
                bits = torch.zeros(*rows.shape[:-1], nk + 1, dtype=torch.bool, device=rows.device)
                bits.scatter_(-1, cols, True)
                at = kv_idx.clamp(0, nk).expand(shape).unsqueeze(-1)
                return torch.gather(bits.expand(*shape, nk + 1), -1, at).squeeze(-1)
            return (rows == kv_idx.unsqueeze(-1)).any(-1)
        # Short lists: one comparison per entry, no reduction, so a compiled (Flex) mask_mod stays pointwise.
        hit = idx[bb, hh, qq, 0] == kv_idx
        for j in range(1, idx.shape[-1]):
            hit = hit | (idx[bb, hh, qq, j] == kv_idx)
        return hit

    def dense(self, B, H, nq, nk, device=None):
        self.check(B, H, nq, nk)
        idx = self.indices.to(device) if device is not None else self.indices
        cols = torch.where(idx < 0, torch.full_like(idx, nk), idx)
        out = torch.zeros(*idx.shape[:3], nk + 1, dtype=torch.bool, device=idx.device)
        out.scatter_(3, cols, True)
        bsz, hs = self.reads(B, H)
        return torch.broadcast_to(out[..., :nk], (bsz, hs, nq, nk))

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        idx = self.indices.to(device) if device is not None else self.indices
        tk, tq = math.ceil(nk / bk), math.ceil(nq / bq)
        srt = idx.sort(dim=-1).values
        dup = torch.zeros_like(srt, dtype=torch.bool)
        dup[..., 1:] = srt[..., 1:] == srt[..., :-1]
        listed = (srt >= 0) & ~dup  # each listed key once
        tile = torch.where(listed, srt // bk, torch.full_like(srt, tk))
        counts = torch.zeros(*idx.shape[:3], tk + 1, dtype=torch.int64, device=idx.device)
        counts.scatter_add_(3, tile, torch.ones_like(tile))
        counts = counts[..., :tk]  # (B, H, Nq, TK) listed keys per row and key tile
        width = (torch.clamp(torch.arange(1, tk + 1, device=idx.device) * bk, max=nk)
                 - torch.arange(tk, device=idx.device) * bk)
        row_full = (counts == width).all(1)  # (B, Nq, TK): every head lists the whole tile
        row_some = (counts > 0).any(1)
        pad = tq * bq - nq
        if pad:
            row_full = torch.cat([row_full, row_full.new_ones(row_full.shape[0], pad, tk)], 1)
            row_some = torch.cat([row_some, row_some.new_zeros(row_some.shape[0], pad, tk)], 1)
        full = row_full.view(-1, tq, bq, tk).all(2)
        some = row_some.view(-1, tq, bq, tk).any(2)
        return classify(full, some)

    def sparsity(self, nq: int, nk: int, *, B: int | None = None) -> float:
        if nq * nk == 0:
            return 0.0
        return 1.0 - float(self.dense(B or self.batch, self.indices.shape[1], nq, nk).float().mean())  # every head

    def __repr__(self) -> str:
        B, H, Nq, K = self.indices.shape
        return f"topk(K={K}, {'per head' if H > 1 else 'shared by heads'})"


def topk(indices: torch.Tensor) -> TopK:
    """The keys each query row may read, listed: ``indices`` (B, H or 1, Nq, K) integer key indices, ``-1`` for
    no key; query row ``i`` of head ``h`` may attend key ``j`` exactly when ``j`` is in ``indices[b, h, i]``
    (duplicates count once). Composes like every mask (``topk(idx) & causal()``); a row that lists nothing
    returns zeros and ``lse = -inf``.

    Example:
        >>> import torch
        >>> from qkv import masks
        >>> masks.topk(torch.tensor([[[[1], [0]]]])).dense(1, 1, 2, 3)[0, 0].tolist()
        [[False, True, False], [True, False, False]]
    """
    return TopK(indices)


def longest_list(mask: Mask | None) -> int:
    """The longest ``topk`` list (K) anywhere in ``mask`` (through ``&``, ``|`` and ``~``), 0 when it has none.
    A compiled predicate (Flex's ``mask_mod``) can take lists up to :data:`UNROLL` keys long."""
    stack, longest = [mask] if mask is not None else [], 0
    while stack:
        m = stack.pop()
        if isinstance(m, _Combined):
            stack += [m.a, m.b]
        elif isinstance(m, Not):
            stack.append(m.a)
        elif isinstance(m, TopK):
            longest = max(longest, m.indices.shape[-1])
    return longest
