"""DeepSeek-V2 on qkv: HF ``model_type`` ``"deepseek_v2"``.

DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model"
(arXiv:2405.04434). A :class:`qkv.nn.DecoderLM` whose layers use

- Multi-head Latent Attention (:class:`qkv.nn.latent.LatentAttention`): a low-rank latent ``c_kv`` and a
  shared decoupled RoPE key are all the cache keeps (:class:`qkv.cache.LatentSpec`); the query is
  low-rank too when ``q_lora_rank`` is set; RoPE pairs channels ``(2f, 2f+1)``; YaRN scaling with
  ``mscale``/``mscale_all_dim`` scales cos/sin and the softmax;
- DeepSeekMoE (Dai et al. 2024, arXiv:2401.06066) from layer ``first_k_dense_replace`` on: a float32
  softmax router picking ``num_experts_per_tok`` of ``n_routed_experts`` (``greedy`` or
  ``group_limited_greedy``), weights times ``routed_scaling_factor`` and never renormalized (transformers'
  router reads no ``norm_topk_prob``), plus ``n_shared_experts`` experts every token goes through (none for 0:
  transformers then builds zero-width shared experts, which add nothing); earlier layers have a dense SwiGLU
  of ``intermediate_size``.

Tensor names: attention keeps HF's (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``); the router ``mlp.gate`` becomes
``mlp.router``; experts are stacked (``mlp.experts.gate_up_proj`` (E, 2f, d), ``mlp.experts.down_proj``
(E, d, f)), read either from transformers 5's stacked tensors or from per-expert tensors
(``mlp.experts.{e}.gate_proj.weight``, ...) as checkpoints on disk have them.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    ...     num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
    ...     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
    ...     n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import read_latent, read_moe
from ..nn import DecoderConfig, DecoderLM
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["deepseek_v2"] = "qkv.models.family_deepseek"


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF DeepSeek-V2 config dict."""
    if cfg.get("model_type") != "deepseek_v2":
        raise CheckpointError(f"family_deepseek: model_type {cfg.get('model_type')!r} is not deepseek_v2")
    try:
        latent = read_latent(cfg)
        moe = read_moe(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a deepseek_v2 model from its config: {e!r}") from e
    return decoder_config_from(
        cfg, head_dim=None, hidden_act=cfg.get("hidden_act", "silu"), mlp_bias=bool(cfg.get("mlp_bias", False)),
        latent=latent, moe=moe, interleaved_rope=True)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return rename_decoder(state, decoder_config(config), norms={"input_layernorm": "attn_norm",
                                                             "post_attention_layernorm": "ffn_norm"})
