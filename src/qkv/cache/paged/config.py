"""Configuration of block-paged storage (:class:`Paged`), the error a full pool raises (:class:`CacheFull`) and the
pool's occupancy record (:class:`PoolStats`). PagedAttention / vLLM, Kwon et al. 2023, arXiv:2309.06180."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Paged", "CacheFull", "PoolStats"]


class CacheFull(RuntimeError):
    """The block pool cannot hold the requested tokens. Nothing was written."""


@dataclass(frozen=True)
class Paged:
    """Block-paged storage.

    Args:
        block_size: tokens per block (vLLM's default is 16).
        num_blocks: blocks in each layer's pool; exhausting them raises :class:`CacheFull`.
        prefix_caching: index full blocks by the hash of their token prefix and reuse them
            (``cache.match_prefix``), across requests and between rows of one batch.
    """

    block_size: int = 16
    num_blocks: int = 1024
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Paged({name}): expected a positive int, got {value!r}")

    def describe(self) -> str:
        return f"paged(block_size={self.block_size}, num_blocks={self.num_blocks})"

    def layer_blocks(self, lengths: list[int], keep: int | None) -> int:
        """Blocks a layer's rows reference after holding ``lengths`` tokens each (padding is never stored);
        ``keep``: the tokens a bounded layer keeps, whose blocks wholly before them are released when the
        next step is allocated."""
        T = self.block_size
        if keep is None:
            return sum(math.ceil(n / T) for n in lengths)
        return sum(math.ceil(n / T) - max(0, (n - 1 - keep) // T) for n in lengths)


class PoolStats(NamedTuple):
    """Occupancy of the block pool of one group of layers, and the prefix cache's record.

    ==============================  ==========================================================================
    field                           meaning
    ==============================  ==========================================================================
    ``block_size``                  tokens per block
    ``blocks_total``                blocks in the pool (``Paged.num_blocks``); each layer of the group has one
    ``blocks_in_use``               blocks referenced by at least one row now
    ``blocks_cached_reusable``      blocks no row references that still hold an indexed prompt prefix: a later
                                    request reuses them, or they are evicted (least recently used first)
    ``blocks_free``                 blocks holding nothing
    ``prefix_lookup_tokens``        prompt tokens looked up by ``match_prefix`` since the cache was built
                                    (whole cache: the same in every group)
    ``prefix_hit_tokens``           of those, tokens whose keys and values were reused instead of recomputed
    ``prefix_hit_tokens_in_batch``  of the hits, tokens in blocks another row of the same batch wrote
    ``hit_rate``                    ``prefix_hit_tokens / prefix_lookup_tokens`` (0.0 before any lookup)
    ==============================  ==========================================================================

    ``blocks_in_use + blocks_cached_reusable + blocks_free == blocks_total``.
    """

    block_size: int
    blocks_total: int
    blocks_in_use: int
    blocks_cached_reusable: int
    blocks_free: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    prefix_hit_tokens_in_batch: int
    hit_rate: float
