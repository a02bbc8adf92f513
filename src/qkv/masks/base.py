"""The mask protocol: which (query, key) pairs may interact, as an analytic object.

Shape legend: B batch, H heads, Nq query length, Nk key length, TQ/TK tile counts.

A mask is evaluated through one vectorized predicate, ``allowed(b, h, q_idx, kv_idx, nq, nk)``, on
broadcastable integer index tensors. The same predicate serves every consumer: the reference backend
(dense materialization), the tiled backend (partial tiles only) and the Flex backend (as a
``mask_mod``). Positions follow the operator contract (README): query row ``i`` sits at absolute position
``i + nk - nq`` (bottom-right alignment), key ``j`` at position ``j``.

``block_map`` classifies each (query tile, key tile) as EMPTY, PARTIAL or FULL. Analytic masks compute
it from their structure in O(tiles) (plus O(N) for per-token data such as document ids); only
``dense``/``graph``/``from_fn`` masks have to look at every element.

::

    Nq=3, Nk=5, causal() (bottom-right)      causal(align="top_left")
          k: 0 1 2 3 4                              k: 0 1 2 3 4
    q0 (p=2) x x x . .                        q0 (p=0) x . . . .
    q1 (p=3) x x x x .                        q1 (p=1) x x . . .
    q2 (p=4) x x x x x                        q2 (p=2) x x x . .
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["Mask", "EMPTY", "PARTIAL", "FULL", "And", "Or", "Not", "predicate_block_map",
           "block_map_from_dense"]

EMPTY, PARTIAL, FULL = 0, 1, 2

Index = torch.Tensor


def _tile_bounds(n: int, block: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last (inclusive) index of each tile of ``block`` over ``n`` rows: (T,), (T,)."""
    start = torch.arange(0, n, block, device=device)
    end = torch.clamp(start + block, max=n) - 1
    return start, end


def classify(all_true: torch.Tensor, any_true: torch.Tensor) -> torch.Tensor:
    """Tile state from two boolean facts: every pair allowed / some pair allowed."""
    out = torch.full(all_true.shape, PARTIAL, dtype=torch.int8, device=all_true.device)
    out = torch.where(any_true, out, torch.tensor(EMPTY, dtype=torch.int8, device=out.device))
    return torch.where(all_true, torch.tensor(FULL, dtype=torch.int8, device=out.device), out)


