"""The shape of MiniMax-M3's sparse-attention indexer (MSA) as data: MiniMax 2026, MiniMax-M3 model report. The
module is :class:`qkv.nn.msa.BlockSparseAttention` (grouped-query attention reading only the key blocks its
:class:`qkv.nn.MSAIndexer` keeps for each KV group).

Example:
    >>> MSAConfig(index_n_heads=4, index_head_dim=128, block=128, topk_blocks=16, local_blocks=1,
    ...           layers=(1, 2)).keys_per_query
    2048
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MSAConfig"]


@dataclass(frozen=True, kw_only=True)
class MSAConfig:
    """MSA on the layers it names (HF ``MiniMaxM3VLTextConfig``'s ``index_*`` fields; its ``layer_types`` entries
    ``"minimax_m3_sparse"``).

    Args:
        index_n_heads: indexer query heads ``Hi`` (HF ``index_n_heads``), one per KV group: the model's
            ``num_key_value_heads``.
        index_head_dim: indexer query/key width ``Di`` (``index_head_dim``); its first channels carry the
            attention's RoPE, so it is at least the rotary dim.
        block: key positions max-pooled into one indexer block (``index_block_size``).
        topk_blocks: blocks each query reads (``index_topk_blocks``), its local blocks included.
        local_blocks: the latest blocks, the query's own first, always read (``index_local_blocks``).
        layers: the indices of the MSA layers; the others are dense attention.
    """

    index_n_heads: int
    index_head_dim: int
    block: int
    topk_blocks: int
    local_blocks: int
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        for name, low in (("index_n_heads", 1), ("index_head_dim", 1), ("block", 1), ("topk_blocks", 1),
                          ("local_blocks", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"MSAConfig: {name} must be an int >= {low}, got {value!r}")
        if self.local_blocks > self.topk_blocks:
            raise ValueError(f"MSAConfig: local_blocks={self.local_blocks} forced blocks do not fit "
                             f"topk_blocks={self.topk_blocks}; lower the first or raise the second")
        object.__setattr__(self, "layers", tuple(self.layers))
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.layers):
            raise ValueError(f"MSAConfig: layers must be layer indices (ints >= 0), got {self.layers!r}")

    @property
    def keys_per_query(self) -> int:
        """The most keys a query reads: ``topk_blocks * block``."""
        return self.topk_blocks * self.block
