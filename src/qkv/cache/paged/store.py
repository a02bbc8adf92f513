"""One paged layer's store: its key and value pools ``k (P + 1, H, T, Dk)``, ``v (P + 1, H, T, Dv)``, whose slots
come from the shared :class:`qkv.cache.paged.blocks.BlockManager` (PagedAttention / vLLM, Kwon et al. 2023,
arXiv:2309.06180).

Shape legend: B rows, H key/value heads, P blocks in the pool, T block size, Dk/Dv widths.

The store imports no backend: a step is written into its slots through :func:`qkv._paged.write_slots` (the
registered ``paged`` backend's store: one compiled call on CPU) and attended where the blocks lie by handing the
pools, the block tables and the positions to :func:`qkv.attention` as block-pool operands
(:class:`qkv.PagedKV`), which the ``paged`` backend serves (compiled kernels, Triton, or torch ops, as
``qkv.explain`` says). No padded view is gathered unless asked for (:meth:`PagedStore.gather`).
"""

from __future__ import annotations

import torch

from ..._attention import attention
from ..._paged import gather_head_major, write_slots
from ..._request import PagedKV
from ..storage import Store
from .blocks import BlockManager

__all__ = ["PagedStore"]


class PagedStore(Store):
    """One layer's pools; slots come from the shared :class:`BlockManager`."""

    def __init__(self, manager: BlockManager, window: int | None, *, layer: str = "layer") -> None:
        self.manager, self.layer = manager, layer
        self.gi = manager.group_of[window]
        self.group = manager.groups[self.gi]
        self.kp: torch.Tensor | None = None
        self.vp: torch.Tensor | None = None
        self.seen = 0
        manager.stores.append(self)

    @property
    def batch(self) -> int | None:
        return self.manager.rows or None

    def write(self, k, v, pos, *, gather: bool = True):
        """Store the step; return the layer's view ``(k_all, v_all, kv_positions)``, or ``(None, None,
        kv_positions)`` without ``gather`` (the caller decodes in place, :meth:`decode`, or asks :meth:`gather`)."""
        step = self.manager.step_for(self.seen, pos)
        B, H, n, Dk = k.shape
        if self.kp is None:
            g = self.group
            self.kp = k.new_zeros(g.P + 1, H, self.manager.T, Dk)
            self.vp = v.new_zeros(g.P + 1, H, self.manager.T, v.shape[-1])
            g.pools.append((self.kp, self.vp))
        if step.offsets.numel():
            write_slots(self.kp, self.vp, k, v, blocks=step.blocks[self.gi], offsets=step.offsets, real=step.real,
                        src=step.src)
        self.seen += n
        if not gather:
            return None, None, step.view_pos[self.gi]
        return (*self.gather(), step.view_pos[self.gi])

    def write_deferred(self, k, v, pos):
        """:meth:`write` without the view: :meth:`decode` reads the pools in place."""
        return self.write(k, v, pos, gather=False)

    def emptied(self) -> PagedStore:
        self.seen = 0  # the pools stay: the manager's prefix index still points into them
        return self

    def allocated_bytes(self) -> int:
        return self.group.blocks_in_use() * self.block_bytes()

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's view of this layer, ``(k_all (B, H, nb * T, Dk), v_all (B, H, nb * T, Dv))``."""
        tab = self.manager.step.tables[self.gi]  # (B, nb)
        return gather_head_major(self.kp, tab), gather_head_major(self.vp, tab)

    def decode(self, q: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
               window: int | None = None) -> torch.Tensor | None:
        """Causal attention of the step just written over this layer's blocks, where they lie: the pools, the
        step's block tables and positions go to :func:`qkv.attention` as block-pool operands
        (:class:`qkv.PagedKV`), which the registered ``paged`` backend serves. None before any write.

        Args:
            q: (B, Hq, N, D) rotated queries; q_positions (B, N) int64 (``-1``: padding, zeros out).
            window: as in ``masks.positions(..., window=W)``.

        Returns:
            (B, Hq, N, Dv) in q's dtype, or None.
        """
        step = self.manager.step
        if step is None or self.kp is None:
            return None
        return attention(q, self.kp, self.vp, scale=scale,
                         paged=PagedKV(step.tables[self.gi], step.view_pos[self.gi], q_positions, window))

    def cannot_drop(self, n):
        return None  # the manager checks for the whole cache

    def drop_last(self, n):
        self.seen -= n

    def reorder(self, idx):
        pass  # tables live in the manager

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.kp, self.vp) if t is not None)

    def used_bytes(self):
        if self.kp is None:
            return 0
        per_token = (self.kp[0, :, 0].numel() * self.kp.element_size()
                     + self.vp[0, :, 0].numel() * self.vp.element_size())
        keep = self.group.window  # tokens a sliding layer still needs; the rest of its blocks is waste
        return per_token * sum(n if keep is None else min(n, keep) for n in self.manager.lens)

    def block_bytes(self) -> int:
        """Bytes of one block in this layer (keys and values)."""
        if self.kp is None:
            return 0
        return (self.kp[0].numel() * self.kp.element_size() + self.vp[0].numel() * self.vp.element_size())

    def held(self):
        return max(self.manager.lens, default=0)
