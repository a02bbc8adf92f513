"""SmolLM3 on qkv: HF ``model_type`` ``"smollm3"``.

Hugging Face 2025, "SmolLM3: smol, multilingual, long-context reasoner" (model card and blog post,
HuggingFaceTB/SmolLM3-3B). A Llama-shaped :class:`qkv.nn.DecoderLM` (RMSNorm, GQA, SwiGLU, tied head) whose
every ``no_rope_layer_interval``-th layer (4) is a NoPE layer (Kazemnejad et al. 2023, arXiv:2305.19466): its
queries and keys are not rotated. HF's ``no_rope_layers`` lists 1 for a rotated layer and 0 for a NoPE one;
:func:`qkv.config.hf_config.read_layout` reads it as the description's ``nope_layers``, which the attention module
honours (no SmolLM3-only code). With ``use_sliding_window`` and no ``layer_types``, HF slides exactly the NoPE
layers, and so does the reader; ``attention_bias`` covers all four attention projections, ``mlp_bias`` the MLP.

Tensor names as :mod:`qkv.models.family_llama`.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    ...     num_attention_heads=4, num_key_value_heads=2))
    >>> model = from_hf(hf)  # doctest: +SKIP
    >>> model.config.nope_layers  # doctest: +SKIP
    (3,)
"""

from __future__ import annotations

from typing import Any

import torch

from ..nn import DecoderConfig, DecoderLM
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["smollm3"] = "qkv.models.family_smollm3"


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF SmolLM3 config dict."""
    if cfg.get("model_type") != "smollm3":
        raise CheckpointError(f"family_smollm3: model_type {cfg.get('model_type')!r} is not smollm3")
    bias = bool(cfg.get("attention_bias", False))
    return decoder_config_from({"tie_word_embeddings": True, **cfg}, hidden_act=cfg.get("hidden_act", "silu"),
                               qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return rename_decoder(state, decoder_config(config), norms={"input_layernorm": "attn_norm",
                                                             "post_attention_layernorm": "ffn_norm"})
