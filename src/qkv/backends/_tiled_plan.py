"""The tiled backend's schedule: which key tiles each query tile visits, in what batches.

Shape legend: TQ/TK query/key tile counts, R query tiles in one row batch, C key tiles in one chunk,
W = C * block_k key columns in one chunk.

A plan is built once per (mask, Nq, Nk, tile sizes, row batch, chunk) from the mask's block map and
cached on the mask object (weakly), so repeated calls and ``estimate`` are cheap. The plan:

- keeps query tiles in order when rows of a batch visit about as many key tiles, and otherwise
  orders them by that count, longest first, so every row batch holds rows of similar length; the
  rows still active at a given chunk are a prefix of the batch (shorter rows within it are padded);
- orders each row's key tiles PARTIAL first, then FULL, each in ascending tile id. The mask is
  evaluated on the leading PARTIAL slots of a chunk only, never on FULL tiles (up to rows of one
  batch having fewer PARTIAL tiles than another). Ascending ids make rows of a causal or dense mask
  share the same key tiles slot by slot, so those chunks read one contiguous key slice instead of
  gathering per row ("shared" chunks);
- sizes row batches so that one step multiplies at most ``step_tiles`` tile pairs;
- pads short rows in a chunk with slots that read tile 0 and are hidden (set to -inf) by a
  slot-validity mask, so padding costs compute but never changes a result.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from ..masks.base import EMPTY, FULL, PARTIAL, Mask

__all__ = ["Chunk", "RowBatch", "TilePlan", "plan_for", "block_map_for"]


@dataclass
class Chunk:
    """One step of the online softmax for the first ``nact`` rows of a row batch."""

    nact: int  # active rows (a prefix of the row batch)
    width: int  # key tiles in this chunk (C)
    ids: torch.Tensor  # [nact, C] key tile ids; padding slots read tile 0 and are hidden by slot_valid
    slot_valid: torch.Tensor | None  # [nact, C] bool, False on padding slots; None when there are none
    ragged: bool  # the chunk reads the last key tile and it is cut short (Nk % block_k != 0)
    start: int | None  # every active row reads tiles start .. start + C - 1 ("shared"), else None
    partial_width: int  # the first slots that may hold PARTIAL tiles: the mask is evaluated there only
    tiles: int  # real (non-padding) tiles computed in this step
    kj: torch.Tensor  # [1, 1, nact or 1, 1, 1, W] key index per column, clamped to Nk - 1
    colvalid: torch.Tensor | None  # [1, 1, nact or 1, 1, 1, W] bool, False on padding; None if all valid
    cache: dict = field(default_factory=dict)  # derived tensors (gather ids, biases), see the kernel


@dataclass
class RowBatch:
    """Consecutive query tiles (in plan order) processed together."""

    r0: int  # first row, in plan order
    r1: int  # one past the last row
    q_idx: torch.Tensor  # [1, 1, R, 1, block_q, 1] query index per row, clamped to Nq - 1
    chunks: list[Chunk]


@dataclass
class TilePlan:
    nq: int
    nk: int
    block_q: int
    block_k: int
    tq: int
    tk: int
    order: torch.Tensor  # [TQ] query tile id at each plan position
    inverse: torch.Tensor  # [TQ] plan position of each query tile id
    identity: bool  # order is 0 .. TQ-1
    batches: list[RowBatch]
    tiles: int  # non-empty tiles (the work that is done, padding aside)
    partial_tiles: int
    steps: int  # number of chunks (Python-level steps)
    computed_tiles: int  # tiles multiplied, padding included
    cached_bytes: int = 0  # bytes of derived tensors kept in the chunks' caches


def block_map_for(mask: Mask | None, nq: int, nk: int, bq: int, bk: int, device, *, B: int = 1,
                  H: int = 1) -> torch.Tensor:
    """``(Bm, TQ, TK)`` int8 tile classes (all FULL without a mask), cached per mask object and per the
    (batch rows, heads) of the request that the mask says it reads (``Mask.reads``)."""
    tq, tk = math.ceil(nq / bq), math.ceil(nk / bk)
    if mask is None:
        return torch.full((1, tq, tk), FULL, dtype=torch.int8, device=device)
    key = ("bm", nq, nk, bq, bk, str(device), mask.reads(B, H))
    cache = _cache_of(mask)
    if key not in cache:
        cache[key] = mask.block_map(nq, nk, bq, bk, B=B, H=H, device=device)[:, 0]
    return cache[key]


def block_map_cached(mask: Mask | None, nq: int, nk: int, bq: int, bk: int, device, *, B: int = 1,
                     H: int = 1) -> bool:
    """Whether :func:`block_map_for` already holds this block map (so a call pays no predicate evaluation)."""
    return mask is None or ("bm", nq, nk, bq, bk, str(device), mask.reads(B, H)) in _cache_of(mask)


def tile_counts(mask: Mask | None, bm: torch.Tensor) -> tuple[int, int]:
    """(visited, partial) tile counts of a block map, cached with it."""
    if mask is None:
        return bm.numel(), 0
    cache = _cache_of(mask)
    key = ("counts", id(bm))
    hit = cache.get(key)
    if hit is None or hit[0] is not bm:
        hit = (bm, int((bm != EMPTY).sum()), int((bm == PARTIAL).sum()))
        cache[key] = hit
    return hit[1], hit[2]


_mask_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_nomask_cache: dict = {}


def _cache_of(mask: Mask | None) -> dict:
    if mask is None:
        if len(_nomask_cache) > 64:
            _nomask_cache.clear()
        return _nomask_cache
    try:
        return _mask_caches.setdefault(mask, {})
    except TypeError:  # an object that cannot be weakly referenced: no caching
        return {}


def plan_for(mask: Mask | None, bm_row: torch.Tensor, index: int, nq: int, nk: int, bq: int, bk: int,
             step_tiles: int, chunk_tiles: int, *, B: int = 1, H: int = 1) -> TilePlan:
    """The cached plan for one block-map row ``bm_row`` [TQ, TK] (``index`` names which row; B and H
    matter for masks whose block map depends on them, see :func:`block_map_for`)."""
    key = ("plan", index, nq, nk, bq, bk, step_tiles, chunk_tiles, str(bm_row.device), B, H)
    cache = _cache_of(mask)
    if key not in cache:
        cache[key] = build_plan(bm_row, nq, nk, bq, bk, step_tiles, chunk_tiles)
    return cache[key]


#: Padding (computed but empty tiles) that keeping query tiles in their natural order may cost
#: before the plan sorts them by length instead.
_NATURAL_ORDER_WASTE = 0.1


def build_plan(bm: torch.Tensor, nq: int, nk: int, bq: int, bk: int, step_tiles: int, chunk_tiles: int) -> TilePlan:
    """Schedule the non-empty tiles of ``bm`` [TQ, TK] into row batches and key chunks.

    ``step_tiles`` bounds the (query tile, key tile) products in one step (rows x chunk width);
    ``chunk_tiles`` bounds the key tiles per row in one step. Query tiles keep their natural order
    when that pads little (then per-query tensors are read and written as plain slices), and are
    sorted by length otherwise (e.g. a global-token row among window rows).
    """
    natural = _build_plan(bm, nq, nk, bq, bk, step_tiles, chunk_tiles, sort=False)
    if natural.computed_tiles - natural.tiles <= _NATURAL_ORDER_WASTE * natural.tiles:
        return natural
    return _build_plan(bm, nq, nk, bq, bk, step_tiles, chunk_tiles, sort=True)


def _build_plan(bm: torch.Tensor, nq: int, nk: int, bq: int, bk: int, step_tiles: int, chunk_tiles: int, *,
                sort: bool) -> TilePlan:
    device = bm.device
    tq, tk = bm.shape
    bm = bm.to("cpu")
    counts = (bm != EMPTY).sum(1)  # [TQ]
    pcounts = (bm == PARTIAL).sum(1)  # [TQ]
    order = torch.sort(counts, descending=True, stable=True).indices if sort else torch.arange(tq)  # [TQ]
    # Per row: PARTIAL tiles, then FULL, then EMPTY; ascending tile id within each class.
    rank = torch.where(bm == PARTIAL, 0, torch.where(bm == FULL, 1, 2)).to(torch.int64)
    slot_key = rank * (tk + 1) + torch.arange(tk).view(1, -1)
    slots = torch.sort(slot_key, dim=1).indices[order]  # [TQ, TK] tile ids by slot, plan order
    counts, pcounts = counts[order], pcounts[order]

    q_all = torch.clamp(order.view(-1, 1) * bq + torch.arange(bq).view(1, -1), max=nq - 1)  # [TQ, bq]
    ragged_tile = tk - 1 if nk % bk else -1
    batches: list[RowBatch] = []
    steps = computed = 0
    r0 = 0
    while r0 < tq:
        width = max(1, min(chunk_tiles, int(counts[r0:r0 + step_tiles].max())))
        r1 = min(tq, r0 + max(1, step_tiles // width))
        cnt = counts[r0:r1]
        n_slots = int(cnt.max())
        n_partial = int(pcounts[r0:r1].max())
        chunks = []
        for s0, s1 in _chunk_bounds(n_partial, n_slots, chunk_tiles):
            nact = int((cnt > s0).nonzero().max()) + 1  # rows up to the last one with slots left
            ids = slots[r0:r0 + nact, s0:s1]  # [nact, C]
            valid = torch.arange(s0, s1).view(1, -1) < cnt[:nact].view(-1, 1)  # [nact, C]
            longest = int(valid.sum(1).argmax())
            ref = ids[longest]
            contiguous = bool((ref[1:] - ref[:-1] == 1).all()) and bool(valid[longest].all())
            shared = contiguous and bool(((ids == ref.view(1, -1)) | ~valid).all())
            ids = ref.view(1, -1).expand(nact, -1) if shared else torch.where(valid, ids, torch.zeros_like(ids))
            rows_k = ids[:1] if shared else ids  # [nact or 1, C]
            kv = (rows_k.unsqueeze(-1) * bk + torch.arange(bk)).reshape(rows_k.shape[0], -1)  # [., W]
            colvalid = (kv < nk) & valid.repeat_interleave(bk, dim=1)
            chunks.append(Chunk(
                nact=nact, width=s1 - s0, ids=ids.contiguous().to(device),
                slot_valid=None if bool(valid.all()) else valid.to(device),
                ragged=bool((ids[valid] == ragged_tile).any()),
                start=int(ref[0]) if shared else None,
                partial_width=max(0, min(s1, n_partial) - s0), tiles=int(valid.sum()),
                kj=kv.clamp(max=nk - 1).view(1, 1, -1, 1, 1, kv.shape[1]).to(device),
                colvalid=None if bool(colvalid.all()) else colvalid.view(1, 1, -1, 1, 1, kv.shape[1]).to(device),
            ))
            steps += 1
            computed += nact * (s1 - s0)
        batches.append(RowBatch(r0, r1, q_all[r0:r1].view(1, 1, r1 - r0, 1, bq, 1).to(device), chunks))
        r0 = r1
    identity = bool((order == torch.arange(tq)).all())
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(tq)
    return TilePlan(nq, nk, bq, bk, tq, tk, order.to(device), inverse.to(device), identity, batches,
                tiles=int(counts.sum()), partial_tiles=int(pcounts.sum()), steps=steps, computed_tiles=computed)


def _chunk_bounds(n_partial: int, n_slots: int, chunk: int) -> list[tuple[int, int]]:
    """Slot ranges of at most ``chunk`` slots. Rows that fit in one chunk take one step; longer rows
    take their PARTIAL slots [0, n_partial) apart, so every later chunk is FULL (and, for causal or
    dense masks, shared)."""
    if n_slots <= chunk:
        return [(0, n_slots)] if n_slots else []
    out = []
    for lo, hi in ((0, n_partial), (n_partial, n_slots)):
        for s0 in range(lo, hi, chunk):
            out.append((s0, min(hi, s0 + chunk)))
    return out
