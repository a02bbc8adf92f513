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
:class:`qkv.cache.SlidingWindowSpec` of one KV head.)

:class:`CompressedCache` keeps those pools while decoding, per layer and per row (left-padded rows each at their
own positions): an :class:`qkv.cache.AttentionCache` for a model whose every layer is DeepSeek-V4 attention
(:class:`qkv.nn.compressed_attention.CompressedAttention` reads and writes its rows' :class:`RowState`; a compressed
entry is added when its window's last token arrives). It is a contiguous per-row store (no paging or prefix sharing).

Example:
    >>> s = CompressedSpec(window=128, head_dim=512, rate=4, index_head_dim=128)
    >>> s.pools(1024, "bfloat16")
    {'window': 131072, 'compressed': 262144, 'indexer': 65536, 'carry': 25600}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .specs import LayerSpec, _positive, _whole, element_bytes

__all__ = ["CompressedCache", "CompressedSpec", "RowState"]


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


class RowState:
    """One row's pools in one layer: ``seen`` tokens so far; ``window`` (1, 1, L < sliding window, D) the last keys
    (K = V); ``entries`` (1, 1, T, D) the compressed entries; ``index_keys`` (1, T, Di) the indexer's keys; ``carry``
    and ``index_carry`` the compressors' :class:`qkv.sparse.CompressCarry` (None before the first token)."""

    __slots__ = ("seen", "window", "entries", "index_keys", "carry", "index_carry")

    def __init__(self) -> None:
        self.seen = 0
        self.window: torch.Tensor | None = None
        self.entries: torch.Tensor | None = None
        self.index_keys: torch.Tensor | None = None
        self.carry: Any = None
        self.index_carry: Any = None


class CompressedCache:
    """The decoding cache of a DeepSeek-V4 model (module notes): ``CompressedCache(model.cache_specs())``.

    Args:
        specs: one spec per layer, each a :class:`CompressedSpec` or (sliding-only layers) a one-head
            :class:`qkv.cache.SlidingWindowSpec`.

    Example:
        >>> from qkv.cache import SlidingWindowSpec
        >>> cache = CompressedCache([SlidingWindowSpec(8, 1, 16), CompressedSpec(8, 16, 4, 8)])
        >>> cache.seq_length, len(cache.rows(1, batch=2))
        (0, 2)
    """

    def __init__(self, specs) -> None:
        from .specs import SlidingWindowSpec

        specs = list(specs)
        bad = [i for i, s in enumerate(specs) if not isinstance(s, CompressedSpec) and not (
            isinstance(s, SlidingWindowSpec) and s.n_kv_heads == 1)]
        if not specs or bad:
            raise ValueError(f"CompressedCache: every layer must be a CompressedSpec or a one-head SlidingWindowSpec "
                             f"(a DeepSeek-V4 model's cache_specs()); layers {bad} are not (got {len(specs)} specs)")
        self.specs = specs
        self._rows: dict[int, list[RowState]] = {}
        self._columns = 0

    def rows(self, layer_idx: int, *, batch: int) -> list[RowState]:
        """The ``batch`` rows' states of layer ``layer_idx`` (created empty on first use)."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.specs):
            raise ValueError(f"CompressedCache: layer_idx must be in [0, {len(self.specs)}), got {layer_idx!r}")
        rows = self._rows.setdefault(layer_idx, [RowState() for _ in range(batch)])
        if len(rows) != batch:
            raise ValueError(f"CompressedCache: layer {layer_idx} holds {len(rows)} rows, this step has {batch}; "
                             "use one cache per batch of sequences")
        return rows

    def advance(self, layer_idx: int, columns: int) -> None:
        """The last layer calls this once a step's ``columns`` have gone through every layer."""
        if layer_idx == len(self.specs) - 1:
            self._columns += columns

    @property
    def seq_length(self) -> int:
        """Columns (padding included) of the steps so far."""
        return self._columns

    def update(self, layer_idx: int, k, v, *, positions, rope=None):
        raise ValueError("CompressedCache keeps DeepSeek-V4 attention layers' pools only; this layer asked for a "
                         "plain key/value update (build the model's cache with qkv.cache.KVCache instead)")

    def cross_kv(self, layer_idx: int, compute):
        raise ValueError("CompressedCache has no cross-attention layers")

    def keeps_absolute_positions(self, layer_idx: int) -> bool:
        return True

    def observe(self, layer_idx: int, q, *, scale=None) -> None:
        return None

    def scores_attention(self, layer_idx: int) -> bool:
        return False

    def prepare(self, input_ids, positions) -> None:
        return None

    @property
    def prefix_caching(self) -> bool:
        return False
