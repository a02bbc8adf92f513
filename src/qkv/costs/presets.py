"""Attention shapes of published models: one registry read by the CLI, the benchmarks and the tests.

Field names follow HF ``transformers`` configs. ``layer_types`` uses HF's values, ``"full_attention"``
(global) and ``"sliding_attention"`` (local, at most ``sliding_window`` tokens visible and cached,
HF's convention: the window counts the token itself). Every number is cited in the preset's ``source``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .config_file import check_layout_fields, read_json_config

__all__ = ["PRESETS", "ModelPreset", "get_preset", "preset_from_hf_config"]

FULL, SLIDING = "full_attention", "sliding_attention"
_LAYER_KIND = {FULL: "global", SLIDING: "local"}


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """The attention shape of a model: everything the KV-cache and attention-FLOP arithmetic needs.

    Args:
        name: lowercase-hyphen slug (``"llama-3-70b"``).
        num_hidden_layers: attention layers.
        num_attention_heads: query heads ``Hq``.
        num_key_value_heads: key/value heads ``Hkv`` (``= Hq`` MHA, ``1`` MQA, else GQA). For MLA, the
            heads the latent expands to (``= Hq`` in DeepSeek-V2).
        head_dim: query/key head width ``Dqk``; for MLA ``qk_nope_head_dim + qk_rope_head_dim``.
        hidden_size: model width (informational; not always ``Hq * head_dim``, e.g. Gemma).
        sliding_window: tokens a local layer sees and caches, the token itself included.
        layer_types: one HF layer type per layer. ``None`` means every layer is local when
            ``sliding_window`` is set (Mistral 7B v0.1) and global otherwise; resolved at construction.
        kv_lora_rank: MLA latent width ``d_c``; setting it makes the preset MLA.
        qk_rope_head_dim: MLA decoupled RoPE key width ``d_h^R``, cached once per token (shared by heads).
        qk_nope_head_dim: MLA per-head key width without RoPE.
        v_head_dim: value head width ``Dv`` when it differs from ``head_dim``.
        source: citation for the numbers (paper, model card, config).
        notes: caveats.

    Example:
        >>> p = PRESETS["gemma-3-27b"]
        >>> p.attention_kind, p.layer_counts
        ('gqa', {'global': 10, 'local': 52})
    """

    name: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    source: str = ""
    notes: str = ""

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {field} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.name}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", (SLIDING if self.sliding_window else FULL,) * n)
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != n or not set(types) <= {FULL, SLIDING}:
            raise ValueError(
                f"{self.name}: layer_types must hold {n} entries from {FULL!r}, {SLIDING!r}; got "
                f"{len(types)} entries {sorted(set(types))}"
            )
        if SLIDING in types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"{self.name}: sliding layers need a positive sliding_window")
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(f"{self.name}: MLA needs both kv_lora_rank and qk_rope_head_dim")

    @property
    def attention_kind(self) -> str:
        """``"mla"``, ``"mha"``, ``"mqa"`` or ``"gqa"``."""
        if self.kv_lora_rank is not None:
            return "mla"
        if self.num_key_value_heads == self.num_attention_heads:
            return "mha"
        return "mqa" if self.num_key_value_heads == 1 else "gqa"

    @property
    def value_head_dim(self) -> int:
        """``Dv``: ``v_head_dim`` if set, else ``head_dim``."""
        return self.v_head_dim or self.head_dim

    @property
    def layer_counts(self) -> dict[str, int]:
        """Layers per kind, ``{"global": n, "local": m}``, kinds with no layer left out."""
        counts = {kind: self.layer_types.count(t) for t, kind in _LAYER_KIND.items()}
        return {kind: c for kind, c in counts.items() if c}

    def mha_equivalent(self) -> ModelPreset:
        """The same model with one key/value head per query head and no latent compression.

        For MLA this is the expanded cache: per head a ``head_dim`` key and a ``value_head_dim`` value.

        Example:
            >>> PRESETS["llama-3-70b"].mha_equivalent().num_key_value_heads
            64
        """
        return dataclasses.replace(
            self,
            name=f"{self.name} (MHA-equivalent)",
            num_key_value_heads=self.num_attention_heads,
            kv_lora_rank=None,
            qk_rope_head_dim=None,
            qk_nope_head_dim=None,
            notes=f"{self.name} with one KV head per query head",
        )


def _pattern(num_layers: int, period: int) -> tuple[str, ...]:
    """HF's interleave: layer ``i`` is global iff ``(i + 1) % period == 0`` (Gemma 2: period 2)."""
    return tuple(FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers))


