"""A point of the selection space of sparse attention as data (:mod:`qkv.sparse.select` holds the math): the
scorer, the granularity, who shares one selection, the forced entries and the budget. Torch-free, so the cost
arithmetic (:mod:`qkv.costs.select`) and the model descriptions read it. Papers: DeepSeek-AI 2025 (DSA), Lu et al.
2025 (MoBA, arXiv:2502.13189), the GLM-5, MiniMax-M3 and Qwen4-exp reports (2026).

Example:
    >>> SelectSpec.qsa(budget=2048, ratio=4).budget
    512
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SelectSpec", "SCORERS", "GRANULARITIES", "SHARINGS"]

#: The scorers: DSA's weighted ReLU heads, QSA's unweighted ReLU heads over pooled keys, MSA's max-pooled dot
#: products, MoBA's mean key.
SCORERS = ("weighted_relu", "relu", "max_dot", "mean_key")
#: What one selected entry is: a token, a micro-block (QSA), a block (MSA, MoBA), a compressed entry (V4's CSA).
GRANULARITIES = ("token", "micro_block", "block", "compressed")
#: Who shares one selection: every query head, each KV group, each head.
SHARINGS = ("all_heads", "kv_group", "head")


def _int(fn: str, name: str, value, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{fn}: {name} must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class SelectSpec:
    """One point of the selection space (see the module), as data: what the cost arithmetic and the model
    descriptions read. The math is in the functions.

    Args:
        scorer: one of :data:`SCORERS`. granularity: one of :data:`GRANULARITIES`. sharing: one of
            :data:`SHARINGS`.
        block: tokens per entry (1 for ``token``).
        budget: entries kept per query (forced ones included), except QSA's tail block, which comes on top.
        local: forced most recent blocks (the query's own block and the ``local - 1`` before it).
        tail: the incomplete block at the end is attended whole (QSA).
        heads: scorer query heads. head_dim: scorer head width.

    Example:
        >>> SelectSpec.msa(block=128, topk_blocks=16, local_blocks=1, heads=4, head_dim=128).keys_per_query(10**6)
        2048
    """

    scorer: str
    granularity: str
    sharing: str
    block: int
    budget: int
    local: int = 0
    tail: bool = False
    heads: int = 1
    head_dim: int = 0

    def __post_init__(self) -> None:
        for name, allowed in (("scorer", SCORERS), ("granularity", GRANULARITIES), ("sharing", SHARINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"SelectSpec: {name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("block", "budget", "heads"):
            _int("SelectSpec", name, getattr(self, name))
        _int("SelectSpec", "local", self.local, 0)
        _int("SelectSpec", "head_dim", self.head_dim, 0)
        if self.granularity == "token" and self.block != 1:
            raise ValueError(f"SelectSpec: token granularity has block=1, got block={self.block}")
        if self.local > self.budget:
            raise ValueError(f"SelectSpec: {self.local} forced local blocks do not fit a budget of {self.budget} "
                             f"entries; raise the budget or lower local")

    @classmethod
    def dsa(cls, *, topk: int, heads: int = 1, head_dim: int = 0) -> SelectSpec:
        """DeepSeek-V3.2 / GLM-5: the ``topk`` best tokens by weighted ReLU heads, shared by all heads."""
        return cls(scorer="weighted_relu", granularity="token", sharing="all_heads", block=1, budget=topk,
                   heads=heads, head_dim=head_dim)

    @classmethod
    def qsa(cls, *, budget: int, ratio: int, heads: int = 1, head_dim: int = 0) -> SelectSpec:
        """Qwen4-exp: ``budget // ratio`` micro-blocks of ``ratio`` tokens plus the tail block, all heads."""
        if not isinstance(budget, int) or not isinstance(ratio, int) or ratio < 1 or budget % ratio:
            raise ValueError(f"SelectSpec.qsa: budget={budget!r} tokens must be a multiple of ratio={ratio!r}")
        return cls(scorer="relu", granularity="micro_block", sharing="all_heads", block=ratio,
                   budget=budget // ratio, tail=True, heads=heads, head_dim=head_dim)

    @classmethod
    def msa(cls, *, block: int, topk_blocks: int, local_blocks: int, heads: int = 1, head_dim: int = 0
            ) -> SelectSpec:
        """MiniMax-M3: ``topk_blocks`` blocks (the ``local_blocks`` latest forced) per KV group."""
        return cls(scorer="max_dot", granularity="block", sharing="kv_group", block=block, budget=topk_blocks,
                   local=local_blocks, heads=heads, head_dim=head_dim)

    @classmethod
    def moba(cls, *, block: int, topk: int) -> SelectSpec:
        """MoBA: ``topk`` blocks (the own block forced) per head by mean-key affinity."""
        return cls(scorer="mean_key", granularity="block", sharing="head", block=block, budget=topk, local=1)

    def keys_per_query(self, n: int) -> int:
        """Most keys one query attends at context ``n`` (tokens; compressed entries for ``compressed``)."""
        keys = self.budget * self.block + (self.block - 1 if self.tail else 0)
        return min(keys, n)
