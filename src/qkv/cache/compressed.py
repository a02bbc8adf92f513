"""The cache of a DeepSeek-V4 compressed attention layer (CSA or HCA) as a layer spec: several pools per sequence.
DeepSeek-AI 2026, "DeepSeek-V4" technical report, Section 2.3.

One :class:`CompressedSpec` per CSA/HCA layer; its pools, per sequence of ``context`` tokens:

- window: the last ``window`` tokens' single KV head (K = V), ``head_dim`` each (bounded);
- compressed: one entry of ``head_dim`` per complete window of ``rate`` tokens, ``context // rate`` of them;
- indexer: (CSA only) one indexer key of ``index_head_dim`` per entry;
- carry: the compressor's pending tokens of the incomplete window (fewer than ``rate``, each a value and a gate of
  ``width`` = 2·head_dim with CSA's overlap, head_dim without) plus, with overlap, the last complete window's first
  series (``rate`` slots of value and gate, head_dim each); the indexer's carry alike at its width (bounded).

``bytes_per_token`` is the long-run growth per token (``(head_dim + index_head_dim) / rate`` elements),
``fixed_bytes`` the bounded pools, ``bytes_for(context)`` their exact sum and :meth:`CompressedSpec.pools` each pool
apart, which :func:`qkv.cache.plan_memory` and ``qkv memory`` count. (Sliding-only V4 layers are a
:class:`qkv.cache.SlidingWindowSpec` of one KV head.) The model runs without a cache in this version; the spec plans.

Example:
    >>> s = CompressedSpec(window=128, head_dim=512, rate=4, index_head_dim=128)
    >>> s.pools(1024, "bfloat16")
    {'window': 131072, 'compressed': 262144, 'indexer': 65536, 'carry': 25600}
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .specs import LayerSpec, _positive, _whole, element_bytes

__all__ = ["CompressedSpec"]


@dataclass(frozen=True)
class CompressedSpec(LayerSpec):
    """A CSA (``index_head_dim`` > 0, overlapping windows) or HCA (``index_head_dim`` 0) layer's pools (module notes).

    Args:
        window: tokens of the sliding branch (HF ``sliding_window``).
        head_dim: width of the single KV head and of each compressed entry.
        rate: tokens per compressed entry.
        index_head_dim: width of the indexer's keys; 0 for HCA (no indexer, disjoint windows).
    """

    window: int
    head_dim: int
    rate: int
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "head_dim", "rate"):
            _positive(name, getattr(self, name))
        _positive("index_head_dim", self.index_head_dim, allow_zero=True)

    @property
    def overlap(self) -> bool:
        """CSA's overlapping windows (an indexer goes with them)."""
        return self.index_head_dim > 0

    def row_elements(self) -> int:
        """Elements per compressed entry (its key and, with CSA, its indexer key)."""
        return self.head_dim + self.index_head_dim

    def _carry_elements(self) -> int:
        widths = (self.head_dim,) + ((self.index_head_dim,) if self.overlap else ())
        per = 2 if self.overlap else 1  # the pending tokens' channels per series width
        pending = sum(2 * per * w * (self.rate - 1) for w in widths)  # values and gates of < rate tokens
        previous = sum(2 * w * self.rate for w in widths) if self.overlap else 0  # the last window's first series
        return pending + previous

    def pools(self, context: int, dtype: torch.dtype | str) -> dict[str, int | float]:
        """Bytes of each pool for one sequence that has seen ``context`` tokens."""
        eb, entries = element_bytes(dtype), context // self.rate
        return {"window": _whole(min(context, self.window) * self.head_dim * eb),
                "compressed": _whole(entries * self.head_dim * eb),
                "indexer": _whole(entries * self.index_head_dim * eb),
                "carry": _whole(self._carry_elements() * eb)}

    def bytes_per_token(self, dtype: torch.dtype | str) -> int | float:
        """Long-run bytes per token: one entry (and indexer key) per ``rate`` tokens."""
        return self.row_elements() * element_bytes(dtype) / self.rate

    def fixed_bytes(self, dtype: torch.dtype | str) -> int | float:
        """The window and the carries."""
        return _whole((self.window * self.head_dim + self._carry_elements()) * element_bytes(dtype))

    def tokens_for(self, context: int) -> int:
        """Compressed entries kept for ``context`` tokens."""
        return context // self.rate

    def bytes_for(self, context: int, dtype: torch.dtype | str) -> int | float:
        """Every pool's bytes for one sequence of ``context`` tokens."""
        return _whole(sum(self.pools(context, dtype).values()))
