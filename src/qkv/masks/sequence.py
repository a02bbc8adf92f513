"""Masks built from per-sequence data: key padding, packed documents, prefix-LM.

- ``padding(kv_lengths)`` allows key ``j < kv_lengths[b]`` (right-padded batches); ``padding(valid)``
  with a (B, Nk) boolean allows the keys marked valid (left padding, HF's ``attention_mask``).
- ``document(ids)`` allows a pair when both tokens carry the same id (packed sequences, as in
  FlashAttention's varlen API and sequence packing for pre-training). Query row ``i`` reads the id at
  its position ``i + Nk - Nq``; pass ``q_ids`` for cross attention between different packings.
- ``prefix_lm(n)`` allows ``j <= p`` or ``j < n[b]`` (Raffel et al. 2020, T5's prefix LM; UniLM).

Example:
    >>> import torch
    >>> from qkv import masks
    >>> print(masks.document(torch.tensor([0, 0, 1, 1, 1])).draw(5))
    xx...
    xx...
    ..xxx
    ..xxx
    ..xxx
"""

from __future__ import annotations

import torch

from .base import Mask, block_counts, classify, row_index, tile_grid

__all__ = ["padding", "document", "document_from_cu_seqlens", "prefix_lm", "positions", "Padding", "Document",
           "PrefixLM", "Positions"]


def _as_lengths(x, name: str) -> torch.Tensor:
    if isinstance(x, int) and not isinstance(x, bool):
        x = torch.tensor([x])
    elif isinstance(x, (list, tuple)):
        x = torch.tensor(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected an int, a list of ints or a 1-D integer tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.dim() != 1:
        raise TypeError(f"{name}: expected a 1-D integer tensor of shape (B,), got dtype {x.dtype} shape "
                        f"{tuple(x.shape)}")
    if x.device.type == "meta":
        raise ValueError(f"{name}: got a meta tensor, which holds no lengths; pass lengths on the CPU or q's device")
    if x.numel() and int(x.min()) < 0:
        raise ValueError(f"{name}: lengths must be >= 0, got min {int(x.min())}")
    return x.to(torch.int64, copy=True)  # a mask is immutable: the caller may reuse its tensor


class Padding(Mask):
    """Key padding: per-row lengths (right padding), or a (B, Nk) boolean of valid keys (any padding)."""

    def __init__(self, kv_lengths) -> None:
        self.valid = None
        if isinstance(kv_lengths, torch.Tensor) and kv_lengths.dim() == 2:
            self.valid = _as_valid(kv_lengths)
            self.lengths = self.valid.sum(1)
            self.batch = self.valid.shape[0]
            return
        self.lengths = _as_lengths(kv_lengths, "padding(kv_lengths)")
        self.batch = self.lengths.shape[0]

    def check(self, B, H, nq, nk):
        super().check(B, H, nq, nk)
        if self.valid is not None:
            if self.valid.shape[1] != nk:
                raise ValueError(f"padding: the (B, Nk) key mask has {self.valid.shape[1]} keys but the keys have "
                                 f"length {nk}")
        elif self.lengths.numel() and int(self.lengths.max()) > nk:
            raise ValueError(f"padding: kv_lengths max {int(self.lengths.max())} exceeds the key length {nk}")

    def tensors(self):
        return (self.lengths,) if self.valid is None else (self.lengths, self.valid)

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        if self.valid is not None:
            valid = self.valid.to(kv_idx.device)
            return valid[row_index(valid, b), kv_idx]
        lengths = self.lengths.to(kv_idx.device)
        return kv_idx < lengths[row_index(lengths, b)]

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        tq = (nq + bq - 1) // bq
        if self.valid is not None:  # per key tile: all valid / some valid, O(B * Nk)
            counts = block_counts(self.valid.to(device).unsqueeze(1), 1, bk)  # (B, 1, TK)
            _, _, k_lo, k_hi = tile_grid(nq, nk, bq, bk, device)
            return classify(counts == (k_hi - k_lo + 1), counts > 0).expand(-1, tq, -1)
        _, _, k_lo, k_hi = tile_grid(nq, nk, bq, bk, device)
        n = self.lengths.to(device).view(-1, 1, 1)
        full, some = k_hi < n, k_lo < n
        return classify(full, some).expand(-1, tq, -1)

    def __repr__(self):
        if self.valid is not None:
            return f"padding(valid keys of shape {tuple(self.valid.shape)})"
        return f"padding({self.lengths.tolist()})"


def _as_valid(x: torch.Tensor) -> torch.Tensor:
    """A (B, Nk) key mask (HF's ``attention_mask``): bool, or integers 0/1."""
    if x.dtype != torch.bool:
        if x.dtype.is_floating_point or (x.numel() and not bool(((x == 0) | (x == 1)).all())):
            raise TypeError(f"padding: a 2-D key mask must be bool or 0/1 integers (1 = real token), got dtype "
                            f"{x.dtype}; pass per-row lengths as a 1-D tensor instead")
        x = x != 0
    return x


class Document(Mask):
    def __init__(self, ids: torch.Tensor, q_ids: torch.Tensor | None = None) -> None:
        self.kv_ids = self._check_ids(ids, "document(ids)")
        self.q_ids = None if q_ids is None else self._check_ids(q_ids, "document(q_ids)")
        rows = {self.kv_ids.shape[0]} | ({self.q_ids.shape[0]} if self.q_ids is not None else set())
        if len(rows - {1}) > 1:
            raise ValueError(f"document: ids and q_ids have different batch sizes {sorted(rows)}")
        self.batch = max(rows)

    @staticmethod
    def _check_ids(ids, name):
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor of shape (N,) or (B, N), got "
                            f"{type(ids).__name__} {getattr(ids, 'dtype', '')}")
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise ValueError(f"{name}: expected shape (N,) or (B, N), got {tuple(ids.shape)}")
        return ids.to(torch.int64, copy=True)  # a mask is immutable: the caller may reuse its tensor

    def tensors(self):
        return (self.kv_ids,) if self.q_ids is None else (self.kv_ids, self.q_ids)

    def check(self, B, H, nq, nk):
        super().check(B, H, nq, nk)
        if self.q_ids is None and nq > nk:
            raise ValueError(f"document: {nq} queries but only {nk} keys, so the queries have no ids of their own "
                             "(query row i reads the id at position i + Nk - Nq); pass q_ids=(B, Nq) ids for "
                             "the queries")
        if self.kv_ids.shape[1] != nk:
            raise ValueError(f"document: ids have length {self.kv_ids.shape[1]} but keys have length {nk}")
        if self.q_ids is not None and self.q_ids.shape[1] != nq:
            raise ValueError(f"document: q_ids have length {self.q_ids.shape[1]} but queries have length {nq}")

    def _query_ids(self, nq, nk):
        if self.q_ids is not None:
            return self.q_ids
        return self.kv_ids[:, nk - nq:]

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        kv = self.kv_ids.to(kv_idx.device)
        qd = self._query_ids(nq, nk).to(kv_idx.device)
        return qd[row_index(qd, b), q_idx] == kv[row_index(kv, b), kv_idx]

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        # Per tile, the range of ids on each side. Disjoint ranges: EMPTY; one id on both: FULL.
        q_lo, q_hi = _tile_range(self._query_ids(nq, nk).to(device), bq)
        k_lo, k_hi = _tile_range(self.kv_ids.to(device), bk)
        q_lo, q_hi = q_lo.unsqueeze(2), q_hi.unsqueeze(2)
        k_lo, k_hi = k_lo.unsqueeze(1), k_hi.unsqueeze(1)
        full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
        some = (q_lo <= k_hi) & (k_lo <= q_hi)
        return classify(full, some)

    def __repr__(self):
        return f"document(ids of shape {tuple(self.kv_ids.shape)})"


