"""Reading HF decoder checkpoints: the config fields every decoder family shares, RoPE parameters, and HF
tensor names to :class:`qkv.nn.DecoderLM` names. Public within :mod:`qkv.models`; each family file
(``family_*.py``) adds its own switches on top.

Example:
    >>> from qkv.models.hf import decoder_config
    >>> cfg = decoder_config({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    ...                       "num_hidden_layers": 2, "num_attention_heads": 4, "rope_theta": 5e5,
    ...                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    >>> cfg.rope_for("full_attention").scaling
    mappingproxy({'rope_type': 'linear', 'factor': 2.0})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..config.decoder import DecoderConfig, RopeParams
from ..config.hf_config import read_layout
from .loading import CheckpointError

__all__ = ["rope_params", "read_checkpoint_layout", "decoder_config", "rename_decoder", "rename_router_bias",
           "stack_tensors", "ATTN_STACK", "MLP_STACK"]

ATTN_STACK = ("q_proj", "k_proj", "v_proj")
MLP_STACK = ("gate_proj", "up_proj")


def rope_params(rope: RopeParams, *, interleaved: bool = False, partial: bool = False) -> RopeParams:
    """A layer type's RoPE as :func:`qkv.config.hf_config.read_layout` reads it, with the family's channel pairing;
    ``CheckpointError`` for a partial rotation unless the family rotates the first channels only (``partial``:
    Qwen3-Next and Qwen3.5 rotate a quarter of each head)."""
    if rope.partial_rotary_factor != 1.0 and not partial:
        raise CheckpointError(f"from_hf: partial_rotary_factor={rope.partial_rotary_factor} (!= 1) is not supported "
                              "for this family")
    return dataclasses.replace(rope, scaling=dict(rope.scaling) if rope.scaling else None, interleaved=interleaved)


def read_checkpoint_layout(cfg: Mapping[str, Any]) -> DecoderConfig:
    """:func:`qkv.config.hf_config.read_layout`, its errors raised as :class:`CheckpointError`."""
    try:
        return read_layout(cfg)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot read the {cfg.get('model_type')} config's layout: {e}") from e


def decoder_config(cfg: Mapping[str, Any], *, interleaved_rope: bool = False, partial_rotary: bool = False,
                   **family: Any) -> DecoderConfig:
    """A :class:`qkv.nn.DecoderConfig` from the fields every HF decoder config shares, the layout
    (:func:`qkv.config.hf_config.read_layout`: layer types, window, RoPE per layer type, head width, the recurrent
    layers' mixer) and a family's switches (``family`` overrides; ``partial_rotary``: the family rotates
    ``partial_rotary_factor`` of each head); ``CheckpointError`` naming what is missing or wrong."""
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if cfg.get(k) is None]
    if missing:
        raise CheckpointError(f"from_hf: the {cfg.get('model_type')} config lacks {missing}")
    layout = read_checkpoint_layout(cfg)
    common = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"], intermediate_size=cfg["intermediate_size"],
        num_key_value_heads=cfg.get("num_key_value_heads"),
        head_dim=None if layout.latent is not None else layout.head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        layer_types=layout.layer_types, sliding_window=layout.sliding_window,
        rope={kind: rope_params(r, interleaved=interleaved_rope, partial=partial_rotary)
              for kind, r in layout.rope.items()}, nope_layers=layout.nope_layers,
        linear_attention=layout.linear_attention,
        name=str(cfg.get("model_type") or ""))
    common.update(family)
    try:
        return DecoderConfig(**common)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"from_hf: cannot build a {cfg.get('model_type')} model from its config: {e}") from e


def stack_tensors(state: dict[str, torch.Tensor], prefix: str, parts: tuple[str, ...], suffix: str,
                  dim: int = 0) -> torch.Tensor | None:
    """Pop ``prefix + part + suffix`` for every part and concatenate them; None when none is there;
    ``CheckpointError`` naming the absent ones when only some are."""
    names = [f"{prefix}{p}{suffix}" for p in parts]
    have = [n for n in names if n in state]
    if not have:
        return None
    if len(have) != len(names):
        absent = [n for n in names if n not in state]
        raise CheckpointError(f"from_hf: the checkpoint has {have} but lacks {absent}")
    return torch.cat([state.pop(n) for n in names], dim=dim)


def rename_decoder(state: Mapping[str, torch.Tensor], config: DecoderConfig, *,
                   norms: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """HF decoder tensor names (Llama style) to :class:`qkv.nn.DecoderLM` names.

    Args:
        state: the HF state dict (``model.`` prefix optional; ``lm_head.weight`` dropped when tied).
        config: the model's config (tied head, MLA, MoE).
        norms: HF layer-norm names to ours (``attn_norm``, ``attn_out_norm``, ``ffn_norm``, ``ffn_out_norm``).

    GQA layers stack ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``; MLA layers keep HF's names
    (:class:`qkv.nn.LatentAttention` uses them); gated MLPs stack ``gate_proj``/``up_proj``. Anything left
    keeps its name, so the loader reports it as unexpected.
    """
    src: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("rotary_emb.inv_freq") or name.endswith("original_inv_freq"):
            continue  # buffers qkv recomputes
        src[name.removeprefix("model.")] = t
    if config.tie_word_embeddings:
        src.pop("lm_head.weight", None)
    out: dict[str, torch.Tensor] = {}
    for key in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
        if key in src:
            out[key] = src.pop(key)
    for i in range(config.num_hidden_layers):
        layer = f"layers.{i}."
        for a, b in norms.items():
            if f"{layer}{a}.weight" in src:
                out[f"{layer}{b}.weight"] = src.pop(f"{layer}{a}.weight")
        att = f"{layer}self_attn."
        if config.latent is None:
            for suffix in (".weight", ".bias"):
                t = stack_tensors(src, att, ATTN_STACK, suffix)
                if t is not None:
                    out[f"{att}qkv_proj{suffix}"] = t
        for rest in [n for n in src if n.startswith(att)]:
            out[rest] = src.pop(rest)
        mlp = f"{layer}mlp."
        if config.moe is not None and config.moe.is_moe(i):
            _rename_moe(src, out, mlp, config.moe.n_routed_experts, config.moe.n_shared_experts)
        else:
            for suffix in (".weight", ".bias"):
                t = stack_tensors(src, mlp, MLP_STACK, suffix)
                if t is not None:
                    out[f"{mlp}gate_up_proj{suffix}"] = t
        for rest in [n for n in src if n.startswith(mlp)]:
            out[rest] = src.pop(rest)
    out.update(src)
    return out


def rename_router_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3-style routing (DeepSeek-V3, Kimi Linear): HF keeps the correction bias on the router,
    ``mlp.gate.e_score_correction_bias``; :class:`qkv.nn.MoE` on itself, ``mlp.e_score_correction_bias``. Renames in
    place and returns ``state``."""
    for name in [n for n in state if n.endswith(".mlp.gate.e_score_correction_bias")]:
        state[name.replace(".gate.", ".")] = state.pop(name)
    return state


def _rename_moe(src: dict[str, torch.Tensor], out: dict[str, torch.Tensor], mlp: str, n: int,
                n_shared: int) -> None:
    """DeepSeek MoE: router ``gate.weight``; experts either stacked (transformers 5 in memory:
    ``experts.gate_up_proj`` (E, 2f, d), ``experts.down_proj`` (E, d, f)) or one module per expert (files on
    disk: ``experts.{e}.gate_proj.weight``, ...); shared experts' gate/up stacked like a dense MLP. With
    ``n_shared`` 0, HF still builds shared experts of width 0 (they add zero): their empty tensors are dropped."""
    if not n_shared:
        for name in [k for k in src if k.startswith(f"{mlp}shared_experts.") and src[k].numel() == 0]:
            del src[name]
    if f"{mlp}gate.weight" in src:
        out[f"{mlp}router.weight"] = src.pop(f"{mlp}gate.weight")
    for name in ("gate_up_proj", "down_proj"):
        if f"{mlp}experts.{name}" in src:
            out[f"{mlp}experts.{name}"] = src.pop(f"{mlp}experts.{name}")
    if f"{mlp}experts.0.gate_proj.weight" in src or f"{mlp}experts.0.down_proj.weight" in src:
        gate_up, down = [], []
        for e in range(n):
            gu = stack_tensors(src, f"{mlp}experts.{e}.", MLP_STACK, ".weight")
            d = src.pop(f"{mlp}experts.{e}.down_proj.weight", None)
            if gu is None or d is None:
                raise CheckpointError(f"from_hf: the checkpoint lacks expert {e} of {n} ({mlp}experts.{e}.*)")
            gate_up.append(gu)
            down.append(d)
        out[f"{mlp}experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{mlp}experts.down_proj"] = torch.stack(down)
    t = stack_tensors(src, f"{mlp}shared_experts.", MLP_STACK, ".weight")
    if t is not None:
        out[f"{mlp}shared_experts.gate_up_proj.weight"] = t
