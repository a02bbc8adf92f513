"""DeepSeek-V3 on qkv: HF ``model_type`` ``"deepseek_v3"``.

DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437). The DeepSeek-V2 layout
(:mod:`qkv.models.family_deepseek`: Multi-head Latent Attention, here with a low-rank query
``q_lora_rank``, and DeepSeekMoE from layer ``first_k_dense_replace`` on) with DeepSeek-V3's routing:

- sigmoid expert scores; experts are chosen by ``score + e_score_correction_bias`` inside the
  ``topk_group`` of ``n_group`` groups whose two best biased scores sum highest, and weighted by their
  unbiased scores, renormalized (``norm_topk_prob``) and times ``routed_scaling_factor``
  (:func:`qkv.nn.moe.route_noaux_tc`); plus ``n_shared_experts`` shared experts;
- YaRN RoPE whose ``mscale`` / ``mscale_all_dim`` also scale the softmax
  (:attr:`qkv.nn.LatentConfig.softmax_scale`); RoPE channel pairs interleaved unless ``rope_interleave``
  is False.

Tensor names as :mod:`qkv.models.family_deepseek`; the router's ``mlp.gate.e_score_correction_bias``
becomes ``mlp.e_score_correction_bias``.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24,
    ...     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=4,
    ...     topk_group=2, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import read_moe
from ..nn import DecoderConfig, DecoderLM, LatentConfig, MoEConfig
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder, rename_router_bias
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config", "rename"]

FAMILIES["deepseek_v3"] = "qkv.models.family_deepseek_v3"


def _moe(cfg: dict[str, Any]) -> MoEConfig | None:
    try:
        return read_moe(cfg)
    except ValueError as e:
        raise CheckpointError(f"from_hf: {e}") from None


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF DeepSeek-V3 config dict."""
    if cfg.get("model_type") != "deepseek_v3":
        raise CheckpointError(f"family_deepseek_v3: model_type {cfg.get('model_type')!r} is not deepseek_v3")
    try:
        latent = LatentConfig.from_hf(cfg)
        moe = _moe(cfg)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a deepseek_v3 model from its config: {e!r}") from e
    return decoder_config_from(
        cfg, head_dim=None, hidden_act=cfg.get("hidden_act", "silu"), latent=latent, moe=moe,
        interleaved_rope=bool(cfg.get("rope_interleave", True)))


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return rename(state, decoder_config(config))


def rename(state: dict[str, torch.Tensor], config: DecoderConfig) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 tensor names to :class:`DecoderLM` names for ``config`` (also DeepSeek-V3.2's)."""
    return rename_router_bias(rename_decoder(state, config, norms={
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}))
