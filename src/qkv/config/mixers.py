"""The mixer registry, torch-free half: every kind of token-mixing layer a :class:`qkv.config.DecoderConfig` can hold,
with what the cache, the cost arithmetic and the decoder need to know of it.

A decoder layer is a token mixer followed by a feed-forward. The mixer kinds (:data:`MIXERS`):

- ``"attention"``: grouped-query softmax attention (Ainslie et al. 2023, arXiv:2305.13245), full or sliding;
- ``"mla"``: Multi-head Latent Attention (DeepSeek-AI 2024, DeepSeek-V2, arXiv:2405.04434);
- ``"dsa"``: MLA reading only the latents a lightning indexer picks, DeepSeek Sparse Attention (DeepSeek-AI 2025,
  DeepSeek-V3.2-Exp);
- ``"gated_deltanet"`` and ``"gated_deltanet_split"``: Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025,
  arXiv:2412.06464) with Qwen3-Next's and Qwen3.5's projections;
- ``"kda"``: Kimi Delta Attention (Kimi Team 2025, arXiv:2510.26692);
- ``"qsa"``: grouped-query attention reading only the tokens QSA's block indexer keeps (Qwen4-Exp).
- ``"msa"``: grouped-query attention reading only the key blocks MSA's indexer keeps per KV group (MiniMax-M3).
- ``"v4_sliding"``, ``"csa"``, ``"hca"``: DeepSeek-V4's attention (DeepSeek-AI 2026, DeepSeek-V4 report, Section 2.3):
  a sliding window alone, beside indexer-selected entries of overlapping compressed windows (CSA), or beside every
  entry of disjoint compressed windows (HCA); one module, :class:`qkv.nn.compressed_attention.CompressedAttention`.

Each :class:`MixerKind` declares, for one layer of a config: the module attribute the layer holds it under (HF's
``self_attn`` or ``linear_attn``, so checkpoints map by name), its cache as a :class:`CacheShape` (which
:func:`qkv.cache.describe.cache_specs_of` turns into a layer spec), its parameter count, the projection weights a
token multiplies by, and its mixing FLOPs (per attended (query, key) pair and per token; DSA's are MLA's dense
count, its top-k count is :func:`qkv.costs.dsa_model_flops`). :func:`mixer_of` is the
one place that says which kind a layer is; the modules are :mod:`qkv.nn.mixers`' half of the registry, under the
same names.

A new kind of layer is one :class:`MixerKind` registered here (:func:`register_mixer`), its module class with a
registry line in :mod:`qkv.nn.mixers`, and, for a recurrent kind, nothing else: its name is a value of
:attr:`qkv.config.LinearAttentionConfig.mixer`.

Example:
    >>> from qkv.config import get_config
    >>> c = get_config("tiny-llama")
    >>> kind = mixer_of(c, 0)
    >>> kind.name, kind.attribute, kind.cache(c, 0)
    ('attention', 'self_attn', CacheShape(kind='full', args=(2, 16)))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from .layer_types import LINEAR_ATTENTION

if TYPE_CHECKING:
    from .decoder import DecoderConfig

__all__ = ["CACHE_KINDS", "MIXERS", "CacheShape", "MixerKind", "get_mixer", "mixer_of", "recurrent_mixers",
           "register_mixer"]

#: The :mod:`qkv.cache` layer specs a mixer's cache may be, by their ``kind`` (``"indexed_latent"``: a latent with
#: DeepSeek Sparse Attention's indexer key beside it; ``"indexed"``: full keys and values with MSA's indexer key).
CACHE_KINDS = ("full", "indexed", "sliding", "latent", "indexed_latent", "recurrent", "shared", "compressed")


class CacheShape(NamedTuple):
    """What one layer caches, as data: a :mod:`qkv.cache` spec kind (one of :data:`CACHE_KINDS`) and that spec's
    constructor arguments (``"full"``: Hkv, D, Dv (None: D), values only (K = V); ``"sliding"``: window, Hkv, D, Dv,
    values only; ``"indexed"``: Hkv, D, Dv, False, index_head_dim; ``"latent"``: kv_lora_rank,
    qk_rope_head_dim; ``"indexed_latent"``: those and index_head_dim; ``"recurrent"``: conv channels, taps, heads,
    Dk, Dv (and a side state's shapes and int64 count); ``"shared"``: the source layer, window or None, Hkv, D;
    ``"compressed"``: window, head_dim, rate, index_head_dim (0 without an indexer))."""

    kind: str
    args: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class MixerKind:
    """One kind of token mixer. Every function takes the :class:`qkv.config.DecoderConfig` of the model.

    Args:
        name: the registry key (for a recurrent kind, the ``mixer`` value of its ``LinearAttentionConfig``).
        attribute: the submodule name a decoder layer holds the mixer under (``"self_attn"``, ``"linear_attn"``).
        cache: ``(config, layer_idx) -> CacheShape`` of one layer.
        params: ``(config, layer_idx=None) -> int``, the parameters of one such mixer (biases and inner norms
            included): what ``sum(p.numel() for p in mixer.parameters())`` of the built module gives. ``layer_idx``:
            the layer whose shape to count (per-type heads, K = V, a KV-shared layer without key and value
            projections: Gemma 4); None: a layer of the model-wide shape. The next three take it too.
        weights: ``(config, layer_idx=None) -> int``, the projection weights one token multiplies by (two FLOPs
            each).
        pair_flops: ``(config, layer_idx=None) -> int``, FLOPs per attended (query, key) pair of one sequence
            (scores and values; 0 for a recurrent mixer).
        token_flops: ``(config, layer_idx=None) -> int``, mixing FLOPs per new token of one sequence beyond the
            projections and the pairs (a recurrent mixer's state update and read; 0 for attention).
        window: ``(config, layer_idx) -> int | None``, the keys a query attends to (None: every earlier one).
        recurrent: the kind sits on ``"linear_attention"`` layers and keeps a fixed state instead of a cache that
            grows with the context.
    """

    name: str
    attribute: str
    cache: Callable[[DecoderConfig, int], CacheShape]
    params: Callable[..., int]
    weights: Callable[..., int]
    pair_flops: Callable[..., int]
    token_flops: Callable[..., int]
    window: Callable[[DecoderConfig, int], int | None]
    recurrent: bool = False


_MIXERS: dict[str, MixerKind] = {}

#: The registered mixer kinds by name, read-only.
MIXERS: Mapping[str, MixerKind] = MappingProxyType(_MIXERS)


def register_mixer(kind: MixerKind) -> MixerKind:
    """Add ``kind`` to :data:`MIXERS`. ``ValueError`` when the name is taken; ``TypeError`` for anything but a
    :class:`MixerKind`."""
    if not isinstance(kind, MixerKind):
        raise TypeError(f"register_mixer: kind must be a qkv.config.mixers.MixerKind, got {type(kind).__name__}")
    if kind.name in _MIXERS:
        raise ValueError(f"register_mixer: a mixer named {kind.name!r} is already registered; pick another name (the "
                         f"registered ones: {', '.join(_MIXERS)})")
    _MIXERS[kind.name] = kind
    return kind


def get_mixer(name: str) -> MixerKind:
    """The registered kind ``name``; ``ValueError`` naming the registered ones otherwise."""
    if not isinstance(name, str) or name not in _MIXERS:
        raise ValueError(f"unknown mixer kind {name!r}; registered: {', '.join(_MIXERS)} (register a new one with "
                         "qkv.config.mixers.register_mixer)")
    return _MIXERS[name]


def recurrent_mixers() -> tuple[str, ...]:
    """Names of the registered recurrent kinds, the values ``LinearAttentionConfig.mixer`` accepts."""
    return tuple(name for name, kind in _MIXERS.items() if kind.recurrent)


def mixer_of(config: DecoderConfig, layer_idx: int) -> MixerKind:
    """The kind of layer ``layer_idx``'s mixer: a ``"linear_attention"`` layer's is its ``linear_attention.mixer``;
    otherwise ``"dsa"`` with an indexer, ``"mla"`` with a latent, else ``"attention"``.

    Example:
        >>> from qkv.config import get_config
        >>> [mixer_of(get_config("qwen3-next-80b-a3b", num_hidden_layers=4), i).name for i in range(4)]
        ['gated_deltanet', 'gated_deltanet', 'gated_deltanet', 'attention']
    """
    n = config.num_hidden_layers
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < n:
        raise ValueError(f"mixer_of: layer_idx must be an int in [0, {n}), got {layer_idx!r}")
    if config.compressed is not None:
        kind = config.compressed.attention_types[layer_idx]
        return get_mixer("v4_sliding" if kind == "sliding" else kind)
    if config.layer_types[layer_idx] == LINEAR_ATTENTION:
        return get_mixer(config.linear_attention.mixer)
    if config.latent is not None:
        return get_mixer("dsa" if config.indexer is not None else "mla")
    if config.msa is not None and layer_idx in config.msa.layers:
        return get_mixer("msa")
    return get_mixer("qsa" if config.qsa is not None else "attention")


def _window(c: DecoderConfig, i: int) -> int | None:
    return c.window_for(i)


def _no_window(c: DecoderConfig, i: int) -> None:
    return None


def _zero(c: DecoderConfig, i: int | None = None) -> int:
    return 0


def _gqa_cache(c: DecoderConfig, i: int) -> CacheShape:
    w, Hkv, D = c.window_for(i), c.kv_heads_for(i), c.head_dim_for(i)
    if c.kv_source(i) is not None:  # cross-layer KV sharing: reads an earlier layer's cache
        return CacheShape("shared", (c.kv_source(i), w, Hkv, D))
    # K = V: one tensor is cached, the values; the keys are the values times the key norm's weight, rotated (Gemma
    # 4: the key norm and the unscaled value norm of one projection), or the values themselves (neither norm)
    values_only = (c.k_eq_v_for(i) and c.qk_norm_scope == "head" and bool(c.qk_norm) == bool(c.value_norm),)
    if w:
        return CacheShape("sliding", (w, Hkv, D, None) + values_only)
    return CacheShape("full", (Hkv, D, None) + values_only)


def _gqa_shape(c: DecoderConfig, i: int | None) -> tuple[int, int, bool, bool]:
    """``(Hkv, D, has_v, has_k)`` of attention layer ``i`` (None: the model-wide ``num_key_value_heads`` and
    ``head_dim``, a layer that projects its own keys and values): per-type heads, K = V (no value projection) and
    cross-layer KV sharing (no key or value projection, no key norm), Gemma 4."""
    if i is None:
        return c.num_key_value_heads, c.head_dim, True, True
    return c.kv_heads_for(i), c.head_dim_for(i), not c.k_eq_v_for(i), c.kv_source(i) is None


def _gqa_weights(c: DecoderConfig, i: int | None = None) -> int:
    d, Hq = c.hidden_size, c.num_attention_heads
    Hkv, D, has_v, has_k = _gqa_shape(c, i)
    gate = d * Hq * D if c.attn_output_gate else 0  # Qwen3-Next: a second query-sized projection, the output gate
    return d * Hq * D + has_k * (1 + has_v) * d * Hkv * D + Hq * D * d + gate


def _gqa_params(c: DecoderConfig, i: int | None = None) -> int:
    d, Hq = c.hidden_size, c.num_attention_heads
    Hkv, D, has_v, has_k = _gqa_shape(c, i)
    n = _gqa_weights(c, i)
    if c.qkv_bias:
        n += (Hq * c.attn_output_gate + Hq + has_k * (1 + has_v) * Hkv) * D
    if c.o_bias:
        n += d
    if c.qk_norm:  # RMSNorm: a scale per channel, per head (Gemma 3, Qwen3) or over the projection (OLMo 2/3)
        n += (Hq + has_k * Hkv) * D if c.qk_norm_scope == "projection" else (1 + has_k) * D
    if c.attention_sinks:
        n += Hq
    return n  # Gemma 4's value norm has no scale: nothing to count


def _gqa_pair_flops(c: DecoderConfig, i: int | None = None) -> int:
    return 2 * c.num_attention_heads * 2 * _gqa_shape(c, i)[1]


def _mla_cache(c: DecoderConfig, i: int) -> CacheShape:
    return CacheShape("latent", (c.latent.kv_lora_rank, c.latent.qk_rope_head_dim))


def _mla_weights(c: DecoderConfig, i: int | None = None) -> int:
    lat, d = c.latent, c.hidden_size
    Hq, Dqk, Dv = lat.num_attention_heads, lat.qk_head_dim, lat.v_head_dim
    q = d * Hq * Dqk if lat.q_lora_rank is None else lat.q_lora_rank * (d + Hq * Dqk)
    kv = d * (lat.kv_lora_rank + lat.qk_rope_head_dim) + lat.kv_lora_rank * Hq * (lat.qk_nope_head_dim + Dv)
    return q + kv + Hq * Dv * d


def _mla_params(c: DecoderConfig, i: int | None = None) -> int:
    lat = c.latent
    norms = (lat.q_lora_rank or 0) + lat.kv_lora_rank  # q_a_layernorm, kv_a_layernorm
    bias = ((lat.q_lora_rank or 0) + lat.kv_lora_rank + lat.qk_rope_head_dim + c.hidden_size
            if lat.attention_bias else 0)  # q_a_proj, kv_a_proj_with_mqa, o_proj
    return _mla_weights(c) + norms + bias


def _mla_pair_flops(c: DecoderConfig, i: int | None = None) -> int:
    lat = c.latent
    return 2 * lat.num_attention_heads * (lat.qk_head_dim + lat.v_head_dim)


def _dsa_cache(c: DecoderConfig, i: int) -> CacheShape:
    lat = c.latent
    return CacheShape("indexed_latent", (lat.kv_lora_rank, lat.qk_rope_head_dim, c.indexer.index_head_dim))


def _dsa_weights(c: DecoderConfig, i: int | None = None) -> int:
    ix, d = c.indexer, c.hidden_size
    Hi, Di = ix.index_n_heads, ix.index_head_dim
    return _mla_weights(c) + c.latent.q_lora_rank * Hi * Di + d * Di + d * Hi  # the indexer's wq_b, wk, weights_proj


def _dsa_params(c: DecoderConfig, i: int | None = None) -> int:
    return _mla_params(c) + _dsa_weights(c) - _mla_weights(c) + 2 * c.indexer.index_head_dim  # its key's LayerNorm


def _indexed_gqa_weights(c: DecoderConfig, ix, i: int | None = None) -> int:
    """GQA beside a one-key-head indexer (QSA, MSA): its queries and its key, ``d (Hi + 1) Di``."""
    return _gqa_weights(c, i) + c.hidden_size * (ix.index_n_heads + 1) * ix.index_head_dim


def _indexed_gqa_params(c: DecoderConfig, ix, i: int | None = None) -> int:
    return _gqa_params(c, i) + c.hidden_size * (ix.index_n_heads + 1) * ix.index_head_dim + 2 * ix.index_head_dim


def _qsa_weights(c: DecoderConfig, i: int | None = None) -> int:
    return _indexed_gqa_weights(c, c.qsa, i)


def _qsa_params(c: DecoderConfig, i: int | None = None) -> int:
    return _indexed_gqa_params(c, c.qsa, i)  # the indexer's two RMSNorms included


def _indexed_cache(c: DecoderConfig, i: int) -> CacheShape:
    """An MSA or QSA layer keeps its keys and values and its indexer's key per token
    (:class:`qkv.cache.IndexedSpec`)."""
    index = c.msa if c.msa is not None and i in c.msa.layers else c.qsa
    return CacheShape("indexed", (c.kv_heads_for(i), c.head_dim_for(i), None, False, index.index_head_dim))


def _msa_weights(c: DecoderConfig, i: int | None = None) -> int:
    return _indexed_gqa_weights(c, c.msa, i)


def _msa_params(c: DecoderConfig, i: int | None = None) -> int:
    return _indexed_gqa_params(c, c.msa, i)


def _recurrent_cache(c: DecoderConfig, i: int) -> CacheShape:
    """The recurrent state; a layer with a Per-Layer Embedding before it (Qwen4-Exp) keeps that module's state
    beside it: the last ``ngram_size - 1`` tokens (int64) and its convolution's last ``(taps - 1) * ngram_size``
    inputs over the streams (``qkv.nn.ple``)."""
    ple = c.ple
    if ple is None or ple.index_of(i) is None:
        return CacheShape("recurrent", c.linear_attention.recurrent_shape())
    wide = c.gated_residual.streams * c.hidden_size
    side = ((ple.ngram_size - 1,), (wide, (ple.conv_kernel_size - 1) * ple.ngram_size))
    return CacheShape("recurrent", (*c.linear_attention.recurrent_shape(), side, 1))


def _gdn_weights(c: DecoderConfig, i: int | None = None) -> int:
    lin, d = c.linear_attention, c.hidden_size
    Hk, H, Dk, Dv = (lin.linear_num_key_heads, lin.linear_num_value_heads, lin.linear_key_head_dim,
                     lin.linear_value_head_dim)
    return d * (2 * Hk * Dk + 2 * H * Dv + 2 * H) + H * Dv * d  # q, k, v, z, b, a; the output


def _gdn_params(c: DecoderConfig, i: int | None = None) -> int:
    conv, K, H, _, Dv = c.linear_attention.recurrent_shape()
    return _gdn_weights(c) + conv * K + 2 * H + Dv  # depthwise conv, A_log and dt_bias per head, the gated norm


def _kda_weights(c: DecoderConfig, i: int | None = None) -> int:
    lin, d = c.linear_attention, c.hidden_size
    H, D = lin.linear_num_value_heads, lin.linear_value_head_dim
    return 3 * d * H * D + 2 * (d * D + D * H * D) + d * H + H * D * d  # q, k, v; low-rank f and g; beta; output


def _kda_params(c: DecoderConfig, i: int | None = None) -> int:
    conv, K, H, _, D = c.linear_attention.recurrent_shape()
    return _kda_weights(c) + conv * K + H * D + H + D  # conv, dt_bias per channel and A_log per head, the norm


def _v4_weights(c: DecoderConfig, kind: str) -> int:
    cc, d, H, D = c.compressed, c.hidden_size, c.num_attention_heads, c.head_dim
    n = d * cc.q_lora_rank + cc.q_lora_rank * H * D + d * D + H * D * cc.o_lora_rank + cc.o_groups * cc.o_lora_rank * d
    if kind != "sliding":
        n += 2 * d * D * (2 if kind == "csa" else 1)  # the compressor's values and gates
    if kind == "csa":  # the indexer's values and gates, queries and head weights
        Hi, Di = cc.index_n_heads, cc.index_head_dim
        n += 4 * d * Di + cc.q_lora_rank * Hi * Di + d * Hi
    return n


def _v4_params(c: DecoderConfig, kind: str) -> int:
    cc, H, D = c.compressed, c.num_attention_heads, c.head_dim
    n = _v4_weights(c, kind) + cc.q_lora_rank + D + H  # q_a_norm, kv_norm, sinks
    if kind != "sliding":
        rate = cc.compress_rates[kind]
        n += rate * D * (2 if kind == "csa" else 1) + D  # position bias, the entries' norm
    if kind == "csa":
        n += cc.compress_rates["csa"] * 2 * cc.index_head_dim + cc.index_head_dim
    return n


def _v4_cache(c: DecoderConfig, i: int) -> CacheShape:
    kind = c.compressed.attention_types[i]
    if kind == "sliding":
        return CacheShape("sliding", (c.sliding_window, 1, c.head_dim))
    index_dim = c.compressed.index_head_dim if kind == "csa" else 0
    return CacheShape("compressed", (c.sliding_window, c.head_dim, c.compressed.rate_of(i), index_dim))


def _recurrent_token_flops(c: DecoderConfig, i: int | None = None) -> int:
    lin = c.linear_attention  # the delta rule reads, corrects and writes a (Dk, Dv) state per head: 6 H Dk Dv
    return 6 * lin.linear_num_value_heads * lin.linear_key_head_dim * lin.linear_value_head_dim


register_mixer(MixerKind(name="attention", attribute="self_attn", cache=_gqa_cache, params=_gqa_params,
                         weights=_gqa_weights, pair_flops=_gqa_pair_flops, token_flops=_zero, window=_window))
register_mixer(MixerKind(name="mla", attribute="self_attn", cache=_mla_cache, params=_mla_params,
                         weights=_mla_weights, pair_flops=_mla_pair_flops, token_flops=_zero, window=_no_window))
register_mixer(MixerKind(name="dsa", attribute="self_attn", cache=_dsa_cache, params=_dsa_params,
                         weights=_dsa_weights, pair_flops=_mla_pair_flops, token_flops=_zero, window=_no_window))
register_mixer(MixerKind(name="qsa", attribute="self_attn", cache=_indexed_cache, params=_qsa_params,
                         weights=_qsa_weights, pair_flops=_gqa_pair_flops, token_flops=_zero, window=_window))
register_mixer(MixerKind(name="msa", attribute="self_attn", cache=_indexed_cache, params=_msa_params,
                         weights=_msa_weights, pair_flops=_gqa_pair_flops, token_flops=_zero, window=_window))
for _name in ("gated_deltanet", "gated_deltanet_split"):
    register_mixer(MixerKind(name=_name, attribute="linear_attn", cache=_recurrent_cache, params=_gdn_params,
                             weights=_gdn_weights, pair_flops=_zero, token_flops=_recurrent_token_flops,
                             window=_no_window, recurrent=True))
register_mixer(MixerKind(name="kda", attribute="linear_attn", cache=_recurrent_cache, params=_kda_params,
                         weights=_kda_weights, pair_flops=_zero, token_flops=_recurrent_token_flops,
                         window=_no_window, recurrent=True))
for _name, _kind in (("v4_sliding", "sliding"), ("csa", "csa"), ("hca", "hca")):
    register_mixer(MixerKind(name=_name, attribute="self_attn", cache=_v4_cache,
                             params=lambda c, i=None, k=_kind: _v4_params(c, k),
                             weights=lambda c, i=None, k=_kind: _v4_weights(c, k),
                             pair_flops=_gqa_pair_flops, token_flops=_zero, window=_window))
