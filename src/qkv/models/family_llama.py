"""Llama, Mistral and Qwen2 on qkv: HF ``model_type`` ``"llama"``, ``"mistral"``, ``"qwen2"``.

All three are the same pre-norm decoder (:class:`qkv.nn.DecoderLM`): RMSNorm, RoPE, GQA,
SwiGLU. They differ in switches:

- Llama (Touvron et al. 2023): ``attention_bias`` on all four attention projections, ``mlp_bias``,
  RoPE scaling (``linear``, ``dynamic``, ``yarn``, ``llama3``), optional ``head_dim``.
- Mistral (Jiang et al. 2023, arXiv:2310.06825): a ``sliding_window`` on every layer when set.
- Qwen2 (Yang et al. 2024, arXiv:2407.10671): biases on q/k/v but not on the output projection; sliding
  windows only with ``use_sliding_window`` and only on layers ``>= max_window_layers`` (or as
  ``layer_types`` says).

Which layers slide, and RoPE, come from the one layout reader, :func:`qkv.config.hf_config.read_layout`.

Tensor names: HF ``model.layers.{i}.self_attn.{q,k,v}_proj`` are stacked into ``layers.{i}.self_attn.qkv_proj``
and ``mlp.{gate,up}_proj`` into ``mlp.gate_up_proj``; the norms are renamed by role (``input_layernorm``
-> ``attn_norm``, ``post_attention_layernorm`` -> ``ffn_norm``).

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..nn import DecoderConfig, DecoderLM
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

for _t in ("llama", "mistral", "qwen2"):
    FAMILIES[_t] = "qkv.models.family_llama"


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF Llama / Mistral / Qwen2 config dict."""
    model_type = cfg.get("model_type")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise CheckpointError(f"family_llama: model_type {model_type!r} is not llama, mistral or qwen2")
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
    return decoder_config_from(
        cfg, hidden_act=cfg.get("hidden_act", "silu"), qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)))


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return rename_decoder(state, decoder_config(config), norms={"input_layernorm": "attn_norm",
                                                             "post_attention_layernorm": "ffn_norm"})
