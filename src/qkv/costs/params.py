"""Parameter counts of a whole model from its preset: embeddings, attention, feed-forward, norms, LM head.

Counted per layer, in HF's layout (the count equals ``sum(p.numel() for p in model.parameters())`` of the
model :func:`qkv.models.from_hf` builds, which the tests check):

- attention (MHA/GQA/MQA): ``d * Hq * Dqk`` (query) + ``d * Hkv * (Dqk + Dv)`` (key, value) + ``Hq * Dv * d``
  (output), plus biases when the preset has them, ``2 * Dqk`` for a per-head QK norm (``(Hq + Hkv) * Dqk``
  over whole projections, OLMo 2/3) and ``Hq`` sink logits (GPT-OSS). MLA
  (DeepSeek-V2, arXiv:2405.04434): an optional query compression ``d * q_lora_rank`` (+ its norm) before
  ``q_lora_rank * Hq * Dqk``, the joint down-projection ``d * (kv_lora_rank + qk_rope_head_dim)`` (+ norm),
  the up-projection ``kv_lora_rank * Hq * (qk_nope_head_dim + Dv)`` and the output; DeepSeek Sparse Attention's
  lightning indexer (DeepSeek-V3.2) adds ``q_lora_rank * Hi * Di`` (``wq_b``), ``d * Di`` (``wk``), ``d * Hi``
  (``weights_proj``) and a LayerNorm ``2 * Di`` on its key. Gated attention (Qwen3-Next,
  ``attn_output_gate``) adds a second query-sized projection ``d * Hq * Dqk``, the output gate.
- recurrent layers (``"linear_attention"``, Gated DeltaNet): input projections ``d * (2 Hk Dk + 2 H Dv + 2 H)``
  (q, k, v, the output gate z, the write strength b and the decay a), the depthwise convolution
  ``(2 Hk Dk + H Dv) * K``, ``2 H`` decay parameters (``A_log``, ``dt_bias``), the gated norm ``Dv`` and the
  output ``H Dv * d``. Kimi Delta Attention (``mixer="kda"``, ``H`` heads of ``D``): ``3 d H D`` (q, k, v),
  ``2 (d D + D H D)`` (the low-rank forget and output gates), ``d H`` (the write strength) and ``H D * d``, plus
  the convolution ``3 H D * K``, ``H D + H`` decay parameters (a ``dt_bias`` per channel) and the norm ``D``.
- feed-forward: ``2 * d * f`` (dense, GPT-2) or ``3 * d * f`` (gated, SwiGLU/GeGLU, Shazeer 2020); a
  mixture of experts (DeepSeekMoE, Dai et al. 2024, arXiv:2401.06066) holds ``E`` routed experts of width
  ``moe_intermediate_size``, ``n_shared_experts`` always-on ones and a router ``d * E``; a token uses the
  router, ``num_experts_per_tok`` routed experts and the shared ones (the *active* count); Qwen3-Next's shared
  expert is ``shared_expert_intermediate_size`` wide with a ``d -> 1`` sigmoid gate. Gemma 4's experts beside the
  dense MLP (``beside_dense``) add the layer's dense MLP (active for every token), a router scale ``d``, a
  per-expert scale ``E`` and three norms ``3 d``.
- norms: ``d`` per RMSNorm, ``2 d`` per LayerNorm; two per layer (four with sandwich norms, two again
  for OLMo 2/3's post-norm-only blocks) and a final one.
- manifold-constrained hyper-connections (DeepSeek-V4's mHC, ``n = hc_mult`` streams of width ``d``): each
  block's entry and exit ``n d (n^2 + 2 n)`` (the pre, post and mixing weights read from the flattened streams)
  plus ``n^2 + 2 n`` biases and 3 scales, two per layer; the head collapsing the streams ``n d n + n + 1``.
- embeddings ``V * d`` (plus a learned position table), the LM head ``V * d`` unless tied. Gemma 4's per-layer
  inputs (``L`` layers of ``P`` channels) count with the embeddings: their table ``V' * L * P``, the projection
  ``d * L * P`` and its norm ``P``, and in each layer the gate and up projections ``2 d P`` and a norm ``d``.
- per-layer shapes (Gemma 4): each attention layer counts with its type's head width and KV heads; a K = V layer
  has no value projection, a layer reading an earlier layer's keys and values (``kv_shared_from``) has no key or
  value projection nor key norm; ``intermediate_sizes`` give each layer's feed-forward width. The value norm has
  no scale and the layer scalars are buffers: nothing to count.
- an encoder-decoder (the 2017 Transformer) adds ``encoder_layers`` bidirectional layers and, in every
  decoder layer, a cross-attention block with its norm.

Example:
    >>> from qkv.costs import PRESETS, num_parameters
    >>> num_parameters(PRESETS["gpt-2-small"]).total
    124439808
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from ..config.decoder import DecoderConfig
from ..config.mixers import get_mixer, mixer_of
from ..config.presets import ModelPreset, get_preset, preset_from_hf_config, require_whole_model

__all__ = [
    "ParamCount", "attention_weights", "layer_attention_params", "layer_ffn_params", "num_parameters",
    "recurrent_weights", "layer_recurrent_params",
    "require_whole_model", "resolve_preset",
]


class ParamCount(NamedTuple):
    """Parameters by part. ``total`` is every parameter; ``active`` those one token uses (MoE: top-k)."""

    preset: str
    embedding: int  # token embeddings and any learned position table
    attention: int  # every attention block (self and cross), biases and QK norms included
    ffn: int  # every feed-forward block (all experts)
    norms: int
    lm_head: int  # 0 when tied to the embedding
    total: int
    active: int
    residual: int = 0  # hyper-connections' mixing weights (DeepSeek-V4's mHC), 0 for the plain residual


def resolve_preset(preset_or_config: ModelPreset | str | os.PathLike | Mapping[str, Any], what: str) -> ModelPreset:
    """A :class:`ModelPreset` from itself, a :class:`qkv.config.DecoderConfig`, a preset name, a HF ``config.json``
    path or a parsed HF config dict."""
    if isinstance(preset_or_config, ModelPreset):
        return preset_or_config
    if isinstance(preset_or_config, DecoderConfig):
        return ModelPreset.from_config(preset_or_config)
    if isinstance(preset_or_config, (str, os.PathLike)):
        return get_preset(preset_or_config)
    if isinstance(preset_or_config, Mapping):
        return preset_from_hf_config(preset_or_config)
    raise TypeError(f"{what}: expected a ModelPreset, a preset name, a HF config.json path, a HF config dict or a "
                    f"qkv.config.DecoderConfig, got {type(preset_or_config).__name__}")


def decoder_side(preset: ModelPreset) -> DecoderConfig:
    """The one description of ``preset``'s decoder stack, whose mixers :mod:`qkv.config.mixers` counts
    (:attr:`ModelPreset.description`: its ``config``, refused where value heads are narrower without MLA)."""
    return preset.description


def _attention_layer(c: DecoderConfig) -> int:
    """The first layer of ``c`` that attends (its attention kind is every attending layer's)."""
    return next((i for i in range(c.num_hidden_layers) if not mixer_of(c, i).recurrent), 0)


def _cross(c: DecoderConfig) -> DecoderConfig:
    """The plain attention block of an encoder or a cross-attention: ``c``'s heads, no output gate, no sinks."""
    if c.latent is not None:
        raise ValueError(f"{c.name}: an encoder or cross-attention block of a latent-attention (MLA) model is not "
                         "counted; count such a model from its built parameters")
    return c.replace(attn_output_gate=False, attention_sinks=False, layer_types=None, sliding_window=None,
                     linear_attention=None)


def attention_weights(preset: ModelPreset, *, cross: bool = False) -> int:
    """Weights of one attention block's projection matrices (no biases, no norms): what a token multiplies
    by (the mixer registry's count, :mod:`qkv.config.mixers`). ``cross``: a plain MHA/GQA block (an encoder's or a
    cross-attention block), never MLA."""
    c = decoder_side(preset)
    if cross:
        return get_mixer("attention").weights(_cross(c))
    i = _attention_layer(c)
    return mixer_of(c, i).weights(c, i)


def recurrent_weights(preset: ModelPreset) -> int:
    """Projection weights of one recurrent (Gated DeltaNet, KDA) layer: what a token multiplies by."""
    c = decoder_side(preset)
    return get_mixer(_recurrent_kind(c)).weights(c)


def layer_recurrent_params(preset: ModelPreset) -> int:
    """Parameters of one recurrent (Gated DeltaNet, KDA) layer: :func:`recurrent_weights`, the convolution, the
    decay parameters and the gated norm."""
    c = decoder_side(preset)
    return get_mixer(_recurrent_kind(c)).params(c)


def _recurrent_kind(c: DecoderConfig) -> str:
    if c.linear_attention is None:
        raise ValueError(f"{c.name}: has no recurrent (linear_attention) layers")
    return c.linear_attention.mixer


def _mixer_params(preset: ModelPreset) -> int:
    """Every layer's token mixer: attention blocks and recurrent layers, each as its kind counts itself."""
    c = decoder_side(preset)
    return sum(mixer_of(c, i).params(c, i) for i in range(c.num_hidden_layers))


def layer_attention_params(preset: ModelPreset, *, cross: bool = False) -> int:
    """Parameters of one attention block: :func:`attention_weights` plus biases and norms."""
    c = decoder_side(preset)
    if cross:
        return get_mixer("attention").params(_cross(c))
    i = _attention_layer(c)
    return mixer_of(c, i).params(c, i)


def _mlp(c: DecoderConfig, width: int, *, bias: bool) -> int:
    d = c.hidden_size
    if c.gated_mlp:
        return 3 * d * width + (2 * width + d if bias else 0)
    return 2 * d * width + (width + d if bias else 0)


def layer_ffn_params(preset: ModelPreset, layer_idx: int, *, bias: bool = True) -> tuple[int, int]:
    """``(total, active)`` parameters of decoder layer ``layer_idx``'s feed-forward block (``bias=False``:
    the weight matrices only, what a token multiplies by)."""
    c, m = preset.config, preset.config.moe
    b = bias and c.mlp_bias
    if m is None or not m.is_moe(layer_idx):
        n = _mlp(c, c.intermediate_size_for(layer_idx), bias=b)
        return n, n
    expert = _mlp(c, m.moe_intermediate_size, bias=b)
    width = m.shared_expert_intermediate_size or m.moe_intermediate_size * m.n_shared_experts
    shared = _mlp(c, width, bias=b) + (c.hidden_size if m.shared_expert_gate else 0) if m.n_shared_experts else 0
    router = (c.hidden_size + (1 if m.router_bias else 0)) * m.n_routed_experts
    if m.beside_dense:  # Gemma 4: the dense MLP runs beside the experts; the router and per-expert scales, 3 norms
        shared = _mlp(c, c.intermediate_size_for(layer_idx), bias=b)
        if bias:
            shared += (c.hidden_size + m.n_routed_experts) + 3 * c.hidden_size
    return router + m.n_routed_experts * expert + shared, router + m.num_experts_per_tok * expert + shared


def num_parameters(preset: ModelPreset | str | os.PathLike | Mapping[str, Any]) -> ParamCount:
    """Parameter count of the whole model ``preset`` describes (see the module docstring for the layout).

    Args:
        preset: a :class:`qkv.costs.ModelPreset` of a whole model (its ``config`` states ``vocab_size`` and
            ``intermediate_size``), e.g. ``PRESETS["llama-2-70b"]``; or a :class:`qkv.config.DecoderConfig`, a preset
            name (``"llama-2-70b"``), a HF ``config.json`` path or a parsed HF config dict.

    Returns:
        A :class:`ParamCount`.

    Raises:
        ValueError: the preset describes attention only.

    Example:
        >>> from qkv.costs import PRESETS
        >>> c = num_parameters(PRESETS["llama-2-70b"])
        >>> c.total, c.lm_head == c.embedding
        (68976648192, True)
    """
    preset = resolve_preset(preset, "num_parameters")
    require_whole_model(preset, "num_parameters")
    p, c = preset, preset.config
    d, n_layers, enc = c.hidden_size, c.num_hidden_layers, preset.encoder_layers
    norm = d if c.norm == "rms" else 2 * d
    positions = c.max_position_embeddings if c.position == "learned" else 0  # a learned table's rows
    embedding = c.vocab_size * d + positions * d + _per_layer_input_params(c)
    lm_head = 0 if c.tie_word_embeddings else c.vocab_size * d
    attention = _mixer_params(p)
    ffn = active_ffn = 0
    for i in range(n_layers):
        total_i, active_i = layer_ffn_params(p, i)
        ffn += total_i
        active_ffn += active_i
    per_layer = [2 * sum(c.layer_norms(i)) for i in range(n_layers)]  # OLMo 2/3: the two post-norms only
    norms = sum(per_layer) * norm + norm
    if enc:  # bidirectional encoder layers, and a cross-attention block per decoder layer
        plain = layer_attention_params(p, cross=True)
        attention += (enc + n_layers) * plain
        ffn += enc * _mlp(c, c.intermediate_size, bias=c.mlp_bias)
        active_ffn += enc * _mlp(c, c.intermediate_size, bias=c.mlp_bias)
        norms += enc * 2 * norm + norm + n_layers * norm  # encoder final, cross norms
    residual = _hyper_params(c)
    total = embedding + attention + ffn + norms + lm_head + residual
    return ParamCount(p.name, embedding, attention, ffn, norms, lm_head, total, total - ffn + active_ffn, residual)


def _per_layer_input_params(c: DecoderConfig) -> int:
    """Gemma 4's per-layer inputs (module docstring), counted with the embeddings; 0 without them."""
    if not c.per_layer_input_size:
        return 0
    d, n, P = c.hidden_size, c.num_hidden_layers, c.per_layer_input_size
    return (c.per_layer_vocab_size or c.vocab_size) * n * P + d * n * P + P + n * (2 * d * P + d)


def _hyper_params(c: DecoderConfig) -> int:
    """mHC's weights (module docstring); 0 without hyper-connections."""
    if c.hyper is None:
        return 0
    n, d = c.hyper.hc_mult, c.hidden_size
    mix = n * n + 2 * n
    return c.num_hidden_layers * 2 * (n * d * mix + mix + 3) + n * d * n + n + 1

