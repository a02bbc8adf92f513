"""Lowering a request's mask and score modifiers into the Triton kernels' arguments (no triton import).

Shape legend: Bm mask batch (1 or B), TQ/TK tile counts, P partial tiles, Hm mask heads (1 or Hq),
BM/BN tile sizes.

- Tile lists come from the mask's analytic ``block_map`` (O(tiles)): per query tile the visited key
  tiles (forward, dQ) and per key tile the visited query tiles (dK/dV), each slot's kind ``-1`` for
  FULL or the tile's partial id. EMPTY tiles are not listed, so no kernel visits them.
- PARTIAL tiles evaluate the mask in the kernel when it is a conjunction of causal (either
  alignment), sliding windows, key padding and documents, or a prefix-LM mask: a band on ``k - q``,
  a key length per batch row, query/key document ids, a prefix length. Any other mask is evaluated
  by its own ``allowed`` on the partial tiles only, into dense int8 tiles ``(P, Hm, BM, BN)``.
- Score modifiers: at most one ALiBi, one additive tensor (``mods.bias``, or ``mods.relative_bias``
  as its dense bias, through which autograd reaches the table) and one softcap, in any order.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ...masks.base import FULL, PARTIAL, And, Mask
from ...masks.causal import Causal, SlidingWindow
from ...masks.sequence import Document, Padding, PrefixLM
from ...mods.base import Chain, ScoreMod
from ...mods.library import ALiBi, Bias, RelativeBias, Softcap

__all__ = ["MaskPlan", "ModPlan", "lower_mask", "lower_mods", "BIG"]

#: A band bound that no ``k - q`` reaches.
BIG = 1 << 30


@dataclass
class MaskPlan:
    """Kernel arguments for one mask at one tile size."""

    kind: int  # 0 no mask arithmetic, 1 analytic in-kernel, 2 dense partial tiles
    fwd: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # num (Bm, TQ), idx/kind (Bm, TQ, TK) int32
    bwd: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # num (Bm, TK), idx/kind (Bm, TK, TQ) int32
    Bm: int
    visited: int
    partial: int
    band: tuple[int, int] | None = None
    kvlen: torch.Tensor | None = None  # (Bm',) int32
    qid: torch.Tensor | None = None  # (Bm', Nq) int64
    kid: torch.Tensor | None = None  # (Bm', Nk) int64
    prefix: torch.Tensor | None = None  # (Bm',) int32
    tiles: torch.Tensor | None = None  # (P, Hm, BM, BN) int8
    tile_heads: bool = False


@dataclass
class ModPlan:
    alibi: ALiBi | None = None
    alibi_pos: int = 0  # 0 none, 1 before softcap, 2 after
    bias_mod: ScoreMod | None = None  # a Bias or RelativeBias
    bias_pos: int = 0
    cap: float | None = None


def lower_mods(mod: ScoreMod | None) -> ModPlan | str:
    """The modifiers' kernel form, or the reason they have none."""
    plan = ModPlan()
    if mod is None:
        return plan
    parts = list(mod.mods) if isinstance(mod, Chain) else [mod]
    pos = 1
    for m in parts:
        if isinstance(m, ALiBi):
            if plan.alibi is not None:
                return "two ALiBi modifiers: the Triton kernels take one"
            plan.alibi, plan.alibi_pos = m, pos
        elif isinstance(m, (Bias, RelativeBias)):
            if plan.bias_mod is not None:
                return "two tensor/relative bias modifiers: the Triton kernels take one (add the tensors first)"
            plan.bias_mod, plan.bias_pos = m, pos
        elif isinstance(m, Softcap):
            if plan.cap is not None:
                return "two softcaps: the Triton kernels take one"
            plan.cap, pos = m.cap, 2
        else:
            return (f"score_mod {m!r}: a Python function cannot run inside a Triton kernel (ALiBi, softcap, "
                    "tensor and relative bias can); use backend='tiled' or 'flex'")
    return plan


def bias_tensor(plan: ModPlan, B: int, Hq: int, nq: int, nk: int, device) -> torch.Tensor | None:
    """The additive tensor the kernel reads: the user's own tensor for ``mods.bias`` (its autograd
    leaf), the dense bias for ``mods.relative_bias`` (a function of the table, so autograd reaches it)."""
    m = plan.bias_mod
    if m is None:
        return None
    if isinstance(m, Bias):
        return m.tensor
    return m.dense_bias(1, Hq, nq, nk, dtype=torch.float32, device=device)


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lower_mask(mask: Mask | None, B: int, Hq: int, nq: int, nk: int, bm: int, bn: int, device) -> MaskPlan:
    """The mask's kernel arguments at tile size (bm, bn), cached on the mask object (masks are
    immutable: rebuild one whose tensors change)."""
    key = (B, Hq, nq, nk, bm, bn, str(device))
    if mask is not None:
        try:
            hit = _cache.setdefault(mask, {}).get(key)
        except TypeError:
            hit = None
        if hit is not None:
            return hit
    plan = _lower(mask, B, Hq, nq, nk, bm, bn, device)
    if mask is not None:
        try:
            entry = _cache.setdefault(mask, {})
            if len(entry) > 16:
                entry.clear()
            entry[key] = plan
        except TypeError:
            pass
    return plan