def _tile_range(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``ids`` (Bm, N) over tiles of ``block`` columns: (Bm, T) each."""
    bm, n = ids.shape
    t = (n + block - 1) // block
    lo = ids[:, -1:].expand(bm, t * block).clone()  # pad the ragged tile with a value it already holds
    lo[:, :n] = ids
    tiles = lo.view(bm, t, block)
    return tiles.amin(-1), tiles.amax(-1)


class PrefixLM(Mask):
    def __init__(self, prefix_lengths) -> None:
        self.lengths = _as_lengths(prefix_lengths, "prefix_lm(prefix_lengths)")
        self.batch = self.lengths.shape[0] if self.lengths.shape[0] != 1 else None

    def tensors(self):
        return (self.lengths,)

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        n = self.lengths.to(kv_idx.device)
        return (kv_idx <= q_idx + (nk - nq)) | (kv_idx < n[row_index(n, b)])

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        p_lo, p_hi, k_lo, k_hi = tile_grid(nq, nk, bq, bk, device)
        n = self.lengths.to(device).view(-1, 1, 1)
        return classify((k_hi <= p_lo) | (k_hi < n), (k_lo <= p_hi) | (k_lo < n))

    def __repr__(self):
        return f"prefix_lm({self.lengths.tolist()})"


def padding(kv_lengths) -> Padding:
    """Allow key ``j < kv_lengths[b]``. ``kv_lengths``: int or (B,) integer tensor; or a (B, Nk) boolean
    (or 0/1 integer) tensor of valid keys, HF's ``attention_mask``, for left or arbitrary padding."""
    return Padding(kv_lengths)


def document(ids: torch.Tensor, *, q_ids: torch.Tensor | None = None) -> Document:
    """Allow pairs whose tokens carry the same id. ``ids``: (Nk,) or (B, Nk) integers; ``q_ids``
    (optional, (Nq,) or (B, Nq)) for queries packed differently from keys."""
    return Document(ids, q_ids)


def document_from_cu_seqlens(cu_seqlens: torch.Tensor) -> Document:
    """Packed sequences from cumulative lengths ``[0, n0, n0+n1, ...]`` (FlashAttention varlen style)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("document_from_cu_seqlens: expected a 1-D integer tensor [0, n0, n0+n1, ...] with at "
                         f"least 2 entries, got {cu_seqlens!r}")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"document_from_cu_seqlens: must start at 0 and be non-decreasing, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    return Document(torch.repeat_interleave(torch.arange(lengths.numel()), lengths))


def prefix_lm(prefix_lengths) -> PrefixLM:
    """Bidirectional over the first ``prefix_lengths[b]`` keys, causal after."""
    return PrefixLM(prefix_lengths)


class Positions(Mask):
    """Mask by explicit token positions: the bridge between masks and KV caches whose slots are not
    in position order (ring buffers, evicted caches, left padding)."""

    def __init__(self, q_positions, kv_positions, causal: bool = True, window: int | None = None) -> None:
        self.qp = Document._check_ids(q_positions, "positions(q_positions)")
        self.kp = Document._check_ids(kv_positions, "positions(kv_positions)")
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ValueError(f"positions: window must be a positive int (keys kept per query) or None, got {window!r}")
        self.causal, self.window = causal, window
        rows = {self.qp.shape[0], self.kp.shape[0]} - {1}
        if len(rows) > 1:
            raise ValueError(f"positions: q_positions and kv_positions have different batch sizes {sorted(rows)}")
        self.batch = max(self.qp.shape[0], self.kp.shape[0])

    def tensors(self):
        return (self.qp, self.kp)

    def check(self, B, H, nq, nk):
        super().check(B, H, nq, nk)
        if self.qp.shape[1] != nq or self.kp.shape[1] != nk:
            raise ValueError(f"positions: got {self.qp.shape[1]} query and {self.kp.shape[1]} key positions for "
                             f"Nq={nq}, Nk={nk}")

    def _rule(self, qp, kp):
        ok = (kp >= 0) & (qp >= 0)
        if self.causal:
            ok = ok & (kp <= qp)
        if self.window is not None:
            ok = ok & (qp - kp < self.window)
        return ok

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        qp, kp = self.qp.to(kv_idx.device), self.kp.to(kv_idx.device)
        return self._rule(qp[row_index(qp, b), q_idx], kp[row_index(kp, b), kv_idx])

    def dense(self, B, H, nq, nk, device=None):
        # The rule by broadcasting the position rows, without the generic index grids: a decode step
        # builds this mask once per layer.
        self.check(B, H, nq, nk)
        qp, kp = self.qp.to(device), self.kp.to(device)
        return self._rule(qp[:, None, :, None], kp[:, None, None, :])  # (B or 1, 1, nq, nk)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        # Conservative from per-tile position ranges: EMPTY only when no pair can pass.
        q_lo, q_hi = _tile_range(self.qp.to(device), bq)
        k_lo, k_hi = _tile_range(self.kp.to(device), bk)
        q_lo, q_hi, k_lo, k_hi = q_lo.unsqueeze(2), q_hi.unsqueeze(2), k_lo.unsqueeze(1), k_hi.unsqueeze(1)
        some = (q_hi >= 0) & (k_hi >= 0)
        full = (q_lo >= 0) & (k_lo >= 0)
        if self.causal:
            some, full = some & (k_lo <= q_hi), full & (k_hi <= q_lo)
        if self.window is not None:
            some, full = some & (q_lo - k_hi < self.window), full & (q_hi - k_lo < self.window)
        return classify(full, some)

    def __repr__(self):
        return f"positions(causal={self.causal}, window={self.window})"


def positions(q_positions: torch.Tensor, kv_positions: torch.Tensor, *, causal: bool = True,
              window: int | None = None) -> Positions:
    """Allow key slot ``j`` for query ``i`` by their positions: both ``>= 0`` (negative = padding/empty),
    ``kv_pos <= q_pos`` when ``causal``, and ``q_pos - kv_pos < window`` when a window is given.

    Args:
        q_positions: (Nq,) or (B, Nq) int64.
        kv_positions: (Nk,) or (B, Nk) int64.
    """
    return Positions(q_positions, kv_positions, causal, window)