_PRESET_LIST = (
    ModelPreset(
        name="gpt-3-175b", num_hidden_layers=96, num_attention_heads=96, num_key_value_heads=96,
        head_dim=128, hidden_size=12288,
        source="Brown et al. 2020, Language Models are Few-Shot Learners, arXiv:2005.14165, Table 2.1",
        notes="Context 2048. The paper alternates dense and locally banded sparse layers without "
        "publishing the band; modelled here as dense MHA.",
    ),
    ModelPreset(
        name="llama-2-70b", num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, hidden_size=8192,
        source="Touvron et al. 2023, Llama 2, arXiv:2307.09288 (GQA for 34B/70B); "
        "meta-llama/Llama-2-70b-hf config.json",
        notes="Context 4096.",
    ),
    ModelPreset(
        name="llama-3-8b", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_size=4096,
        source="Llama Team 2024, The Llama 3 Herd of Models, arXiv:2407.21783, Table 3; "
        "meta-llama/Meta-Llama-3-8B config.json",
        notes="Context 8192 (Llama 3); 131072 in Llama 3.1, same attention shape.",
    ),
    ModelPreset(
        name="llama-3-70b", num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, hidden_size=8192,
        source="Llama Team 2024, The Llama 3 Herd of Models, arXiv:2407.21783, Table 3; "
        "meta-llama/Meta-Llama-3-70B config.json",
        notes="Context 8192 (Llama 3); 131072 in Llama 3.1, same attention shape.",
    ),
    ModelPreset(
        name="mistral-7b", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, hidden_size=4096, sliding_window=4096,
        source="Jiang et al. 2023, Mistral 7B, arXiv:2310.06825, Table 1; "
        "mistralai/Mistral-7B-v0.1 config.json",
        notes="v0.1: every layer slides over 4096 tokens (rolling-buffer cache). v0.2 and later drop "
        "the window.",
    ),
    ModelPreset(
        name="gemma-2-27b", num_hidden_layers=46, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, hidden_size=4608, sliding_window=4096, layer_types=_pattern(46, 2),
        source="Gemma Team 2024, Gemma 2, arXiv:2408.00118, Table 1; google/gemma-2-27b config.json",
        notes="Local (window 4096) and global layers alternate, layer 0 local; context 8192.",
    ),
    ModelPreset(
        name="gemma-3-27b", num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, hidden_size=5376, sliding_window=1024, layer_types=_pattern(62, 6),
        source="Gemma Team 2025, Gemma 3 Technical Report, arXiv:2503.19786 (5 local : 1 global, "
        "local span 1024); google/gemma-3-27b-pt config.json text_config",
        notes="Every 6th layer global (10 of 62); context 128K.",
    ),
    ModelPreset(
        name="deepseek-v2", num_hidden_layers=60, num_attention_heads=128, num_key_value_heads=128,
        head_dim=192, hidden_size=5120, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128,
        source="DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434, Sec. 2.1 and App. B; "
        "deepseek-ai/DeepSeek-V2 config.json",
        notes="MLA caches kv_lora_rank + qk_rope_head_dim = 576 elements per token per layer.",
    ),
    ModelPreset(
        name="llama-70b-mha", num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=64,
        head_dim=128, hidden_size=8192,
        source="Teaching example: the Llama 2 70B shape (arXiv:2307.09288) without GQA",
        notes="2 x 128,000 x 64 x 128 x 2 B = 4.19 GB per layer, 335 GB for 80 layers at fp16; the "
        "texts' '128K' is decimal, 128,000 tokens.",
    ),
)

