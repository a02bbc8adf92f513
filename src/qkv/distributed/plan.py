"""What the block loops of every scheme share: the call's global geometry, and forward/backward over the
blocks of one (query member, key owner) pair of chunks, skipping blocks the mask empties.

Shape legend: B batch, Hq/Hkv heads held locally, n local length, Dqk/Dv head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._merge import merge_states
from ..mods.base import ScoreMod
from .blocks import BlockGeometry, accumulation_dtype, block_backward, block_forward, block_mask
from .exchange import CommLog, Exchange

__all__ = ["Plan", "ForwardState", "attend_owner", "grad_owner"]


@dataclass(eq=False)
class Plan:
    """One call of a block-loop scheme across the ``world`` members of a ring (``world == 1``: local)."""

    exchange: Exchange | None
    rank: int
    world: int
    q_index: list[torch.Tensor]  # per member: global query indices, on the inputs' device
    k_index: list[torch.Tensor]
    q_segments: list[list[slice]]
    k_segments: list[list[slice]]
    head_offset: int
    n_heads: int
    nq_global: int
    nk_global: int
    mask: object
    mod: ScoreMod | None
    scale: float
    backend: str
    log: CommLog | None
    mod_tensors: tuple[torch.Tensor, ...] = ()

    def geometry(self, qs: slice, owner: int, ks: slice) -> BlockGeometry:
        return BlockGeometry(self.q_index[self.rank][qs], self.k_index[owner][ks], self.head_offset, self.n_heads,
                             self.nq_global, self.nk_global)


class ForwardState:
    """Running output and lse of this rank's queries, float32 (float64 for float64 inputs)."""

    def __init__(self, q: torch.Tensor, dv: int) -> None:
        B, Hq, n, _ = q.shape
        self.out = torch.zeros(B, Hq, n, dv, dtype=accumulation_dtype(q.dtype), device=q.device)
        self.lse = torch.full((B, Hq, n), float("-inf"), dtype=accumulation_dtype(q.dtype), device=q.device)


def attend_owner(state: ForwardState, plan: Plan, owner: int, q, k, v) -> None:
    """Fold the blocks of this rank's queries against ``owner``'s keys ``k``, ``v`` into ``state``."""
    B, Hq = q.shape[:2]
    for qs in plan.q_segments[plan.rank]:
        for ks in plan.k_segments[owner]:
            geo = plan.geometry(qs, owner, ks)
            d = block_mask(plan.mask, geo, Hq, q.device)
            if d is not None and not bool(d.any()):
                continue  # the mask empties this block: skipped, not computed
            o, lse = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], d, plan.mod, geo, plan.scale, plan.backend)
            merged = merge_states([state.out[:, :, qs], o.to(state.out.dtype)], [state.lse[:, :, qs], lse])
            state.out[:, :, qs], state.lse[:, :, qs] = merged.out, merged.lse
            if plan.log is not None:
                nq, nk = geo.q_index.numel(), geo.k_index.numel()
                plan.log.work += B * Hq * nq * nk
                plan.log.allowed += B * Hq * nq * nk if d is None else \
                    int(d.sum()) * (B // d.shape[0]) * (Hq // d.shape[1])


def grad_owner(plan: Plan, owner: int, q, k, v, do, lse, delta, dlse, dq, dk, dv, dmod: list) -> None:
    """Add the gradients of the blocks against ``owner``'s keys: dq (local), dk/dv (``owner``'s chunk) and the
    score-modifier tensors' (``dmod``, one slot per tensor), all in the accumulation dtype."""
    Hq = q.shape[1]
    for qs in plan.q_segments[plan.rank]:
        for ks in plan.k_segments[owner]:
            geo = plan.geometry(qs, owner, ks)
            d = block_mask(plan.mask, geo, Hq, q.device)
            if d is not None and not bool(d.any()):
                continue
            gq, gk, gv, gm = block_backward(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], do[:, :, qs], lse[:, :, qs], delta[:, :, qs],
                None if dlse is None else dlse[:, :, qs], d, plan.mod, geo, plan.scale, plan.mod_tensors)
            dq[:, :, qs] += gq
            dk[:, :, ks] += gk
            dv[:, :, ks] += gv
            for i, g in enumerate(gm):
                if g is not None:
                    dmod[i] = g.to(dq.dtype) if dmod[i] is None else dmod[i] + g.to(dq.dtype)
