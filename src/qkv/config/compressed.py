"""DeepSeek-V4's attention as data: per layer, sliding-window attention alone or beside compressed KV entries (CSA:
overlapping windows of ``m`` tokens and a lightning indexer keeping the top entries; HCA: disjoint windows of ``m'``
tokens, all attended). DeepSeek-AI 2026, "DeepSeek-V4" technical report, Section 2.3. The module is
:class:`qkv.nn.compressed_attention.CompressedAttention`; the operators :func:`qkv.sparse.compress_kv` and
:func:`qkv.sparse.compressed_attention`.

Example:
    >>> from qkv.config.rope import RopeParams
    >>> c = CompressedAttentionConfig(attention_types=("sliding", "csa", "hca"), q_lora_rank=32, o_groups=2,
    ...                               o_lora_rank=16, qk_rope_head_dim=8, index_n_heads=4, index_head_dim=16,
    ...                               index_topk=8, compress_rates={"csa": 4, "hca": 16})
    >>> [c.rate_of(i) for i in range(3)]
    [0, 4, 16]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

from .rope import RopeParams

__all__ = ["ATTENTION_TYPES", "CompressedAttentionConfig"]

#: The kinds of DeepSeek-V4 attention layer: sliding window only, compressed sparse (CSA), heavily compressed (HCA).
ATTENTION_TYPES = ("sliding", "csa", "hca")


@dataclass(frozen=True, kw_only=True)
class CompressedAttentionConfig:
    """DeepSeek-V4's attention layers (HF ``DeepseekV4Config`` fields in brackets).

    Args:
        attention_types: one of :data:`ATTENTION_TYPES` per layer [``layer_types``].
        q_lora_rank: the queries' low-rank width [``q_lora_rank``].
        o_groups: head groups of the grouped output projection, ``g`` [``o_groups``].
        o_lora_rank: each group's projected width [``o_lora_rank``].
        qk_rope_head_dim: the rotated channels of each head, the last ones [``head_dim * partial_rotary_factor``].
        index_n_heads, index_head_dim, index_topk: the CSA layers' lightning indexer.
        compress_rates: tokens per compressed entry, ``{"csa": m, "hca": m'}`` [``compress_rates``].
        main_rope: RoPE of the sliding-only layers [``rope_parameters["main"]``].
        compress_rope: RoPE of the CSA and HCA layers, their compressors and indexer
            [``rope_parameters["compress"]``].
    """

    attention_types: tuple[str, ...]
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    qk_rope_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_rates: Mapping[str, int] = field(default_factory=lambda: {"csa": 4, "hca": 128})
    main_rope: RopeParams = field(default_factory=lambda: RopeParams(interleaved=True))
    compress_rope: RopeParams = field(default_factory=lambda: RopeParams(theta=160000.0, interleaved=True))

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention_types", tuple(self.attention_types))
        bad = sorted(set(self.attention_types) - set(ATTENTION_TYPES))
        if bad:
            raise ValueError(f"CompressedAttentionConfig: attention_types must be among {ATTENTION_TYPES}, got {bad}")
        for name in ("q_lora_rank", "o_groups", "o_lora_rank", "qk_rope_head_dim", "index_n_heads", "index_head_dim",
                     "index_topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CompressedAttentionConfig: {name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"CompressedAttentionConfig: qk_rope_head_dim must be even (RoPE rotates channel pairs), "
                             f"got {self.qk_rope_head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim and "csa" in self.attention_types:
            raise ValueError(f"CompressedAttentionConfig: the indexer rotates its last qk_rope_head_dim="
                             f"{self.qk_rope_head_dim} channels, so index_head_dim ({self.index_head_dim}) must be at "
                             "least that")
        rates = dict(self.compress_rates)
        for kind in ("csa", "hca"):
            r = rates.get(kind)
            if kind in self.attention_types and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
                raise ValueError(f"CompressedAttentionConfig: {kind} layers need compress_rates[{kind!r}], a positive "
                                 f"int (tokens per compressed entry), got {r!r}")
        object.__setattr__(self, "compress_rates", MappingProxyType(rates))
        for name in ("main_rope", "compress_rope"):
            if not isinstance(getattr(self, name), RopeParams):
                raise TypeError(f"CompressedAttentionConfig: {name} must be a qkv.config.RopeParams, got "
                                f"{type(getattr(self, name)).__name__}")

    def __reduce__(self):  # pickle with a plain dict (a read-only view does not pickle)
        kept = {f.name: getattr(self, f.name) for f in fields(self)}
        kept["compress_rates"] = dict(self.compress_rates)
        return (_compressed_config, (kept,))

    def rate_of(self, layer_idx: int) -> int:
        """Tokens per compressed entry of layer ``layer_idx`` (0: a sliding-only layer)."""
        kind = self.attention_types[layer_idx]
        return 0 if kind == "sliding" else self.compress_rates[kind]

    def rope_of(self, layer_idx: int) -> RopeParams:
        """The RoPE of layer ``layer_idx``: ``main_rope`` on sliding-only layers, ``compress_rope`` otherwise."""
        return self.main_rope if self.attention_types[layer_idx] == "sliding" else self.compress_rope


def _compressed_config(kwargs: dict) -> CompressedAttentionConfig:
    return CompressedAttentionConfig(**kwargs)
