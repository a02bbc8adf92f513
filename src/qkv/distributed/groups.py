"""Process groups for the 2-D scheme (``usp``): Ulysses inside blocks of consecutive ranks, ring across them.

Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach for Long Context Generative AI". With
``W = R * U`` ranks, rank ``r = i * U + j`` sits at ring position ``i`` and Ulysses position ``j``: the
Ulysses group ``{i * U + j'}`` gathers ring chunk ``i`` for a share of the heads, and the ring group
``{i' * U + j}`` passes those chunks around.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["UspGroups", "usp_groups"]


@dataclass(frozen=True, eq=False)
class UspGroups:
    """The two groups of the ``usp`` scheme and where this rank sits in them."""

    parent: object  # the process group all W ranks share (None = the default world)
    ring: object
    ulysses: object
    ring_size: int
    ulysses_size: int
    ring_rank: int
    ulysses_rank: int

    @property
    def world(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def rank(self) -> int:
        return self.ring_rank * self.ulysses_size + self.ulysses_rank


def usp_groups(group=None, *, ulysses: int) -> UspGroups:
    """Split ``group`` (default: the world) into Ulysses groups of ``ulysses`` consecutive ranks and ring groups
    across them. A collective: every rank of ``group`` calls it, in the same order as other group creation.

    Example:
        >>> # W = 4 as 2 x 2:  g = usp_groups(ulysses=2); attention(q, k, v, scheme="usp", group=g)
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("usp_groups: torch.distributed is not initialized; call init_process_group first")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not isinstance(ulysses, int) or ulysses < 1 or world % ulysses:
        raise ValueError(f"usp_groups: ulysses must be a positive divisor of the group size {world}, got {ulysses!r}")
    members = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    ring_size = world // ulysses
    mine_u = mine_r = None
    for i in range(ring_size):  # every rank creates every subgroup, in one order
        g = dist.new_group([members[i * ulysses + j] for j in range(ulysses)])
        if rank // ulysses == i:
            mine_u = g
    for j in range(ulysses):
        g = dist.new_group([members[i * ulysses + j] for i in range(ring_size)])
        if rank % ulysses == j:
            mine_r = g
    return UspGroups(group, mine_r, mine_u, ring_size, ulysses, rank // ulysses, rank % ulysses)
