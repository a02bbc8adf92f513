"""The shape of DeepSeek Sparse Attention's lightning indexer as data: DeepSeek-AI 2025, "DeepSeek-V3.2-Exp:
Boosting Long-Context Efficiency with DeepSeek Sparse Attention" (Section 2.1). The module is
:class:`qkv.nn.SparseLatentAttention` (MLA over the ``index_topk`` latent entries the indexer selects).

Example:
    >>> IndexerConfig(index_n_heads=64, index_head_dim=128, index_topk=2048).index_topk
    2048
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IndexerConfig"]


@dataclass(frozen=True, kw_only=True)
class IndexerConfig:
    """The lightning indexer of every layer, under HF ``DeepseekV32Config`` field names.

    Args:
        index_n_heads: indexer heads ``Hi`` (DeepSeek-V3.2: 64).
        index_head_dim: indexer query/key width ``Di`` (128); its first ``qk_rope_head_dim`` channels carry
            RoPE. The cache keeps one such key per token beside MLA's latent.
        index_topk: latent entries each query attends to, ``K`` (2048).
        interleaved_rope: the indexer's RoPE pairs are interleaved ``(x0, x1), (x2, x3), ...`` (GLM-5's
            ``glm_moe_dsa``) rather than half-split (DeepSeek-V3.2's).
    """

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    interleaved_rope: bool = False

    def __post_init__(self) -> None:
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"IndexerConfig: {name} must be a positive int, got {value!r}")