PRESETS: Mapping[str, ModelPreset] = MappingProxyType({p.name: p for p in _PRESET_LIST})

_HF_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size"}
_MLA_KEYS = ("qk_rope_head_dim", "qk_nope_head_dim")
# HF model types whose config leaves the local:global period to the modelling code.
_HF_DEFAULT_PERIOD = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def preset_from_hf_config(
    config: str | os.PathLike | Mapping[str, Any], *, name: str | None = None
) -> ModelPreset:
    """Build a preset from a HF ``config.json`` (a path, a folder holding one, or the parsed dict).

    Missing ``num_key_value_heads`` means MHA; missing ``head_dim`` means ``hidden_size //
    num_attention_heads`` (``qk_nope_head_dim + qk_rope_head_dim`` for MLA). Local layers come from
    ``layer_types``, else ``sliding_window_pattern`` (layer ``i`` global iff ``(i + 1) % pattern == 0``),
    else the Gemma 2/3 defaults, else every layer slides when ``sliding_window`` is set (Mistral).
    ``use_sliding_window: false`` (Qwen2) disables the window. Multimodal configs are read from
    ``text_config``.

    Example:
        >>> cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
        >>> preset_from_hf_config(cfg).attention_kind
        'mha'
    """
    source = "HF config dict"
    if not isinstance(config, Mapping):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else os.fspath(config)
        config = read_json_config(path)
        source = f"HF config {path}"
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path))) or "config"
    check_layout_fields(config, source)
    cfg = dict(config.get("text_config") or config) if "num_hidden_layers" not in config else dict(config)
    cfg = {_HF_ALIASES.get(k, k): v for k, v in cfg.items()}
    model_type = cfg.get("model_type") or config.get("model_type") or ""
    name = name or model_type or "config"
    mla = cfg.get("kv_lora_rank") is not None
    required = ("num_hidden_layers", "num_attention_heads") + (_MLA_KEYS if mla else ())
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}")

    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if mla:
        head_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    elif head_dim is None:
        if cfg.get("hidden_size") is None:
            raise ValueError(f"{source}: needs head_dim or hidden_size")
        head_dim = cfg["hidden_size"] // heads

    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(f"{source}: layer types {unknown} not supported; known {FULL!r}, {SLIDING!r}")
        layer_types = tuple(layer_types)
    elif window:
        period = cfg.get("sliding_window_pattern") or _HF_DEFAULT_PERIOD.get(model_type)
        layer_types = _pattern(layers, period) if period else None

    return ModelPreset(
        name=name,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        hidden_size=cfg.get("hidden_size") or heads * head_dim,
        sliding_window=window or None,
        layer_types=layer_types,
        kv_lora_rank=cfg.get("kv_lora_rank"),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim") if mla else None,
        qk_nope_head_dim=cfg.get("qk_nope_head_dim") if mla else None,
        v_head_dim=cfg.get("v_head_dim"),
        source=source,
    )


def get_preset(name_or_path: str | os.PathLike) -> ModelPreset:
    """A registry preset by name (case and ``_``/``-`` forgiven), or a HF ``config.json`` path.

    Raises:
        ValueError: unknown name, listing the known ones and the closest match.

    Example:
        >>> get_preset("Llama_3_70B").num_key_value_heads
        8
    """
    key = os.fspath(name_or_path).strip().lower().replace("_", "-").replace(" ", "-")
    if key in PRESETS:
        return PRESETS[key]
    if os.path.exists(name_or_path):
        return preset_from_hf_config(name_or_path)
    close = difflib.get_close_matches(key, PRESETS, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown preset {os.fspath(name_or_path)!r}.{hint} Known presets: {', '.join(PRESETS)}; "
        "or give the path of a HF config.json."
    )
