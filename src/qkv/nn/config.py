"""Transformer configs (frozen dataclasses) and the named preset registry that tests, benchmarks and the
CLI read.

Field names are short (``d_model``, ``n_heads``); HF transformers' names are read-only aliases
(``hidden_size``, ``num_attention_heads``, ...) and :meth:`TransformerConfig.from_dict` accepts either,
so an HF ``config.json`` maps over directly. Positional schemes: ``"rope"`` (Su et al. 2021),
``"learned"`` (GPT-2/BERT), ``"sinusoidal"`` (Vaswani et al. 2017), ``"alibi"`` (Press et al. 2022),
``"t5"`` (Raffel et al. 2020 buckets), ``"shaw"`` (Shaw et al. 2018) or ``"none"``.

Example:
    >>> from qkv.nn import PRESETS, get_config
    >>> cfg = get_config("tiny-llama", n_layers=1)
    >>> cfg.hidden_size, cfg.num_key_value_heads, cfg.position
    (64, 2, 'rope')
    >>> sorted(PRESETS)[:3]
    ['tiny-bloom', 'tiny-encoder', 'tiny-gemma']
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .ffn import ACTIVATIONS
from .norm import NORMS

__all__ = ["TransformerConfig", "PRESETS", "get_config", "POSITIONS", "FULL_ATTENTION", "SLIDING_ATTENTION"]

POSITIONS = ("rope", "learned", "sinusoidal", "alibi", "t5", "shaw", "none")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # HF ``layer_types`` values

#: HF transformers names -> our field names.
_HF_ALIASES = {
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "num_hidden_layers": "n_layers",
    "intermediate_size": "d_ff",
    "hidden_act": "activation",
    "rms_norm_eps": "norm_eps",
    "layer_norm_eps": "norm_eps",
}


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """One transformer stack's shape and choices. Derived fields are filled in ``__post_init__``.

    Args:
        d_model: model width (HF ``hidden_size``).
        n_heads: query heads (``num_attention_heads``).
        n_layers: blocks (``num_hidden_layers``); an encoder-decoder uses it for each side.
        n_kv_heads: key/value heads (``num_key_value_heads``; default ``n_heads``).
        head_dim: per-head width (default ``d_model // n_heads``).
        d_ff: feed-forward hidden width (``intermediate_size``; default ``4 * d_model``).
        activation: feed-forward activation, one of ``qkv.nn.ffn.ACTIVATIONS`` (``"swiglu"``, ``"geglu"``
            are gated).
        norm: ``"layer"`` or ``"rms"``; ``norm_eps`` its epsilon.
        norm_first: pre-norm (True, GPT-2 onwards) or post-norm (False, Vaswani et al., BERT).
        attention_bias, mlp_bias: biases on attention and feed-forward projections.
        qk_norm: ``None``, ``"rms"`` or ``"layer"`` per-head query/key norm.
        position: positional scheme, one of ``POSITIONS``.
        rope_theta, rope_scaling, partial_rotary_factor, rope_interleaved: RoPE (HF names; ``rope_scaling``
            is HF's dict with ``rope_type``).
        max_position_embeddings: context length (learned table size; RoPE ``dynamic`` threshold).
        sliding_window: keys per query on local layers, the query included (HF convention).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (HF); default: all sliding when
            ``sliding_window`` is set, else all full.
        relative_attention_num_buckets, relative_attention_max_distance: T5 buckets.
        shaw_max_distance, shaw_values: Shaw clipping distance and whether values get representations too.
        vocab_size: token vocabulary (token-level models).
        tie_word_embeddings: LM head shares the token embedding matrix.
        dropout: residual/embedding dropout; ``attention_dropout``: on attention probabilities.
        initializer_range: std of the normal init of linear and embedding weights.
        scale_embeddings: multiply token embeddings by ``sqrt(d_model)`` (Vaswani et al., Gemma).
        attention_scale: score scale override (None: ``head_dim ** -0.5``; T5 uses 1.0).
        backend: the ``qkv.attention`` backend every layer uses.
        name: preset name, informational.
    """

    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    activation: str = "gelu"
    norm: str = "layer"
    norm_eps: float = 1e-5
    norm_first: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True
    qk_norm: str | None = None
    position: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    shaw_max_distance: int = 16
    shaw_values: bool = False
    vocab_size: int = 256
    tie_word_embeddings: bool = True
    dropout: float = 0.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    scale_embeddings: bool = False
    attention_scale: float | None = None
    backend: str = "auto"
    name: str = ""
    _derived: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        derived = set()

        def set_(key, value):  # frozen: only derived fields are filled in, and remembered as derived
            derived.add(key)
            object.__setattr__(self, key, value)

        for f in ("d_model", "n_heads", "n_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TransformerConfig: {f} must be a positive int, got {v!r}")
        if self.n_kv_heads is None:
            set_("n_kv_heads", self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"TransformerConfig: n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"TransformerConfig: d_model ({self.d_model}) is not divisible by n_heads "
                                 f"({self.n_heads}); set head_dim")
            set_("head_dim", self.d_model // self.n_heads)
        if self.d_ff is None:
            set_("d_ff", 4 * self.d_model)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"TransformerConfig: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.norm not in NORMS:
            raise ValueError(f"TransformerConfig: norm must be one of {NORMS}, got {self.norm!r}")
        if self.position not in POSITIONS:
            raise ValueError(f"TransformerConfig: position must be one of {POSITIONS}, got {self.position!r}")
        if self.rope_scaling is not None:
            # A private copy (callers' later edits do not leak in); a plain dict so configs pickle and deepcopy.
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if self.layer_types is None:
            kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
            set_("layer_types", (kind,) * self.n_layers)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"TransformerConfig: layer_types has {len(self.layer_types)} entries for "
                             f"{self.n_layers} layers")
        bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if bad:
            raise ValueError(f"TransformerConfig: layer_types must be {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}, "
                             f"got {sorted(bad)}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("TransformerConfig: sliding_attention layers need sliding_window (keys per query)")
        object.__setattr__(self, "_derived", frozenset(derived))
        if self.position == "rope":
            self.rotary_embedding()  # validates rope_scaling early

    # HF-named views
    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.n_kv_heads

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def intermediate_size(self) -> int:
        return self.d_ff

    def window_for(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (None for a full-attention layer)."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    def rotary_embedding(self):
        """The :class:`qkv.pos.RotaryEmbedding` this config describes."""
        from ..pos.rope import RotaryEmbedding

        return RotaryEmbedding(self.head_dim, theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor,
                               scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
                               interleaved=self.rope_interleaved)

    def replace(self, **changes) -> TransformerConfig:
        """A copy with ``changes`` (HF names accepted); derived fields are recomputed unless given."""
        return TransformerConfig.from_dict({**self._explicit(), **changes})

    def _explicit(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.init and f.name not in self._derived}
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = True) -> TransformerConfig:
        """Build from a mapping with our names or HF names (``config.to_dict()`` of an HF config works with
        ``strict=False``, which ignores keys this config has no field for)."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _HF_ALIASES.get(key, key)
            if name == "rope_parameters":
                name = "rope_scaling"
            if name not in names:
                if strict:
                    close = difflib.get_close_matches(key, [*names, *_HF_ALIASES], n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ValueError(f"TransformerConfig: unknown field {key!r}{hint}")
                continue
            kwargs[name] = value
        scaling = kwargs.get("rope_scaling")
        if isinstance(scaling, Mapping):
            scaling = dict(scaling)
            if "rope_theta" in scaling:
                kwargs.setdefault("rope_theta", scaling["rope_theta"])
            if scaling.get("rope_type", scaling.get("type", "default")) == "default" and set(scaling) <= {
                    "rope_type", "type", "rope_theta", "partial_rotary_factor"}:
                scaling = None
            kwargs["rope_scaling"] = scaling
        if isinstance(kwargs.get("layer_types"), list):
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        return cls(**kwargs)


_TINY = dict(d_model=64, n_heads=4, n_layers=2, vocab_size=256, max_position_embeddings=256)

_PRESETS: dict[str, TransformerConfig] = {
    # Llama 2/3 shape: RMSNorm, SwiGLU, GQA, RoPE, no biases, untied head.
    "tiny-llama": TransformerConfig(**_TINY, n_kv_heads=2, d_ff=172, activation="swiglu", norm="rms", norm_eps=1e-6,
                                    attention_bias=False, mlp_bias=False, position="rope", rope_theta=10000.0,
                                    tie_word_embeddings=False, name="tiny-llama"),
    # Mistral 7B v0.1 shape: Llama plus a sliding window on every layer.
    "tiny-mistral": TransformerConfig(**_TINY, n_kv_heads=2, d_ff=172, activation="swiglu", norm="rms",
                                      norm_eps=1e-6, attention_bias=False, mlp_bias=False, position="rope",
                                      sliding_window=16, tie_word_embeddings=False, name="tiny-mistral"),
    # Gemma 2/3 shape: alternating local (sliding) and global layers, GeGLU, QK norm, scaled embeddings.
    "tiny-gemma": TransformerConfig(**{**_TINY, "n_layers": 4}, n_kv_heads=1, d_ff=128, activation="geglu",
                                    norm="rms", norm_eps=1e-6, attention_bias=False, mlp_bias=False, qk_norm="rms",
                                    position="rope", sliding_window=8,
                                    layer_types=(SLIDING_ATTENTION, FULL_ATTENTION) * 2, scale_embeddings=True,
                                    name="tiny-gemma"),
    # GPT-2 shape: learned absolute positions, LayerNorm, GELU, biases, tied head.
    "tiny-gpt": TransformerConfig(**_TINY, activation="gelu_tanh", norm="layer", position="learned",
                                  name="tiny-gpt"),
    # BLOOM shape: ALiBi instead of positions, LayerNorm, GELU, tied head.
    "tiny-bloom": TransformerConfig(**_TINY, activation="gelu_tanh", norm="layer", position="alibi",
                                    name="tiny-bloom"),
    # BERT shape: bidirectional, post-norm, learned positions, GELU, biases.
    "tiny-encoder": TransformerConfig(**_TINY, activation="gelu", norm="layer", norm_eps=1e-12, norm_first=False,
                                      position="learned", name="tiny-encoder"),
    # T5 v1.1 shape: encoder-decoder, RMSNorm, GeGLU, bucketed relative bias, no biases, unscaled scores.
    "tiny-t5": TransformerConfig(**_TINY, d_ff=128, activation="geglu", norm="rms", norm_eps=1e-6,
                                 attention_bias=False, mlp_bias=False, position="t5", relative_attention_num_buckets=32,
                                 relative_attention_max_distance=128, attention_scale=1.0, tie_word_embeddings=False,
                                 name="tiny-t5"),
    # Vaswani et al. 2017 base shape, shrunk: post-norm, ReLU, sinusoidal positions, scaled embeddings.
    "tiny-transformer": TransformerConfig(**_TINY, activation="relu", norm="layer", norm_first=False,
                                          position="sinusoidal", scale_embeddings=True, name="tiny-transformer"),
}

#: Named presets, read-only. ``get_config(name, **overrides)`` copies one with changes.
PRESETS: Mapping[str, TransformerConfig] = MappingProxyType(_PRESETS)


def get_config(name: str, **overrides) -> TransformerConfig:
    """The preset ``name``, with ``overrides`` applied (HF field names accepted)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint} Known: {', '.join(sorted(PRESETS))}")
    cfg = PRESETS[name]
    return cfg.replace(**overrides) if overrides else cfg
