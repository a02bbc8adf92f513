"""Gemma 2 and Gemma 3 (text) on qkv: HF ``model_type`` ``"gemma2"`` and ``"gemma3_text"``.

Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size" (arXiv:2408.00118);
Gemma Team 2025, "Gemma 3 Technical Report" (arXiv:2503.19786). Both are :class:`qkv.nn.DecoderLM`
with these switches on:

- RMSNorm scaling by ``1 + w`` (weights stored around 0), embeddings times ``sqrt(hidden_size)``, and
  "sandwich" norms: every branch output is normalized again before the residual add;
- GeGLU feed-forward with tanh GELU (``hidden_activation``), tied LM head by default;
- scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- local (sliding-window) and global layers: Gemma 2 alternates, starting local; Gemma 3 has
  ``sliding_window_pattern - 1`` local layers per global one (or ``layer_types``);
- Gemma 2: tanh soft-capping of attention scores (``attn_logit_softcapping``) and of the final logits
  (``final_logit_softcapping``);
- Gemma 3: per-head RMSNorm of queries and keys; local layers use RoPE base ``rope_local_base_freq``
  without scaling, global layers ``rope_theta`` with ``rope_scaling`` (or transformers 5's per-layer-type
  ``rope_parameters``).

Tensor names: ``input_layernorm`` -> ``attn_norm``, ``post_attention_layernorm`` -> ``attn_out_norm``,
``pre_feedforward_layernorm`` -> ``ffn_norm``, ``post_feedforward_layernorm`` -> ``ffn_out_norm``; q/k/v
and gate/up projections stacked as in :mod:`qkv.models.family_llama`.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    ...     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import hf_defaults
from ..nn import DecoderConfig, DecoderLM
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["gemma2"] = "qkv.models.family_gemma"
FAMILIES["gemma3_text"] = "qkv.models.family_gemma"

_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_out_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "ffn_out_norm"}


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF Gemma 2 / Gemma 3 text config dict."""
    model_type = cfg.get("model_type")
    if model_type not in ("gemma2", "gemma3_text"):
        hint = " (for the multimodal Gemma 3 pass its text model / text_config)" if model_type == "gemma3" else ""
        raise CheckpointError(f"family_gemma: model_type {model_type!r} is not gemma2 or gemma3_text{hint}")
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"from_hf: {model_type} with use_bidirectional_attention=True (an encoder) is not "
                              "supported; qkv builds the causal decoder")
    cfg = hf_defaults({k: v for k, v in cfg.items() if v is not None or k.endswith("softcapping")})
    bias = bool(cfg.get("attention_bias", False))
    return decoder_config_from(
        {**cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)},
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        norm_offset=1.0, scale_embeddings=True, sandwich_norms=True, qkv_bias=bias, o_bias=bias,
        qk_norm=model_type == "gemma3_text", attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"))


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return rename_decoder(state, decoder_config(config), norms=_NORMS)
