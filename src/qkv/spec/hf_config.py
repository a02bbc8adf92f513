"""The one reader of an HF config's attention layout: which layers slide, over how many tokens, with which
RoPE, and the head and latent widths the KV cache holds. Pure Python (no torch); used alike by
:mod:`qkv.costs` (``preset_from_hf_config``, ``qkv memory``), :func:`qkv.cache.plan_memory` and the model
families of :mod:`qkv.models`, so the bytes planned are the bytes the built model caches.

A ``config.json`` often leaves keys out, and then HF's config class supplies them: a published Qwen2
checkpoint has no ``layer_types``, so HF derives them from ``use_sliding_window`` (default false) and
``max_window_layers`` (default 28); a Gemma 2 one has no ``head_dim`` (default 256). :func:`read_layout`
applies the same defaults and rules per ``model_type`` (``HF_DEFAULTS``), so its ``layer_types`` equal what
``transformers`` computes (its ``config.layer_types``) for dicts with or without them:

- ``layer_types`` given: used as is (the window only matters where a layer slides);
- Qwen2 / Qwen3: the window only when ``use_sliding_window``; then layers ``i >= max_window_layers`` slide;
- Gemma 2: local and global layers alternate, layer 0 local; Gemma 3: ``sliding_window_pattern - 1``
  local layers per global one (layer ``i`` global iff ``(i + 1) % pattern == 0``);
- Llama, DeepSeek, GPT-2, BLOOM: no layer slides;
- other families (Mistral, Mixtral, ...): every layer slides when ``sliding_window`` is set, else none;
  a ``sliding_window_pattern`` key, where present, interleaves as Gemma 3 does.

Multimodal configs are read from ``text_config``. RoPE per layer type: transformers 5's ``rope_parameters``
(per layer type for Gemma 3), or ``rope_theta`` with ``rope_scaling``; Gemma 3's older configs give local
layers ``rope_local_base_freq`` without scaling.

Example:
    >>> cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64,
    ...        "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}
    >>> read_layout(cfg).layer_types
    ('full_attention', 'full_attention', 'sliding_attention', 'sliding_attention')
    >>> read_layout({**cfg, "use_sliding_window": False}).sliding_window is None
    True
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config_file import read_json_config

__all__ = ["Layout", "RopeLayout", "read_layout", "load_hf_config", "text_config", "hf_defaults", "HF_DEFAULTS",
           "FULL_ATTENTION", "SLIDING_ATTENTION"]

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"

#: HF config defaults (``transformers``' config classes) for the keys a ``config.json`` may leave out.
HF_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen2": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rope_theta": 10000.0},
    "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6},
}
_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size",
            "n_embed": "hidden_size"}
_PERIOD = {"gemma2": 2}  # local:global interleave fixed by the modelling code
_NO_WINDOW = frozenset({"llama", "deepseek_v2", "deepseek_v3", "gpt2", "bloom"})  # families that never slide


def load_hf_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A config dict from a mapping, a ``config.json`` path or a directory holding one."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"HF config: expected a dict, a config.json path or a checkpoint directory, got "
                        f"{type(config).__name__}")
    path = os.path.join(config, "config.json") if os.path.isdir(config) else os.fspath(config)
    return read_json_config(path)


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: ``text_config`` for multimodal ones (Gemma 3), with HF's
    short names (``n_layer``, ``n_head``, ``n_embd``) under their long ones. ``model_type`` ``gemma3``
    (multimodal) reads as ``gemma3_text``."""
    cfg = config
    if "num_hidden_layers" not in config and "n_layer" not in config and isinstance(config.get("text_config"),
                                                                                   Mapping):
        cfg = {"model_type": config.get("model_type"), **config["text_config"]}
    out = {_ALIASES.get(k, k): v for k, v in cfg.items()}
    for long in _ALIASES.values():  # the long name wins where both are present
        if long in cfg:
            out[long] = cfg[long]
    if out.get("model_type") == "gemma3":
        out["model_type"] = "gemma3_text"
    return out


def hf_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with HF's defaults (``HF_DEFAULTS`` of its ``model_type``) filled in for absent keys."""
    return {**HF_DEFAULTS.get(config.get("model_type") or "", {}), **config}


@dataclass(frozen=True)
class RopeLayout:
    """RoPE of one layer type: ``theta``; ``scaling`` HF's dict with ``rope_type`` (None: plain RoPE);
    ``partial_rotary_factor`` the rotated fraction of each head."""

    theta: float = 10000.0
    scaling: Mapping[str, Any] | None = None
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The attention layout of a decoder config (HF field names)."""

    model_type: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None  # tokens a local layer sees, the token itself included; None: no local layer
    rope: Mapping[str, RopeLayout] = field(default_factory=dict)  # full_attention and each layer type present
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None

    def window_for(self, layer_idx: int) -> int | None:
        """Tokens layer ``layer_idx`` sees (None: every earlier token)."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None


