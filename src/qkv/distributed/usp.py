"""USP: Ulysses inside groups of U ranks, ring attention across the R = W / U groups (2-D).

Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context Generative AI". The
all-to-all runs over the fast, small Ulysses group; the ring passes K/V chunks of U * n tokens between groups.
Layout: contiguous over all W ranks, rank ``i * U + j`` (see :mod:`qkv.distributed.groups`).

Collectives per call: forward 3 + 1 all-to-alls in the Ulysses group and R-1 ring shifts in the ring group.
"""

from __future__ import annotations

import torch

from .exchange import Exchange
from .groups import UspGroups
from .plan import Plan
from .ring import RingAttention
from .sharding import ShardLayout, segments
from .ulysses import AllToAll, split_heads

__all__ = ["usp_attention"]


def usp_attention(groups: UspGroups, ex_u: Exchange, ex_r: Exchange, q, k, v, q_layout: ShardLayout,
                  k_layout: ShardLayout, *, mask, mod, scale: float, backend: str, log, mod_tensors: tuple,
                  return_lse: bool = False):
    U, R = groups.ulysses_size, groups.ring_size
    k, v = split_heads(q, k, v, U, "usp")
    qh = AllToAll.apply(ex_u, q, 1, 2, "Q")  # (B, Hq/U, U*n, Dqk): ring chunk i for a share of the heads
    kh = AllToAll.apply(ex_u, k, 1, 2, "K")
    vh = AllToAll.apply(ex_u, v, 1, 2, "V")

    def members(lay: ShardLayout):
        return [torch.cat([lay.index[i * U + j] for j in range(U)]).to(q.device) for i in range(R)]

    q_index, k_index = members(q_layout), members(k_layout)
    plan = Plan(ex_r, groups.ring_rank, R, q_index, k_index, [segments(i) for i in q_index],
                [segments(i) for i in k_index], groups.ulysses_rank * (q.shape[1] // U), q.shape[1],
                q_layout.n_global, k_layout.n_global, mask, mod, scale, backend, log, mod_tensors)
    out, lse = RingAttention.apply(plan, qh, kh, vh, *mod_tensors)
    out = AllToAll.apply(ex_u, out, 2, 1, "out")
    if not return_lse:
        return out, None
    return out, AllToAll.apply(ex_u, lse.unsqueeze(-1), 2, 1, "lse").squeeze(-1)
