"""One paged layer's store: its key and value pools ``k (P + 1, H, T, Dk)``, ``v (P + 1, H, T, Dv)``, whose slots
come from the shared :class:`qkv.cache.paged.blocks.BlockManager` (PagedAttention / vLLM, Kwon et al. 2023,
arXiv:2309.06180).

Shape legend: B rows, H key/value heads, P blocks in the pool, T block size, Dk/Dv widths.

On CPU with qkv's compiled kernels a step is written into its slots by one call (``paged_store.cpp``) and attended
where the blocks lie, one query per row or a prompt chunk (:meth:`PagedStore.decode`); no padded view is
gathered. Elsewhere layers attend over the gathered view.
"""

from __future__ import annotations

import torch

from ...backends.paged import gather_head_major
from ...cpu import kernels
from ..storage import Store
from .blocks import BlockManager, StepSlots

__all__ = ["PagedStore", "BLOCKS_BELOW_FILL", "BLOCKS_MIN_SLOTS"]


#: Without qkv's compiled CPU kernels (which serve every CPU decode step),
#: the block path (:func:`qkv.backends.paged.paged_decode_blocks`) serves a CPU decode step when the step's rows
#: fill at most this share of the padded view, and the view holds at least BLOCKS_MIN_SLOTS slots: on
#: benchmarks/decode.py's ``paged_cpu`` table fuller views go faster padded (one SDPA over long rows beats many
#: span-sized GEMMs) and small ones too (the block path's fixed cost, a few dozen small ops), while a request
#: stream's ragged rows (about half full) go faster by blocks.
BLOCKS_BELOW_FILL = 0.7
BLOCKS_MIN_SLOTS = 8192


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
        g, T = self.group, self.manager.T
        B, H, n, Dk = k.shape
        if self.kp is None:
            self.kp = k.new_zeros(g.P + 1, H, T, Dk)
            self.vp = v.new_zeros(g.P + 1, H, T, v.shape[-1])
            g.pools.append((self.kp, self.vp))
        if step.offsets.numel():
            mod = kernels.load() if k.device.type == "cpu" and step.src is not None else None
            if (mod is not None and k.dtype == v.dtype == self.kp.dtype == self.vp.dtype and k.stride(-1) == 1
                    and v.stride(-1) == 1 and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))):
                mod.paged_store(self.kp, self.vp, k, v, step.blocks[self.gi], step.offsets, step.src)
            else:
                self.kp[step.blocks[self.gi], :, step.offsets] = k.transpose(1, 2)[step.real]  # (n_real, H, Dk)
                self.vp[step.blocks[self.gi], :, step.offsets] = v.transpose(1, 2)[step.real]
        self.seen += n
        if not gather:
            return None, None, step.view_pos[self.gi]
        return (*self.gather(), step.view_pos[self.gi])

    def write_deferred(self, k, v, pos):
        """:meth:`write` without the view where :meth:`decode` will serve the step (:meth:`decodes_in_place`)."""
        return self.write(k, v, pos, gather=not self.decodes_in_place(k, v))

    def emptied(self) -> PagedStore:
        self.seen = 0  # the pools stay: the manager's prefix index still points into them
        return self

    def allocated_bytes(self) -> int:
        return self.group.blocks_in_use() * self.block_bytes()

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's view of this layer, ``(k_all (B, H, nb * T, Dk), v_all (B, H, nb * T, Dv))``."""
        tab = self.manager.step.tables[self.gi]  # (B, nb)
        return gather_head_major(self.kp, tab), gather_head_major(self.vp, tab)

    def decodes_in_place(self, *tensors: torch.Tensor) -> bool:
        """Whether :meth:`decode` will serve a step of these tensors (this step's ``k``, ``v``: (B, H, N, D)):
        one query per row, the Triton kernel's conditions or the block path's (:meth:`blocks_serve`); several,
        the compiled CPU kernel's (:func:`qkv.backends.paged.blocks_compiled`)."""
        from ...backends.paged import BLOCKS_DTYPES, blocks_compiled
        from ...backends.triton import gpu_decode_ready

        if tensors and tensors[0].dim() == 4 and tensors[0].shape[2] > 1:
            every = (*tensors, *(t for t in (self.kp, self.vp) if t is not None))
            return all(t.dtype in BLOCKS_DTYPES for t in every) and blocks_compiled(*every)
        return gpu_decode_ready(*tensors) or self.blocks_serve(*tensors)

    def blocks_serve(self, *tensors: torch.Tensor) -> bool:
        """Whether the block path (:func:`qkv.backends.paged.paged_decode_blocks`) serves this step: off CUDA,
        float32/float64 pools and tensors, no gradients, and either qkv's compiled CPU kernel built (it reads each
        row's visible slots in place) or the step's rows ragged enough (live slots at most
        :data:`BLOCKS_BELOW_FILL` of a padded view of at least :data:`BLOCKS_MIN_SLOTS` slots) that the torch-op
        block path beats gathering and reading the padded view."""
        from ...backends.paged import BLOCKS_DTYPES, blocks_compiled

        step = self.manager.step
        if step is None or self.kp is None:
            return False
        every = (*tensors, self.kp, self.vp)
        if any(t.is_cuda or t.dtype not in BLOCKS_DTYPES for t in every):
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in every):
            return False
        if blocks_compiled(*every):  # reads the visible slots in place: decode.py's paged_cpu table measures it
            return True  # 1.3-4.3x faster than the padded view (median) in every case, full views included
        return self._ragged(step)

    def _ragged(self, step: StepSlots) -> bool:
        """The step's view holds at least BLOCKS_MIN_SLOTS slots, at most BLOCKS_BELOW_FILL of them live; counted
        once per step and group (the update that defers the view and the decode ask it, every layer of the group
        shares the view's positions)."""
        m = self.manager
        if m.ragged is None or m.ragged[0] is not step:
            m.ragged = (step, {})
        answers = m.ragged[1]
        if self.gi not in answers:
            pos = step.view_pos[self.gi]
            answers[self.gi] = (pos.numel() >= BLOCKS_MIN_SLOTS
                                and int((pos >= 0).sum()) <= BLOCKS_BELOW_FILL * pos.numel())
        return answers[self.gi]

    def decode(self, q: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
               window: int | None = None) -> torch.Tensor | None:
        """Causal attention of the step just written over this layer's blocks, without the padded view. One query
        per row: the Triton paged-decode kernel (in place), when ``gpu_decode_ready`` holds for the query and the
        pools (CUDA, no gradients, triton installed); else the torch block path over each row's live blocks,
        when :meth:`blocks_serve` holds. Several (a prompt chunk): the compiled CPU kernel
        (:func:`qkv.backends.paged.paged_prefill_blocks`), reading each row's visible slots in place. None
        otherwise, and the caller attends over the view (:meth:`gather`).

        Args:
            q: (B, Hq, N, D) rotated queries; q_positions (B, N) int64 (``-1``: padding, zeros out).
            window: as in ``masks.positions(..., window=W)``.

        Returns:
            (B, Hq, N, Dv) in q's dtype, or None.
        """
        from ...backends.triton import gpu_decode_ready

        step = self.manager.step
        if step is None or q.dim() != 4 or self.kp is None:
            return None
        if q.shape[2] > 1:  # a prompt chunk: the compiled CPU kernel reads the blocks in place, else the view
            from ...backends.paged import BLOCKS_DTYPES, blocks_compiled, paged_prefill_blocks

            if not (q.dtype in BLOCKS_DTYPES and q.dtype == self.kp.dtype and blocks_compiled(q, self.kp, self.vp)):
                return None
            out, _ = paged_prefill_blocks(q, self.kp, self.vp, step.tables[self.gi], step.view_pos[self.gi],
                                          q_positions, scale=scale, window=window)
            return out
        if gpu_decode_ready(q, self.kp, self.vp):
            from ...backends.triton.decode import paged_decode as kernel
        elif self.blocks_serve(q):
            from ...backends.paged import paged_decode_blocks as kernel
        else:
            return None
        out, _ = kernel(q[:, :, 0], self.kp, self.vp, step.tables[self.gi], step.view_pos[self.gi],
                        q_positions[:, 0], scale=scale, window=window)
        return out.unsqueeze(2)

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
