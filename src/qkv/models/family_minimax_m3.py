"""MiniMax-M3 on qkv: HF ``model_type`` ``"minimax_m3_vl_text"`` and the language model of ``"minimax_m3_vl"``.

MiniMax 2026, MiniMax-M3 model report. A pre-norm :class:`qkv.nn.DecoderLM` with Gemma-style RMSNorms (scale
``1 + weight``), per-head QK norm, partial RoPE and GQA, where

- the layers HF's ``layer_types`` marks ``"minimax_m3_sparse"`` are MSA layers (the ``"msa"`` mixer kind,
  :class:`qkv.nn.msa.BlockSparseAttention`): each KV group reads only the key blocks its indexer keeps, the local
  block always included; the others attend densely;
- the layers ``mlp_layer_types`` marks ``"sparse"`` are a mixture of experts (sigmoid scores with a correction
  bias, top ``num_experts_per_tok`` renormalized and scaled by ``routed_scaling_factor``; GPT-OSS's clamped
  SwiGLU experts without biases and one clamped-SwiGLU shared expert of ``shared_intermediate_size``); the
  others a clamped-SwiGLU MLP of ``dense_intermediate_size``.

MSA layers cache their indexer's key beside their keys and values (:class:`qkv.cache.IndexedSpec`, in the value
rows' tail), so cached decoding, paged pools, prefix sharing and the Engine serve such a model.
Tensor names are HF's (``self_attn.indexer.*``, ``mlp.experts.*``, ``mlp.shared_experts.*``), q/k/v stacked; the
router is ``mlp.router`` and its bias ``mlp.e_score_correction_bias``; the experts' biases are zeros.

Example:
    >>> cfg = decoder_config({"model_type": "minimax_m3_vl_text", "vocab_size": 64, "hidden_size": 32,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    ...     "intermediate_size": 16, "dense_intermediate_size": 24, "shared_intermediate_size": 16,
    ...     "num_local_experts": 4, "num_experts_per_tok": 2, "index_n_heads": 2, "index_head_dim": 8,
    ...     "index_block_size": 4, "index_topk_blocks": 2, "index_local_blocks": 1,
    ...     "layer_types": ["full_attention", "minimax_m3_sparse"], "mlp_layer_types": ["dense", "sparse"],
    ...     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}})
    >>> cfg.msa.layers, cfg.moe.moe_layers, cfg.intermediate_size
    ((1,), (1,), 24)
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import text_config
from ..config.layer_types import FULL_ATTENTION
from ..config.moe import MoEConfig
from ..config.msa import MSAConfig
from ..nn import DecoderConfig, DecoderLM
from .family_qwen3_next import language_model_state
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

MODEL_TYPES = ("minimax_m3_vl_text", "minimax_m3_vl")
for _t in MODEL_TYPES:
    FAMILIES[_t] = "qkv.models.family_minimax_m3"

SPARSE_ATTENTION = "minimax_m3_sparse"
#: HF's defaults (``MiniMaxM3VLTextConfig``) for the keys a config.json may leave out.
_DEFAULTS = {"dense_intermediate_size": 12288, "shared_intermediate_size": 3072, "routed_scaling_factor": 2.0,
             "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "index_n_heads": 4, "index_head_dim": 128,
             "index_block_size": 128, "index_topk_blocks": 16, "index_local_blocks": 1, "num_experts_per_tok": 4,
             "num_local_experts": 128, "head_dim": 128, "rms_norm_eps": 1e-6}


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"family_minimax_m3: model_type {kind!r} is not one of {MODEL_TYPES}")
    if kind == "minimax_m3_vl":
        if not isinstance(cfg.get("text_config"), dict):
            raise CheckpointError(f"from_hf: a minimax_m3_vl config needs its language model's text_config (a "
                                  f"dict), got {type(cfg.get('text_config')).__name__}")
        text = text_config(cfg)
    else:
        text = dict(cfg)
    return {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}


def _layer_list(text: dict[str, Any], key: str, values: tuple[str, str]) -> list[str]:
    n = text.get("num_hidden_layers")
    kinds = text.get(key)
    if not isinstance(kinds, (list, tuple)) or len(kinds) != n or set(kinds) - set(values):
        raise CheckpointError(f"from_hf: minimax_m3 needs {key}, one of {values} for each of its "
                              f"num_hidden_layers={n} layers, got {kinds!r}")
    return list(kinds)


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF MiniMax-M3 text (or multimodal) config dict."""
    text = _text(cfg)
    attn = _layer_list(text, "layer_types", (FULL_ATTENTION, SPARSE_ATTENTION))
    mlp = _layer_list(text, "mlp_layer_types", ("dense", "sparse"))
    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"from_hf: minimax_m3's MLPs are clamped SwiGLU (hidden_act 'silu'), got "
                              f"{text['hidden_act']!r}")
    try:
        msa = MSAConfig(index_n_heads=text["index_n_heads"], index_head_dim=text["index_head_dim"],
                        block=text["index_block_size"], topk_blocks=text["index_topk_blocks"],
                        local_blocks=text["index_local_blocks"],
                        layers=tuple(i for i, t in enumerate(attn) if t == SPARSE_ATTENTION))
        moe = MoEConfig(n_routed_experts=text["num_local_experts"], num_experts_per_tok=text["num_experts_per_tok"],
                        moe_intermediate_size=text["intermediate_size"], n_shared_experts=1,
                        shared_expert_intermediate_size=text["shared_intermediate_size"],
                        routed_scaling_factor=float(text["routed_scaling_factor"]), topk_method="noaux_tc",
                        n_group=1, topk_group=1, norm_topk_prob=True, swiglu_limit=float(text["swiglu_limit"]),
                        swiglu_alpha=float(text["swiglu_alpha"]),
                        moe_layers=tuple(i for i, t in enumerate(mlp) if t == "sparse"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a minimax_m3 model from its config: {e}") from e
    text = {**text, "layer_types": [FULL_ATTENTION] * len(attn), "intermediate_size": text["dense_intermediate_size"]}
    return decoder_config_from(text, partial_rotary=True, hidden_act="silu", qk_norm=True, norm_offset=1.0,
                               moe=moe, msa=msa if msa.layers else None)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    c = decoder_config(config)
    out = rename_decoder(language_model_state(state), c, norms={"input_layernorm": "attn_norm",
                                                                "post_attention_layernorm": "ffn_norm"})
    for i in range(c.num_hidden_layers):
        mlp = f"layers.{i}.mlp."
        for a, b in (("gate.weight", "router.weight"), ("gate.e_score_correction_bias", "e_score_correction_bias")):
            if mlp + a in out:
                out[mlp + b] = out.pop(mlp + a)
        up = out.get(mlp + "experts.gate_up_proj")
        if up is not None and up.dim() == 3:  # (E, 2f, d) gate rows first, as qkv's; no biases
            out[mlp + "experts.gate_up_proj_bias"] = up.new_zeros(up.shape[:2])
            out[mlp + "experts.down_proj_bias"] = up.new_zeros(up.shape[0], up.shape[2])
    return out
