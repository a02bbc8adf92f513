"""OLMo 2 and OLMo 3 on qkv: HF ``model_type`` ``"olmo2"`` and ``"olmo3"``.

OLMo Team 2024, "2 OLMo 2 Furious" (arXiv:2501.00656); OLMo 3 (Ai2 2025) adds sliding-window layers.
A :class:`qkv.nn.DecoderLM` (RMSNorm, RoPE, SwiGLU) with

- QK-norm over the whole query and key projections (one RMSNorm of ``Hq * D`` and one of ``Hkv * D``
  channels, before the split into heads; ``qk_norm_scope="projection"``), not per head;
- post-norm blocks: no norm before attention or the feed-forward; each branch's output is normalized
  before the residual add (``pre_norms=False`` with ``sandwich_norms``);
- OLMo 3: ``sliding_attention`` layers with ``sliding_window`` as ``layer_types`` says (HF's default
  when a config omits it: every fourth layer full, the others sliding), RoPE per layer type.

Tensor names: ``post_attention_layernorm`` -> ``attn_out_norm``, ``post_feedforward_layernorm`` ->
``ffn_out_norm``; ``self_attn.q_norm`` / ``k_norm`` keep theirs; q/k/v and gate/up stacked as in
:mod:`qkv.models.family_llama`.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.layer_types import FULL_ATTENTION, SLIDING_ATTENTION
from ..nn import DecoderConfig, DecoderLM
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["olmo2"] = "qkv.models.family_olmo"
FAMILIES["olmo3"] = "qkv.models.family_olmo"

_NORMS = {"post_attention_layernorm": "attn_out_norm", "post_feedforward_layernorm": "ffn_out_norm"}


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF OLMo 2 / OLMo 3 config dict."""
    model_type = cfg.get("model_type")
    if model_type not in ("olmo2", "olmo3"):
        raise CheckpointError(f"family_olmo: model_type {model_type!r} is not olmo2 or olmo3")
    if model_type == "olmo2":  # no local layers, whatever a stray sliding_window says
        cfg = {**cfg, "sliding_window": None, "layer_types": None}
    elif cfg.get("layer_types") is None and isinstance(cfg.get("num_hidden_layers"), int):
        cfg = {**cfg, "layer_types": [FULL_ATTENTION if (i + 1) % 4 == 0 else SLIDING_ATTENTION
                                      for i in range(cfg["num_hidden_layers"])]}
    bias = bool(cfg.get("attention_bias", False))
    return decoder_config_from(cfg, hidden_act=cfg.get("hidden_act", "silu"), qkv_bias=bias, o_bias=bias,
                               qk_norm=True, qk_norm_scope="projection", pre_norms=False, sandwich_norms=True)


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return rename_decoder(state, decoder_config(config), norms=_NORMS)
