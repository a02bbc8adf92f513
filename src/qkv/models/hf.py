"""Reading HF decoder checkpoints: the config fields every decoder family shares, RoPE parameters, and HF
tensor names to :class:`qkv.nn.DecoderLM` names. Public within :mod:`qkv.models`; each family file
(``family_*.py``) adds its own switches on top.

Example:
    >>> from qkv.models.hf import rope_params
    >>> rope_params({"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}).scaling
    {'rope_type': 'linear', 'factor': 2.0}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..nn.config import FULL_ATTENTION, SLIDING_ATTENTION, DecoderConfig, RopeParams
from .loading import CheckpointError

__all__ = ["rope_params", "decoder_config", "rename_decoder", "stack_tensors", "ATTN_STACK", "MLP_STACK"]

ATTN_STACK = ("q_proj", "k_proj", "v_proj")
MLP_STACK = ("gate_proj", "up_proj")


def rope_params(cfg: Mapping[str, Any], layer_type: str | None = None, *, theta_key: str = "rope_theta",
                interleaved: bool = False) -> RopeParams:
    """RoPE of ``layer_type`` from an HF config dict, old style (``rope_theta`` + ``rope_scaling``) or
    transformers 5 style (``rope_parameters``, per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, Mapping) and set(params) & {FULL_ATTENTION, SLIDING_ATTENTION}:
        params = params.get(FULL_ATTENTION)
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        if theta_key in cfg:
            params.setdefault("rope_theta", cfg[theta_key])
    params = dict(params or {})
    if float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise CheckpointError("from_hf: partial_rotary_factor != 1 is not supported for this family")
    theta = float(params.pop("rope_theta", cfg.get(theta_key) or 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return RopeParams(theta=theta, scaling=None if kind == "default" else params, interleaved=interleaved)


def decoder_config(cfg: Mapping[str, Any], **family: Any) -> DecoderConfig:
    """A :class:`qkv.nn.DecoderConfig` from the fields every HF decoder config shares, plus a family's
    switches (``family`` overrides); ``CheckpointError`` naming what is missing or wrong."""
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if cfg.get(k) is None]
    if missing:
        raise CheckpointError(f"from_hf: the {cfg.get('model_type')} config lacks {missing}")
    common = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"], intermediate_size=cfg["intermediate_size"],
        num_key_value_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
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
            _rename_moe(src, out, mlp, config.moe.n_routed_experts)
        else:
            for suffix in (".weight", ".bias"):
                t = stack_tensors(src, mlp, MLP_STACK, suffix)
                if t is not None:
                    out[f"{mlp}gate_up_proj{suffix}"] = t
        for rest in [n for n in src if n.startswith(mlp)]:
            out[rest] = src.pop(rest)
    out.update(src)
    return out


def _rename_moe(src: dict[str, torch.Tensor], out: dict[str, torch.Tensor], mlp: str, n: int) -> None:
    """DeepSeek MoE: router ``gate.weight``; experts either stacked (transformers 5 in memory:
    ``experts.gate_up_proj`` (E, 2f, d), ``experts.down_proj`` (E, d, f)) or one module per expert (files on
    disk: ``experts.{e}.gate_proj.weight``, ...); shared experts' gate/up stacked like a dense MLP."""
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
