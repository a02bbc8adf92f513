"""Mistral 4 on qkv: HF ``model_type`` ``"mistral4"``.

Mistral AI 2026, "Mistral Small 4" (model card, mistralai/Mistral-Small-4-119B-2603). DeepSeek-V3's layout
(:mod:`qkv.models.family_deepseek_v3`: Multi-head Latent Attention with a low-rank query, DeepSeek-V2 arXiv:2405.04434,
and a mixture of experts with shared experts from layer ``first_k_dense_replace`` on) with Mistral's choices:

- RoPE channel pairs interleaved (``rope_interleave``, default True) on the ``qk_rope_head_dim`` channels, YaRN by
  default with DeepSeek's ``mscale`` / ``mscale_all_dim`` also scaling the softmax; HF states the rotated part as
  ``partial_rotary_factor = qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim)``, which is MLA's split;
- Llama 4's attention temperature: the query at position ``p`` is multiplied by
  ``1 + llama_4_scaling_beta * log(1 + floor(p / original_max_position_embeddings))``
  (:attr:`qkv.config.LatentConfig.query_scale_beta`);
- the router: softmax scores, the ``topk_group`` of ``n_group`` groups whose two best scores sum highest, top-k
  there, renormalized (``norm_topk_prob``) and times ``routed_scaling_factor``; no correction bias
  (:func:`qkv.nn.moe.route_softmax`, ``group_limited_top2``).

Tensor names as :mod:`qkv.models.family_deepseek`.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.Mistral4ForCausalLM(transformers.Mistral4Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=24,
    ...     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..nn import DecoderConfig, DecoderLM, LatentConfig
from .family_deepseek_v3 import rename
from .hf import decoder_config as decoder_config_from
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["mistral4"] = "qkv.models.family_mistral4"


def _rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], float | None, int | None]:
    """``cfg`` with the RoPE parameters as qkv's reader takes them (the rotated fraction, which is MLA's split,
    taken out; ``num_key_value_heads``, which MLA does not use, set to the heads), and Llama 4's ``(beta, period)``
    of the query scale (None, None without one)."""
    params = dict(cfg.get("rope_parameters") or {})
    dn, dr = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
    factor = params.pop("partial_rotary_factor", None)
    if factor is not None and isinstance(dn, int) and isinstance(dr, int) and not math.isclose(factor, dr / (dn + dr)):
        raise CheckpointError(f"from_hf: mistral4 rotates the qk_rope_head_dim={dr} channels of each head, "
                              f"partial_rotary_factor {dr}/{dn + dr}; this config says {factor}")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and isinstance(dn, int) and isinstance(dr, int) and head_dim != dn + dr:
        # HF's rotary table takes its frequencies from head_dim * partial_rotary_factor channels, not from the
        # qk_rope_head_dim it rotates; Mistral4Config sets head_dim to dn + dr, so only a hand-edited config differs
        raise CheckpointError(f"from_hf: mistral4 with head_dim={head_dim} != qk_nope_head_dim + qk_rope_head_dim = "
                              f"{dn + dr}: HF would draw its RoPE frequencies for {int(head_dim * dr / (dn + dr))} "
                              f"channels and rotate {dr}, a different model from the one qkv builds; set head_dim to "
                              f"{dn + dr} (what Mistral4Config sets) or drop it")
    beta = params.pop("llama_4_scaling_beta", None)
    period = params.get("original_max_position_embeddings")
    if beta is not None and period is None:
        raise CheckpointError("from_hf: mistral4's llama_4_scaling_beta needs original_max_position_embeddings in "
                              "rope_parameters (the period of the query scale)")
    params.pop("max_position_embeddings", None)
    # MLA has no KV heads: HF's num_key_value_heads (default 32) is unused by its attention
    cfg = {**cfg, "rope_parameters": params or None, "num_key_value_heads": cfg.get("num_attention_heads")}
    return cfg, beta, None if beta is None else int(period)


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF Mistral 4 config dict."""
    if cfg.get("model_type") != "mistral4":
        raise CheckpointError(f"family_mistral4: model_type {cfg.get('model_type')!r} is not mistral4")
    cfg, beta, period = _rope(cfg)
    try:
        from ..config.hf_config import read_moe

        latent = dataclasses.replace(LatentConfig.from_hf(cfg), query_scale_beta=beta, query_scale_period=period)
        moe = read_moe(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a mistral4 model from its config: {e!r}") from e
    return decoder_config_from(cfg, head_dim=None, hidden_act=cfg.get("hidden_act", "silu"), latent=latent, moe=moe,
                               interleaved_rope=bool(cfg.get("rope_interleave", True)))


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return rename(state, decoder_config(config))
