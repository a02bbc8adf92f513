"""The shape of one Multi-head Latent Attention (MLA) layer as data: DeepSeek-AI 2024, "DeepSeek-V2: A Strong,
Economical, and Efficient Mixture-of-Experts Language Model", Section 2.1 (arXiv:2405.04434). The module is
:class:`qkv.nn.latent.LatentAttention`. Kimi Linear's MLA layers (Kimi Team 2025, arXiv:2510.26692) rotate
nothing (``use_rope=False``, "NoPE").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LatentConfig"]


@dataclass(frozen=True, kw_only=True)
class LatentConfig:
    """Shape of one MLA layer, under HF ``DeepseekV2Config`` field names.

    Args:
        hidden_size: model width ``d``.
        num_attention_heads: ``H``.
        kv_lora_rank: latent width ``r`` (the cached ``c_kv``).
        q_lora_rank: ``None`` for a plain ``q_proj``; else the query is low-rank too
            (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``).
        qk_nope_head_dim: ``dn``, per-head query/key channels without position.
        qk_rope_head_dim: ``dr``, the decoupled RoPE channels (per query head; one key shared by all heads).
        v_head_dim: ``dv``.
        attention_bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (HF's choice; the
            up-projections never have one).
        attention_dropout: dropout on attention probabilities while training.
        rope_theta: RoPE base.
        rope_scaling: HF ``rope_parameters``/``rope_scaling`` dict (``rope_type`` plus fields) or None.
        max_position_embeddings: context length (YaRN's default ``factor``; dynamic NTK's threshold).
        norm_eps: epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``. HF builds both with the RMSNorm
            default ``1e-6`` whatever ``rms_norm_eps`` says, so that is the default here too.
        use_rope: False for MLA without positions (NoPE, Kimi Linear; its checkpoints say ``mla_use_nope``):
            the ``qk_rope_head_dim`` channels stay, as a key part shared by all heads, but are never rotated;
            ``rope_theta`` and ``rope_scaling`` are then unused, and ``rope_scaling`` must be None.
        query_scale_beta, query_scale_period: Llama 4's attention temperature as Mistral 4 uses it: the query at
            position ``p`` is multiplied by ``1 + beta * log(1 + floor(p / period))`` (1 below ``period``; HF's
            ``llama_4_scaling_beta`` and ``original_max_position_embeddings``). None: no such scale; both or neither.

    Example:
        >>> cfg = LatentConfig(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512)
        >>> cfg.qk_head_dim, round(cfg.softmax_scale, 6)
        (192, 0.072169)
    """

    hidden_size: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    attention_dropout: float = 0.0
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-6
    use_rope: bool = True
    query_scale_beta: float | None = None
    query_scale_period: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LatentConfig: {name} must be a positive int, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"LatentConfig: q_lora_rank must be None (plain q_proj) or a positive int, got "
                             f"{self.q_lora_rank!r}")
        if not isinstance(self.use_rope, bool):
            raise TypeError(f"LatentConfig: use_rope must be a bool, got {self.use_rope!r}")
        if self.use_rope and self.qk_rope_head_dim % 2:
            raise ValueError(f"LatentConfig: qk_rope_head_dim must be even (RoPE rotates channel pairs), got "
                             f"{self.qk_rope_head_dim}")
        if not self.use_rope and self.rope_scaling:
            raise ValueError(f"LatentConfig: use_rope=False (NoPE) rotates nothing, so rope_scaling must be None, got "
                             f"{dict(self.rope_scaling)!r}")
        beta, period = self.query_scale_beta, self.query_scale_period
        if (beta is None) != (period is None):
            raise ValueError(f"LatentConfig: query_scale_beta and query_scale_period go together (Llama 4's "
                             f"attention temperature); got query_scale_beta={beta!r}, query_scale_period={period!r}")
        if beta is not None and (not isinstance(beta, (int, float)) or isinstance(beta, bool) or not beta >= 0
                                 or not isinstance(period, int) or isinstance(period, bool) or period < 1):
            raise ValueError(f"LatentConfig: query_scale_beta must be a float >= 0 and query_scale_period a positive "
                             f"int, got {beta!r} and {period!r}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"LatentConfig: attention_dropout must be in [0, 1), got {self.attention_dropout}")

    @property
    def qk_head_dim(self) -> int:
        """``dn + dr``: the per-head query/key width of the expanded path."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def query_scale(self, positions):
        """The query multiplier ``1 + beta * log(1 + floor(p / period))`` at ``positions`` (a tensor of absolute
        positions; negative, padding, counts as 0), in float64; None without a query scale."""
        if self.query_scale_beta is None:
            return None
        blocks = (positions.clamp_min(0) // self.query_scale_period).double()
        return 1.0 + self.query_scale_beta * blocks.log1p()

    @property
    def rope_type(self) -> str:
        params = self.rope_scaling or {}
        return str(params.get("rope_type", params.get("type", "default")))

    @property
    def softmax_scale(self) -> float:
        """``(dn + dr) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for scaled RoPE with
        ``mscale_all_dim`` (DeepSeek's YaRN: the cos/sin carry ``mscale / mscale_all_dim`` per side, so the
        product of both sides is brought back to ``mscale ** 2`` here)."""
        scale = self.qk_head_dim ** -0.5
        params = self.rope_scaling or {}
        mscale_all_dim = params.get("mscale_all_dim")
        if self.rope_type != "default" and mscale_all_dim:
            factor = params.get("factor")
            if factor is None:
                factor = self.max_position_embeddings / params["original_max_position_embeddings"]
            m = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= m * m
        return scale

    @classmethod
    def from_hf(cls, config) -> LatentConfig:
        """From an HF ``DeepseekV2Config`` (or V3, a dict with the same keys, or a ``config.json`` path):
        :func:`qkv.config.hf_config.read_latent`.

        Example:
            >>> LatentConfig.from_hf({"hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 16,
            ...                       "q_lora_rank": 24}).q_lora_rank
            24
        """
        from .hf_config import read_latent  # the one HF reader

        return read_latent(config)
