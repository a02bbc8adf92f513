"""The shape of Qwen4-Exp's QSA indexer as data: Qwen Team 2026, "Qwen4-Exp" model card. The module is
:class:`qkv.nn.IndexedAttention` (gated grouped-query attention reading only the tokens its indexer keeps).

Example:
    >>> QSAConfig(index_n_heads=8, index_head_dim=128, budget=2048, block=64).block_topk
    32
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["QSAConfig"]


@dataclass(frozen=True, kw_only=True)
class QSAConfig:
    """The QSA indexer of every ``full_attention`` layer (HF ``Qwen4ExpTextConfig``'s ``indexer_*`` fields).

    Args:
        index_n_heads: indexer query heads ``Hi`` (HF ``indexer_n_heads``); one indexer key head serves them all.
        index_head_dim: indexer query/key width ``Di`` (``indexer_head_dim``); its first channels carry the
            attention's RoPE, so it is at least the rotary dim.
        budget: tokens each query reads from complete blocks (``indexer_budget``), a multiple of ``block``.
        block: consecutive keys averaged into one indexer block (``indexer_compress_ratio``).
    """

    index_n_heads: int
    index_head_dim: int
    budget: int
    block: int

    def __post_init__(self) -> None:
        for name in ("index_n_heads", "index_head_dim", "budget", "block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"QSAConfig: {name} must be a positive int, got {value!r}")
        if self.budget % self.block:
            raise ValueError(f"QSAConfig: budget={self.budget} must be a multiple of block={self.block} (the budget "
                             f"is spent in whole blocks)")

    @property
    def block_topk(self) -> int:
        """Blocks each query selects: ``budget // block``."""
        return self.budget // self.block

    @property
    def keys_per_query(self) -> int:
        """The longest token list of a query: its selected blocks and its incomplete tail block,
        ``budget + block - 1``."""
        return self.budget + self.block - 1
