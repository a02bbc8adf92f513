"""OLMo-hybrid on qkv: HF ``model_type`` ``"olmo_hybrid"``.

Allen Institute for AI 2026, "Olmo Hybrid" (model card, allenai/Olmo-Hybrid-7B). A hybrid decoder: three Gated
DeltaNet layers (Yang, Kautz, Hatamizadeh 2025, arXiv:2412.06464) before each full-attention layer (HF
``layer_types``; by default layer ``i`` attends when ``i % 4 == 3``):

- ``linear_attention`` layers: :class:`qkv.nn.SplitGatedDeltaNet` with the write strength ``beta = 2 sigmoid(b)``
  in ``[0, 2]`` (``linear_allow_neg_eigval``, Grazzi et al. 2025, arXiv:2411.12537: the transition
  ``I - beta k k^T`` may have a negative eigenvalue), its gated output norm at eps 1e-5; the layer is
  pre-normed as Llama's (``input_layernorm``, ``post_attention_layernorm`` before the MLP);
- ``full_attention`` layers: OLMo 3's, RMSNorm over the whole query and key projections, no pre-norms, the
  attention and MLP outputs normalized (``post_attention_layernorm``, ``post_feedforward_layernorm``); RoPE,
  or none at all when the config's ``rope_parameters`` has no ``rope_theta`` (HF then builds no rotary table);
- a SwiGLU MLP on every layer, an untied head unless ``tie_word_embeddings``.

Tensor names: attention layers as :mod:`qkv.models.family_olmo`; a linear layer's ``q_proj``, ``k_proj``,
``v_proj`` stack into ``in_proj_qkv`` (the convolution's input order), ``g_proj`` becomes ``in_proj_z`` (the
output gate), ``b_proj`` / ``a_proj`` ``in_proj_b`` / ``in_proj_a``, ``o_proj`` ``out_proj``, ``o_norm``
``norm``, and its ``input_layernorm`` / ``post_attention_layernorm`` ``attn_norm`` / ``ffn_norm``. Checkpoint files
keep OLMo-core's names, which transformers converts on load and so does :func:`convert`: ``attention_layer_norm``
and ``feedforward_layer_norm`` (HF's ``input_layernorm`` and ``post_attention_layernorm``), and one convolution
per part (``q_conv1d``, ``k_conv1d``, ``v_conv1d``, stacked into ``conv1d``).

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    ...     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.layer_types import LINEAR_ATTENTION
from ..nn import DecoderConfig, DecoderLM
from .hf import decoder_config as decoder_config_from
from .hf import rename_decoder, stack_tensors
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["olmo_hybrid"] = "qkv.models.family_olmo_hybrid"

_ATTENTION_NORMS = {"post_attention_layernorm": "attn_out_norm", "post_feedforward_layernorm": "ffn_out_norm"}
#: OLMo-core's names in checkpoint files (transformers renames them on load): the norm before the mixer (a linear
#: layer's ``input_layernorm``) and the one after it (``post_attention_layernorm`` of either kind of layer).
_DISK_NORMS = {"attention_layer_norm.weight": "input_layernorm.weight",
               "feedforward_layer_norm.weight": "post_attention_layernorm.weight"}
_LINEAR_NAMES = {"g_proj": "in_proj_z", "b_proj": "in_proj_b", "a_proj": "in_proj_a", "o_proj": "out_proj",
                 "o_norm": "norm"}


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF OLMo-hybrid config dict."""
    if cfg.get("model_type") != "olmo_hybrid":
        raise CheckpointError(f"family_olmo_hybrid: model_type {cfg.get('model_type')!r} is not olmo_hybrid")
    rope = cfg.get("rope_parameters")
    nope = isinstance(rope, dict) and rope.get("rope_theta") is None and cfg.get("rope_theta") is None
    bias = bool(cfg.get("attention_bias", False))
    c = decoder_config_from(cfg, hidden_act=cfg.get("hidden_act", "silu"), qkv_bias=bias, o_bias=bias, qk_norm=True,
                            qk_norm_scope="projection", pre_norms=False, sandwich_norms=True, linear_pre_norms=True,
                            **({"position": "none"} if nope else {}))
    if LINEAR_ATTENTION not in c.layer_types or set(c.layer_types) == {LINEAR_ATTENTION}:
        raise CheckpointError(f"from_hf: olmo_hybrid needs both linear_attention and full_attention layers, got "
                              f"layer_types={list(c.layer_types)}")
    return c


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    c = decoder_config(config)
    src = {name.removeprefix("model."): t for name, t in state.items()}
    for name in [n for n in src if n.endswith(tuple(_DISK_NORMS))]:  # files on disk keep OLMo-core's norm names
        old = next(o for o in _DISK_NORMS if name.endswith(o))
        src[name.removesuffix(old) + _DISK_NORMS[old]] = src.pop(name)
    for i, kind in enumerate(c.layer_types):
        if kind != LINEAR_ATTENTION:
            continue
        layer, mixer = f"layers.{i}.", f"layers.{i}.linear_attn."
        conv = stack_tensors(src, mixer, ("q_conv1d", "k_conv1d", "v_conv1d"), ".weight")  # on disk: one per part
        if conv is not None:
            src[f"{mixer}conv1d.weight"] = conv
        qkv = stack_tensors(src, mixer, ("q_proj", "k_proj", "v_proj"), ".weight")
        if qkv is not None:
            src[f"{mixer}in_proj_qkv.weight"] = qkv
        for old, new in _LINEAR_NAMES.items():
            if f"{mixer}{old}.weight" in src:
                src[f"{mixer}{new}.weight"] = src.pop(f"{mixer}{old}.weight")
        for old, new in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            if f"{layer}{old}.weight" in src:
                src[f"{layer}{new}.weight"] = src.pop(f"{layer}{old}.weight")
    return rename_decoder(src, c, norms=_ATTENTION_NORMS)