def _lower(mask, B, Hq, nq, nk, bm, bn, device) -> MaskPlan:
    tq, tk = math.ceil(nq / bm), math.ceil(nk / bn)
    if mask is None:
        states = torch.full((1, tq, tk), FULL, dtype=torch.int8, device=device)
    else:
        states = mask.block_map(nq, nk, bm, bn, B=B, H=Hq, device=device)[:, 0]  # (Bm, TQ, TK), every head
    Bm = states.shape[0]
    partial = states == PARTIAL
    pid = torch.full(states.shape, -1, dtype=torch.int32, device=device)
    n_partial = int(partial.sum())
    pid[partial] = torch.arange(n_partial, dtype=torch.int32, device=device)
    visited = states != 0
    plan = MaskPlan(kind=0, fwd=_lists(visited, pid), bwd=_lists(visited.transpose(1, 2), pid.transpose(1, 2)),
                    Bm=Bm, visited=int(visited.sum()), partial=n_partial)
    if mask is None or n_partial == 0:  # ragged FULL tiles need only the bounds
        return plan
    analytic = _analytic(mask, nq, nk)
    if analytic is not None:
        plan.kind = 1
        plan.band, plan.kvlen, plan.qid, plan.kid, plan.prefix = analytic
        for name in ("kvlen", "qid", "kid", "prefix"):
            t = getattr(plan, name)
            if t is not None:
                setattr(plan, name, t.to(device=device, dtype=torch.int32 if t.dim() == 1 else torch.int64)
                        .contiguous())
        return plan
    plan.kind = 2
    plan.tile_heads = bool(mask.depends_on_head)
    plan.tiles = _dense_tiles(mask, partial, Hq if plan.tile_heads else 1, nq, nk, bm, bn, device)
    return plan


def _lists(visited: torch.Tensor, pid: torch.Tensor):
    """Per row of tiles: how many are visited, their column ids first (ascending), and each slot's kind."""
    num = visited.sum(-1, dtype=torch.int32)
    order = torch.argsort(visited.to(torch.int8), dim=-1, descending=True, stable=True)
    idx = order.to(torch.int32).contiguous()
    kind = torch.gather(pid, -1, order).contiguous()
    return num.contiguous(), idx, kind


def _dense_tiles(mask: Mask, partial: torch.Tensor, hm: int, nq: int, nk: int, bm: int, bn: int, device):
    """The mask on every PARTIAL tile, ``(P, Hm, BM, BN)`` int8, from its predicate on those tiles only."""
    bi, ti, ki = partial.nonzero(as_tuple=True)
    P = bi.numel()
    if P == 0:
        return torch.zeros(1, hm, bm, bn, dtype=torch.int8, device=device)
    b = bi.view(P, 1, 1, 1).to(torch.int64)
    h = torch.arange(hm, device=device).view(1, hm, 1, 1)
    qi = (ti.view(P, 1, 1, 1) * bm + torch.arange(bm, device=device).view(1, 1, bm, 1)).clamp(max=nq - 1)
    kj = (ki.view(P, 1, 1, 1) * bn + torch.arange(bn, device=device).view(1, 1, 1, bn)).clamp(max=nk - 1)
    allowed = mask.allowed(b, h, qi, kj, nq, nk)
    return torch.broadcast_to(allowed, (P, hm, bm, bn)).to(torch.int8).contiguous()


def _analytic(mask: Mask, nq: int, nk: int):
    """(band, kvlen, qid, kid, prefix) when the kernel can evaluate ``mask`` itself, else None."""
    if isinstance(mask, PrefixLM):
        return (-BIG, nk - nq), None, None, None, mask.lengths
    parts = _conjuncts(mask)
    if parts is None:
        return None
    lo, hi, kvlen, doc = -BIG, BIG, None, None
    for m in parts:
        if isinstance(m, Causal):
            hi = min(hi, m._offset(nq, nk))
        elif isinstance(m, SlidingWindow):
            lo, hi = max(lo, nk - nq - m.left), min(hi, nk - nq + m.right)
        elif isinstance(m, Padding):
            kvlen = m.lengths if kvlen is None else torch.minimum(kvlen, m.lengths)
        elif isinstance(m, Document):
            if doc is not None:
                return None
            doc = (m._query_ids(nq, nk), m.kv_ids)
        else:
            return None
    band = None if (lo, hi) == (-BIG, BIG) else (lo, hi)
    qid, kid = doc if doc is not None else (None, None)
    return band, kvlen, qid, kid, None


def _conjuncts(mask: Mask) -> list[Mask] | None:
    if type(mask) is And:
        a, b = _conjuncts(mask.a), _conjuncts(mask.b)
        return None if a is None or b is None else a + b
    return [mask]
