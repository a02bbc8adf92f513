"""Attention over the tokens an indexer selects, with the indexer's keys kept in the KV cache.

MiniMax-M3's MSA (:class:`qkv.nn.BlockSparseAttention`) and Qwen4-Exp's QSA (:class:`qkv.nn.IndexedAttention`) are
grouped-query attention whose queries read only the tokens a small indexer keeps. The indexer scores every earlier
token by a key of its own (one head of ``index_head_dim`` per token), so a decode step must see the indexer keys of
every cached token. :class:`SelectingAttention` is what the two share:

- a step computes this step's indexer keys (:meth:`~SelectingAttention.index_step`);
- without a cache, it selects over them (:meth:`~SelectingAttention.selection`) and attends with that
  :func:`qkv.masks.topk` mask;
- with a cache, the layer's :class:`qkv.cache.IndexedSpec` carries the indexer keys in the tail of its value rows:
  the step stores keys, values and indexer keys together, then selects over every cached indexer key at its cached
  position (``cached_attention(mask_from_view=...)``), and attends over the values without the tail
  (``value_width``). Paged pools, prefix sharing, crop and fork keep the indexer key with its token because it is
  part of the token's row.

A subclass defines :meth:`~SelectingAttention.index_step` and :meth:`~SelectingAttention.selection`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..cache.specs import IndexedSpec
from .self_attention import SelfAttention

if TYPE_CHECKING:
    from .. import masks
    from .mixer import MixerStep

__all__ = ["SelectingAttention"]


class SelectingAttention(SelfAttention):
    """:class:`qkv.nn.SelfAttention` over the tokens :meth:`selection` keeps (see the module); ``indexer.head_dim``
    is the width of the indexer keys a cache keeps."""

    _pending: tuple | None = None  # during a cached step: (x, context, spec, this step's indexer keys, caller's mask)

    def index_step(self, x: torch.Tensor, step: MixerStep, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """This step's indexer keys ``(B, N, index_head_dim)`` as a cache keeps them, and whatever else
        :meth:`selection` needs of the step (its indexer queries)."""
        raise NotImplementedError

    def selection(self, x: torch.Tensor, context: Any, keys: torch.Tensor, *, q_positions: torch.Tensor,
                  kv_positions: torch.Tensor) -> masks.Mask:
        """The :mod:`qkv.masks` mask of the tokens each query reads, over the key slots whose indexer keys are
        ``keys`` (B, S, index_head_dim) at ``kv_positions`` (B, S) (``-1``: padding or empty)."""
        raise NotImplementedError

    def mix(self, x: torch.Tensor, step: MixerStep, keep: int = 0) -> torch.Tensor:
        """The decoder's call: every column (the selection covers every query; the decoder keeps the last)."""
        return self(x, step)

    def forward(self, x: torch.Tensor, step: MixerStep, keep: int = 0, mask=None) -> torch.Tensor:
        B, N, _ = x.shape
        cache = step.cache
        if cache is not None and step.positions is None:
            raise ValueError(f"{type(self).__name__}: a cache needs positions (B, N) of the new tokens")
        pos = step.positions if step.positions is not None else torch.arange(N, device=x.device).expand(B, N)
        keys, context = self.index_step(x, step, pos)
        if cache is None:
            picked = self.selection(x, context, keys, q_positions=pos, kv_positions=pos)
            return super().forward(x, step, 0, mask=picked if mask is None else picked & mask)
        self._pending = (x, context, self._cached_spec(cache), keys, mask)
        try:
            return super().forward(x, step, 0)
        finally:
            self._pending = None

    def _cached_spec(self, cache) -> IndexedSpec:
        """This layer's :class:`qkv.cache.IndexedSpec` in ``cache`` (a cache built from other specs is refused)."""
        specs = getattr(cache, "specs", None)
        spec = specs[self.layer_idx] if isinstance(specs, (list, tuple)) and self.layer_idx < len(specs) else None
        width = self.indexer.head_dim
        if (not isinstance(spec, IndexedSpec) or spec.index_head_dim != width or spec.n_kv_heads != self.n_kv_heads
                or spec.head_dim != self.head_dim or spec.value_width != self.head_dim):
            raise ValueError(f"{type(self).__name__}: layer {self.layer_idx} ({self.kind_name}) caches its indexer "
                             f"key beside its keys and values and needs IndexedSpec(n_kv_heads={self.n_kv_heads}, "
                             f"head_dim={self.head_dim}, index_head_dim={width}) there, got {spec!r}; build the "
                             f"cache from model.cache_specs()")
        return spec

    kind_name = "indexed"  # the layer kind error messages name

    def _attend(self, q, k, v, gate, step: MixerStep, keep: int, rotate, **kw) -> torch.Tensor:
        if self._pending is None:
            return super()._attend(q, k, v, gate, step, keep, rotate, **kw)
        x, context, spec, keys, extra = self._pending

        def select(view):  # over every cached token's indexer key, at the cached positions
            picked = self.selection(x, context, spec.split_values(view.v)[1], q_positions=view.q_positions,
                                    kv_positions=view.kv_positions)
            return picked if extra is None else picked & extra

        return super()._attend(q, k, spec.pack_values(v, keys), gate, step, keep, rotate, mask_from_view=select,
                               value_width=spec.value_width, **kw)
