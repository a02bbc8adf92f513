"""Gemma 4 (text) on qkv: HF ``model_type`` ``"gemma4_text"``, and the language model of the multimodal ``"gemma4"``
(its vision and audio towers are dropped).

Gemma Team 2026, Gemma 4 model card (google/gemma-4-*); the lineage of Gemma 3 (arXiv:2503.19786) and Gemma 3n.
A :class:`qkv.nn.DecoderLM` with these switches on:

- Gemma 3's block: sandwich norms, per-head QK RMSNorm, GeGLU with tanh GELU, embeddings times ``sqrt(d)``, a tied
  head by default; but RMSNorm weights multiply directly (stored around 1, not ``1 + w``), scores are not scaled
  (the QK norms set their size: ``attention_scale = 1``) and each value head is RMS-normalized without a scale;
- local (sliding-window) and global layers, 5:1 by default, the last layer always global; global layers have
  their own head width (``global_head_dim``) and, with ``attention_k_eq_v``, their own KV heads
  (``num_global_key_value_heads``) and no value projection: the key projection before its norm and rotation gives
  the values (K = V);
- RoPE per layer type: plain on local layers, *proportional* on global ones (a quarter of the head's frequency
  pairs turn, with the frequencies of the whole head: :func:`qkv.pos.proportional_inv_freq`);
- cross-layer KV sharing: the last ``num_kv_shared_layers`` layers read the keys and values of the last earlier
  layer of their type and cache nothing (:class:`qkv.cache.SharedSpec`); with ``use_double_wide_mlp`` their
  feed-forward is twice as wide;
- per-layer input embeddings (``hidden_size_per_layer_input``, :mod:`qkv.nn.per_layer_embed`), a stored scalar
  per layer (``layer_scalar``) and optional final logit soft-capping.

- the optional MoE block (``enable_moe_block``, 26B-A4B): ``num_experts`` routed experts of
  ``moe_intermediate_size``, ``top_k_experts`` per token, beside the dense MLP on every layer
  (:class:`qkv.nn.parallel_moe.ParallelMoE`).

Tensor names: the Gemma 2/3 norms (:mod:`qkv.models.family_gemma`); the q/k/v projections a layer has stacked into
``qkv_proj``; ``embed_tokens_per_layer``, ``per_layer_model_projection``, ``per_layer_projection_norm`` ->
``embed_per_layer.{embed, projection, norm}``; per layer ``per_layer_input_gate``, ``per_layer_projection``,
``post_per_layer_input_norm`` -> ``per_layer_input.{gate, up, norm}``; with the MoE block, per layer ``mlp.*`` ->
``mlp.mlp.*``, ``router.{proj, scale, per_expert_scale}`` -> ``mlp.{router, router_scale, per_expert_scale}``,
``experts.*`` -> ``mlp.experts.*``, ``post_feedforward_layernorm_1``, ``pre_feedforward_layernorm_2``,
``post_feedforward_layernorm_2`` -> ``mlp.{dense_out_norm, experts_norm, experts_out_norm}``.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(  # doctest: +SKIP
    ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    ...     num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, num_kv_shared_layers=2,
    ...     hidden_size_per_layer_input=8, vocab_size_per_layer_input=128))
    >>> model = from_hf(hf)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.hf_config import hf_defaults, read_moe, text_config
from ..config.moe import MoEConfig
from ..nn import DecoderConfig, DecoderLM
from .hf import ATTN_STACK, MLP_STACK, read_checkpoint_layout, rename_decoder, stack_tensors
from .hf import decoder_config as decoder_config_from
from .loading import FAMILIES, CheckpointError

__all__ = ["build", "convert", "decoder_config"]

FAMILIES["gemma4_text"] = "qkv.models.family_gemma4"
FAMILIES["gemma4"] = "qkv.models.family_gemma4"

_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_out_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "ffn_out_norm"}
_PER_LAYER = {"per_layer_input_gate": "per_layer_input.gate", "per_layer_projection": "per_layer_input.up",
              "post_per_layer_input_norm": "per_layer_input.norm"}
_PLE = {"embed_tokens_per_layer": "embed_per_layer.embed", "per_layer_model_projection": "embed_per_layer.projection",
        "per_layer_projection_norm": "embed_per_layer.norm"}
_TOWERS = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
_MOE = {"router.proj.weight": "mlp.router.weight", "router.scale": "mlp.router_scale",
        "router.per_expert_scale": "mlp.per_expert_scale", "experts.gate_up_proj": "mlp.experts.gate_up_proj",
        "experts.down_proj": "mlp.experts.down_proj",
        "post_feedforward_layernorm_1.weight": "mlp.dense_out_norm.weight",
        "pre_feedforward_layernorm_2.weight": "mlp.experts_norm.weight",
        "post_feedforward_layernorm_2.weight": "mlp.experts_out_norm.weight"}


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    model_type = cfg.get("model_type")
    if model_type not in ("gemma4", "gemma4_text"):
        raise CheckpointError(f"family_gemma4: model_type {model_type!r} is not gemma4 or gemma4_text")
    return hf_defaults({k: v for k, v in text_config(cfg).items() if v is not None or k.endswith("softcapping")})


def decoder_config(cfg: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` of an HF Gemma 4 config dict (``gemma4_text``, or ``gemma4``'s text part)."""
    cfg = _text(cfg)
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"from_hf: gemma4 with use_bidirectional_attention={cfg['use_bidirectional_attention']!r}"
                              " is not supported; qkv builds the causal decoder")
    moe = _moe(cfg)
    layout = read_checkpoint_layout(cfg)
    n, bias = cfg["num_hidden_layers"], bool(cfg.get("attention_bias", False))
    widths = None
    if cfg.get("use_double_wide_mlp") and layout.kv_shared_from is not None:
        widths = tuple(cfg["intermediate_size"] * (2 if layout.kv_source(i) is not None else 1) for i in range(n))
    ple = cfg.get("hidden_size_per_layer_input") or None
    return decoder_config_from(
        {**cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}, partial_rotary=True,
        hidden_act=cfg.get("hidden_activation") or "gelu_pytorch_tanh", norm_offset=0.0, scale_embeddings=True,
        sandwich_norms=True, qkv_bias=bias, o_bias=bias, qk_norm=True, attention_scale=1.0, value_norm=True,
        head_dim_by_type=layout.head_dim_by_type, kv_heads_by_type=layout.kv_heads_by_type,
        k_eq_v_types=layout.k_eq_v_types, kv_shared_from=layout.kv_shared_from, layer_scalars=True,
        per_layer_input_size=ple, per_layer_vocab_size=cfg.get("vocab_size_per_layer_input") if ple else None,
        intermediate_sizes=widths, final_logit_softcapping=cfg.get("final_logit_softcapping"), moe=moe)