class Mask:
    """Base class. Subclasses implement :meth:`allowed` and, when structure allows, :meth:`_block_map`.

    Masks compose: ``a & b`` (both allow), ``a | b`` (either allows), ``~a`` (complement).
    """

    #: Batch size the mask carries data for (``None`` when it is the same for every batch row).
    batch: int | None = None

    # the predicate
    def allowed(self, b: Index, h: Index, q_idx: Index, kv_idx: Index, nq: int, nk: int) -> torch.Tensor:
        """Vectorized predicate over broadcastable int64 index tensors; returns a bool tensor."""
        raise NotImplementedError

    # what the mask reads
    #: Whether the predicate looks at the head index (lets ``dense`` keep H = 1 otherwise).
    depends_on_head: bool = False
    #: Whether the predicate tells batch rows apart beyond the per-row data it carries (``batch``): a user
    #: predicate may read ``b`` directly, so its views and block maps need the request's batch size.
    depends_on_batch: bool = False

    def reads(self, B: int, H: int) -> tuple[int, int]:
        """(batch rows, heads) of a (B, H) request that the predicate can tell apart; every view and block
        map evaluates exactly these (1 where the mask is the same for all)."""
        rows = B if self.depends_on_batch else (1 if self.batch is None else self.batch)
        return rows, (H if self.depends_on_head else 1)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the mask holds (checked against the request's device; CPU data is moved as needed)."""
        return ()

    # derived views
    def check(self, B: int, H: int, nq: int, nk: int) -> None:
        """Raise ``ValueError`` when the mask cannot apply to a (B, H, nq, nk) problem. Changes nothing."""
        if self.batch is not None and self.batch not in (1, B):
            raise ValueError(
                f"mask: {self!r} carries data for batch {self.batch} but q has batch {B}; "
                f"build the mask from per-row data of length {B} (or 1 to broadcast)"
            )

    def materialize(self, B: int, H: int, nq: int, nk: int, device=None) -> torch.Tensor:
        """Dense boolean tensor ``(B, H, nq, nk)`` (an expanded view where the mask broadcasts)."""
        return self.dense(B, H, nq, nk, device=device).expand(B, H, nq, nk)

    def dense(self, B: int, H: int, nq: int, nk: int, device=None) -> torch.Tensor:
        """Dense boolean with the smallest broadcastable shape ``(B or 1, H or 1, nq, nk)``."""
        self.check(B, H, nq, nk)
        bsz, hs = self.reads(B, H)
        b = torch.arange(bsz, device=device).view(-1, 1, 1, 1)
        h = torch.arange(hs, device=device).view(1, -1, 1, 1)
        qi = torch.arange(nq, device=device).view(1, 1, -1, 1)
        kj = torch.arange(nk, device=device).view(1, 1, 1, -1)
        out = self.allowed(b, h, qi, kj, nq, nk)
        return torch.broadcast_to(out, (bsz, hs, nq, nk))

    def block_map(self, nq: int, nk: int, block_q: int = 128, block_k: int = 128, *, B: int | None = None,
                  H: int | None = None, device=None) -> torch.Tensor:
        """Tile classes ``(Bm, 1, TQ, TK)`` int8 with values EMPTY / PARTIAL / FULL.

        A tile is FULL only when every head the mask reads allows all of it, EMPTY only when no head allows
        any of it. ``Bm`` is 1 unless the mask differs across batch rows. ``B`` and ``H`` are the request's
        batch size and head count (a user predicate may read ``b`` and ``h``); a mask that reads the head
        (``depends_on_head``) refuses to guess ``H``: a map of head 0 alone would skip or leave unmasked the
        tiles of the other heads. Tiles at the ragged end (when the block does not divide the length) cover
        only the valid rows/columns.
        """
        if block_q <= 0 or block_k <= 0:
            raise ValueError(f"block_map: block sizes must be positive, got block_q={block_q}, block_k={block_k}")
        if B is not None and self.batch is not None and self.batch not in (1, B):
            raise ValueError(f"block_map: {self!r} carries data for batch {self.batch}, not {B}")
        _need_heads(self, H, "block_map")
        bm = self._block_map(nq, nk, block_q, block_k, device, B or (self.batch or 1), H or 1)
        return bm.view(bm.shape[0] if bm.dim() == 3 else 1, 1, *bm.shape[-2:])

    def _block_map(self, nq: int, nk: int, bq: int, bk: int, device, B: int = 1, H: int = 1) -> torch.Tensor:
        """Default (for masks with no exploitable structure): evaluate every pair of every batch row and head
        the mask reads, a band of query tiles at a time; (Bm, TQ, TK)."""
        rows, heads = self.reads(B, H)
        return predicate_block_map(self, rows, heads, nq, nk, bq, bk, device)

    def predicate_pairs(self, B: int, H: int, nq: int, nk: int) -> int:
        """How many (batch row, head, query, key) predicate evaluations one :meth:`block_map` of a (B, H, nq, nk)
        request costs: 0 for masks with an analytic block map, every pair the mask reads for the others (the
        default :meth:`_block_map`). Backend estimates count it (``qkv.explain``)."""
        if type(self)._block_map is not Mask._block_map:
            return 0
        rows, heads = self.reads(B, H)
        return rows * heads * nq * nk

    def sparsity(self, nq: int, nk: int, *, B: int | None = None, H: int | None = None) -> float:
        """Fraction of (batch row, head, query, key) pairs that are masked out (0 = dense, 1 = nothing allowed),
        over every batch row and head the mask reads; a head-dependent mask needs the head count ``H``."""
        _need_heads(self, H, "sparsity")
        total = nq * nk
        if total == 0:
            return 0.0
        d = self.dense(B or (self.batch or 1), H or 1, nq, nk)
        return 1.0 - float(d.float().mean())

    def draw(self, nq: int = 16, nk: int | None = None, *, batch: int = 0, head: int = 0) -> str:
        """A text drawing: ``x`` allowed, ``.`` masked. Rows are queries, columns keys."""
        nk = nq if nk is None else nk
        if nq > 64 or nk > 128:
            raise ValueError(f"draw: sizes up to 64 x 128 are drawn, got {nq} x {nk}; pass smaller nq/nk")
        d = self.dense(max(batch + 1, self.batch or 1), head + 1, nq, nk)
        d = d[min(batch, d.shape[0] - 1), min(head, d.shape[1] - 1)]
        rows = ["".join("x" if a else "." for a in row.tolist()) for row in d]
        return "\n".join(rows)

    # composition
    def __and__(self, other: Mask) -> Mask:
        return And(self, _as_mask(other, "&"))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, _as_mask(other, "|"))

    def __invert__(self) -> Mask:
        return Not(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _need_heads(mask: Mask, H: int | None, fn: str) -> None:
    if H is None and mask.depends_on_head:
        raise ValueError(f"{fn}: {mask!r} reads the head index, so its tiles differ per head; pass the request's "
                         f"query head count H= (without it only head 0 would be read)")
    if H is not None and (not isinstance(H, int) or isinstance(H, bool) or H <= 0):
        raise ValueError(f"{fn}: H must be a positive int (the query head count), got {H!r}")


def _as_mask(other, op: str) -> Mask:
    if not isinstance(other, Mask):
        raise TypeError(f"mask {op}: expected a qkv mask, got {type(other).__name__}; build one with qkv.masks.*")
    return other


def _merge_batch(parts) -> int | None:
    sizes = {p.batch for p in parts if p.batch not in (None, 1)}
    if len(sizes) > 1:
        raise ValueError(f"mask composition: parts carry different batch sizes {sorted(sizes)}; they must agree")
    if sizes:
        return sizes.pop()
    return 1 if any(p.batch == 1 for p in parts) else None


class _Combined(Mask):
    def __init__(self, a: Mask, b: Mask) -> None:
        self.a, self.b = a, b
        self.batch = _merge_batch((a, b))
        self.depends_on_head = a.depends_on_head or b.depends_on_head
        self.depends_on_batch = a.depends_on_batch or b.depends_on_batch

    def tensors(self):
        return self.a.tensors() + self.b.tensors()

    def check(self, B, H, nq, nk):
        self.a.check(B, H, nq, nk)
        self.b.check(B, H, nq, nk)

    def predicate_pairs(self, B, H, nq, nk):
        return self.a.predicate_pairs(B, H, nq, nk) + self.b.predicate_pairs(B, H, nq, nk)

    def _both_maps(self, nq, nk, bq, bk, device, B, H):
        ma = self.a._block_map(nq, nk, bq, bk, device, B, H)
        mb = self.b._block_map(nq, nk, bq, bk, device, B, H)
        return torch.broadcast_tensors(_as3(ma), _as3(mb))


def _as3(m: torch.Tensor) -> torch.Tensor:
    return m if m.dim() == 3 else m.unsqueeze(0)


class And(_Combined):
    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return self.a.allowed(b, h, q_idx, kv_idx, nq, nk) & self.b.allowed(b, h, q_idx, kv_idx, nq, nk)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        ma, mb = self._both_maps(nq, nk, bq, bk, device, B, H)
        return torch.minimum(ma, mb)  # EMPTY < PARTIAL < FULL: the weaker tile wins

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"


class Or(_Combined):
    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return self.a.allowed(b, h, q_idx, kv_idx, nq, nk) | self.b.allowed(b, h, q_idx, kv_idx, nq, nk)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        ma, mb = self._both_maps(nq, nk, bq, bk, device, B, H)
        return torch.maximum(ma, mb)  # the stronger tile wins

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"


class Not(Mask):
    def __init__(self, a: Mask) -> None:
        self.a = a
        self.batch = a.batch
        self.depends_on_head = a.depends_on_head
        self.depends_on_batch = a.depends_on_batch

    def tensors(self):
        return self.a.tensors()

    def check(self, B, H, nq, nk):
        self.a.check(B, H, nq, nk)

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return ~self.a.allowed(b, h, q_idx, kv_idx, nq, nk)

    def predicate_pairs(self, B, H, nq, nk):
        return self.a.predicate_pairs(B, H, nq, nk)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        return (FULL - self.a._block_map(nq, nk, bq, bk, device, B, H)).to(torch.int8)

    def __repr__(self):
        return f"~{self.a!r}"


# helpers for subclasses
def tile_grid(nq: int, nk: int, bq: int, bk: int, device=None):
    """Per-tile first/last query position (bottom-right aligned) and key index, shaped to broadcast
    to (TQ, TK): (pq_lo, pq_hi) are (TQ, 1), (k_lo, k_hi) are (1, TK)."""
    q_lo, q_hi = _tile_bounds(nq, bq, device)
    k_lo, k_hi = _tile_bounds(nk, bk, device)
    off = nk - nq
    return (q_lo + off).view(-1, 1), (q_hi + off).view(-1, 1), k_lo.view(1, -1), k_hi.view(1, -1)


def block_map_from_dense(d: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Tile classes from a dense boolean (Bm, nq, nk) by counting allowed pairs per tile."""
    bm, nq, nk = d.shape
    counts = block_counts(d, bq, bk)
    q_lo, q_hi = _tile_bounds(nq, bq, d.device)
    k_lo, k_hi = _tile_bounds(nk, bk, d.device)
    size = (q_hi - q_lo + 1).view(-1, 1) * (k_hi - k_lo + 1).view(1, -1)
    return classify(counts == size, counts > 0)


def predicate_block_map(mask: Mask, B: int, H: int, nq: int, nk: int, bq: int, bk: int, device) -> torch.Tensor:
    """Tile classes (Bm, TQ, TK) from evaluating ``mask.allowed`` on every (b < B, h < H, q, k), a band of
    query tiles at a time: FULL where every head allows the whole tile, EMPTY where no head allows any of
    it. One map per batch row when the rows differ (Bm = B), else Bm = 1."""
    tq = math.ceil(nq / bq)
    b = torch.arange(B, device=device).view(-1, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, -1, 1, 1)
    kj = torch.arange(nk, device=device).view(1, 1, 1, -1)
    band = max(1, (1 << 24) // max(1, B * H * bq * nk))  # query tiles per evaluation
    full, some = [], []
    for t0 in range(0, max(tq, 1), band):
        qi = torch.arange(t0 * bq, min(nq, (t0 + band) * bq), device=device).view(1, 1, -1, 1)
        allowed = torch.broadcast_to(mask.allowed(b, h, qi, kj, nq, nk), (B, H, qi.shape[2], nk))
        full.append(block_counts(allowed.all(1), bq, bk))
        some.append(block_counts(allowed.any(1), bq, bk))
    full_c, some_c = torch.cat(full, 1), torch.cat(some, 1)  # [B, TQ, TK] allowed-pair counts
    q_lo, q_hi = _tile_bounds(nq, bq, device)
    k_lo, k_hi = _tile_bounds(nk, bk, device)
    sizes = (q_hi - q_lo + 1).view(-1, 1) * (k_hi - k_lo + 1).view(1, -1)
    out = classify(full_c == sizes, some_c > 0)
    if B > 1 and bool((out == out[:1]).all()):
        out = out[:1]
    return out


def block_counts(d: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Number of True entries of ``d`` (Bm, nq, nk) in each (bq, bk) tile: (Bm, TQ, TK)."""
    bm, nq, nk = d.shape
    tq, tk = math.ceil(nq / bq), math.ceil(nk / bk)
    pad = torch.zeros(bm, tq * bq, tk * bk, dtype=torch.int32, device=d.device)
    pad[:, :nq, :nk] = d.to(torch.int32)
    return pad.view(bm, tq, bq, tk, bk).sum(dim=(2, 4))


def coarse_block_map(coarse: torch.Tensor, cq: int, ck: int, nq: int, nk: int, bq: int, bk: int,
                     q_offset: int = 0) -> torch.Tensor:
    """Exact tile classes for a mask defined on a coarse grid of (cq x ck) cells.

    ``coarse`` is (Bm, RQ, RK) bool: cell (r, c) allows every pair with query *coordinate* in
    [r*cq, (r+1)*cq) and key in [c*ck, (c+1)*ck). Query coordinates are ``row + q_offset`` (pass
    ``nk - nq`` for position-based masks). A tile is FULL when every cell it touches is True and
    EMPTY when none is, found with 2-D prefix sums in O(cells + tiles). Negative query coordinates (query
    rows before the first position when Nq > Nk) lie in no cell: they allow nothing.
    """
    if q_offset < 0:
        lead = -(q_offset // cq)  # all-False cell rows in front cover the negative coordinates
        coarse = torch.cat([coarse.new_zeros(coarse.shape[0], lead, coarse.shape[2]), coarse], dim=1)
        q_offset += lead * cq
    bm, rq, rk = coarse.shape
    ps = torch.zeros(bm, rq + 1, rk + 1, dtype=torch.int64, device=coarse.device)
    ps[:, 1:, 1:] = coarse.to(torch.int64).cumsum(1).cumsum(2)
    q_lo, q_hi = _tile_bounds(nq, bq, coarse.device)
    k_lo, k_hi = _tile_bounds(nk, bk, coarse.device)
    r0 = ((q_lo + q_offset) // cq).clamp(0, rq - 1).view(-1, 1)
    r1 = ((q_hi + q_offset) // cq).clamp(0, rq - 1).view(-1, 1) + 1
    c0 = (k_lo // ck).clamp(0, rk - 1).view(1, -1)
    c1 = (k_hi // ck).clamp(0, rk - 1).view(1, -1) + 1
    total = ps[:, r1, c1] - ps[:, r0, c1] - ps[:, r1, c0] + ps[:, r0, c0]
    cells = (r1 - r0) * (c1 - c0)
    return classify(total == cells, total > 0)


def row_index(data: torch.Tensor, b: Index) -> Index:
    """The batch index to read per-batch ``data`` with: ``b`` itself, or 0 when data has one row."""
    return b if data.shape[0] > 1 else torch.zeros_like(b)


MaskFn = Callable[[Index, Index, Index, Index], torch.Tensor]


def _export(name: str):
    def method(self, *args, **kwargs):
        from . import export
        return getattr(export, name)(self, *args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"See :func:`qkv.masks.export.{name}`."
    return method


for _name in ("to_flex_block_mask", "to_block_sparse", "to_bsr", "to_block_list"):
    setattr(Mask, _name, _export(_name))