def _int(cfg: Mapping[str, Any], key: str, source: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{source}: {key} must be a positive int, got {v!r}")
    return v


def _layer_types(cfg: Mapping[str, Any], n: int, source: str) -> tuple[tuple[str, ...], int | None]:
    model_type = cfg.get("model_type") or ""
    window = cfg.get("sliding_window")
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"] or model_type in _NO_WINDOW:
        window = None
    given = cfg.get("layer_types")
    if given is not None:
        types = tuple(given)
        unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(f"{source}: layer types {unknown} not supported; known {FULL_ATTENTION!r}, "
                             f"{SLIDING_ATTENTION!r}")
        if len(types) != n:
            raise ValueError(f"{source}: layer_types has {len(types)} entries for {n} layers")
    elif window is None:
        types = (FULL_ATTENTION,) * n
    elif "max_window_layers" in cfg:  # Qwen2/Qwen3: the first max_window_layers layers stay global
        first = cfg["max_window_layers"]
        types = tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n))
    else:
        period = _PERIOD.get(model_type) or cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        types = (tuple(FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION for i in range(n)) if period
                 else (SLIDING_ATTENTION,) * n)
    if SLIDING_ATTENTION not in types:
        return types, None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"{source}: sliding layers need a positive sliding_window, got {window!r}")
    return types, window


def _rope_entry(params: Mapping[str, Any] | None, cfg: Mapping[str, Any]) -> RopeLayout:
    params = dict(params or {})
    factor = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    return RopeLayout(theta=theta, scaling=None if kind == "default" else params, partial_rotary_factor=factor)


def _ropes(cfg: Mapping[str, Any], types: tuple[str, ...]) -> dict[str, RopeLayout]:
    params = cfg.get("rope_parameters")
    out = {}
    for kind in dict.fromkeys((FULL_ATTENTION, *types)):
        if isinstance(params, Mapping) and set(params) & {FULL_ATTENTION, SLIDING_ATTENTION}:
            entry = params.get(kind) or params.get(FULL_ATTENTION)
            out[kind] = _rope_entry(entry, cfg)
        elif params is not None:
            out[kind] = _rope_entry(params, cfg)
        elif kind == SLIDING_ATTENTION and cfg.get("rope_local_base_freq") is not None:  # Gemma 3 before v5
            out[kind] = RopeLayout(theta=float(cfg["rope_local_base_freq"]))
        else:
            out[kind] = _rope_entry(cfg.get("rope_scaling"), cfg)
    return out


def read_layout(config: str | os.PathLike | Mapping[str, Any]) -> Layout:
    """The attention layout of an HF decoder config: a ``config.json`` dict (``transformers``'
    ``config.to_dict()`` works too), its path, or a checkpoint directory.

    Missing ``num_key_value_heads`` means MHA; missing ``head_dim`` means HF's default for the family, else
    ``hidden_size // num_attention_heads`` (``qk_nope_head_dim + qk_rope_head_dim`` for MLA). See the module
    notes for the layer types.

    Raises:
        ValueError: a required field is missing or malformed, naming it.
    """
    raw = load_hf_config(config)
    cfg = hf_defaults(text_config(raw))
    source = f"read_layout({cfg.get('model_type') or 'no model_type'})"
    mla = cfg.get("kv_lora_rank") is not None
    required = ("num_hidden_layers", "num_attention_heads") + (("qk_rope_head_dim", "qk_nope_head_dim") if mla else ())
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}")
    n = _int(cfg, "num_hidden_layers", source)
    heads = _int(cfg, "num_attention_heads", source)
    if mla:
        head_dim = _int(cfg, "qk_nope_head_dim", source) + _int(cfg, "qk_rope_head_dim", source)
    elif cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim", source)
    elif cfg.get("hidden_size") is not None:
        head_dim = _int(cfg, "hidden_size", source) // heads
    else:
        raise ValueError(f"{source}: needs head_dim or hidden_size")
    types, window = _layer_types(cfg, n, source)
    return Layout(
        model_type=cfg.get("model_type") or "",
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        hidden_size=cfg.get("hidden_size"),
        layer_types=types,
        sliding_window=window,
        rope=_ropes(cfg, types),
        kv_lora_rank=cfg.get("kv_lora_rank") if mla else None,
        qk_rope_head_dim=cfg.get("qk_rope_head_dim") if mla else None,
        qk_nope_head_dim=cfg.get("qk_nope_head_dim") if mla else None,
        v_head_dim=cfg.get("v_head_dim") if mla else cfg.get("v_head_dim"),
    )