def _moe(cfg: dict[str, Any]) -> MoEConfig | None:
    """The 26B-A4B block's experts (beside the dense MLP on every layer), or None without ``enable_moe_block``."""
    try:
        return read_moe(cfg)
    except ValueError as e:
        raise CheckpointError(f"from_hf: {e}") from e


def build(config: dict[str, Any]) -> DecoderLM:
    return DecoderLM(decoder_config(config))


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    c = decoder_config(config)
    src: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("model.language_model."):  # the multimodal model's language part
            name = "model." + name.removeprefix("model.language_model.")
        elif name.removeprefix("model.").startswith(_TOWERS):
            continue
        src[name] = t
    for i in range(c.num_hidden_layers):  # stack the projections a layer has (K = V: no v_proj; shared: q_proj only)
        att = f"model.layers.{i}.self_attn."
        parts = ATTN_STACK[:1 + (c.kv_source(i) is None) + (c.kv_source(i) is None and not c.k_eq_v_for(i))]
        for suffix in (".weight", ".bias"):
            names = [f"{att}{p}{suffix}" for p in parts]
            if all(x in src for x in names):
                src[f"{att}qkv_proj{suffix}"] = torch.cat([src.pop(x) for x in names])
        for hf, ours in _PER_LAYER.items():
            key = f"model.layers.{i}.{hf}.weight"
            if key in src:
                src[f"model.layers.{i}.{ours}.weight"] = src.pop(key)
        if c.moe is not None:  # the dense MLP moves under mlp.mlp, the router, experts and their norms under mlp
            layer = f"model.layers.{i}."
            gate_up = stack_tensors(src, f"{layer}mlp.", MLP_STACK, ".weight")
            if gate_up is not None:
                src[f"{layer}mlp.mlp.gate_up_proj.weight"] = gate_up
            if f"{layer}mlp.down_proj.weight" in src:
                src[f"{layer}mlp.mlp.down_proj.weight"] = src.pop(f"{layer}mlp.down_proj.weight")
            for hf, ours in _MOE.items():
                if layer + hf in src:
                    src[layer + ours] = src.pop(layer + hf)
    for hf, ours in _PLE.items():
        if f"model.{hf}.weight" in src:
            src[f"{ours}.weight"] = src.pop(f"model.{hf}.weight")
    return rename_decoder(src, c, norms=_NORMS)
