"""KV-cache size: bytes per token and in total, per layer kind and summed, for MHA/GQA/MQA, MLA and
sliding/global hybrids, in any storage dtype.

Per token and layer the cache holds a key and a value per KV head, ``Hkv * (Dqk + Dv)`` elements
(``2 * Hkv * D`` when ``Dqk = Dv``): MHA has ``Hkv = Hq``, GQA (Ainslie et al. 2023, arXiv:2305.13245)
fewer, MQA (Shazeer 2019, arXiv:1911.02150) one. MLA (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1.2)
caches once, for all heads, the compressed latent and the decoupled RoPE key: ``kv_lora_rank +
qk_rope_head_dim`` elements. A local (sliding-window) layer keeps at most ``sliding_window`` tokens
(Mistral's rolling buffer, arXiv:2310.06825), so it holds ``min(context, window)``.

Quantized caches (int8/int4/int2) usually store a scale and a zero-point per group of ``g``
elements; with ``group_size=g`` both are counted as fp16, adding ``4 / g`` bytes per element
(KIVI, Liu et al. 2024, arXiv:2402.02750, groups of 32-128).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..config.mixers import mixer_of
from ..config.presets import ModelPreset
from .units import GB, _dtype_key, parse_dtype

__all__ = [
    "DEVICE_GB",
    "KVMemory",
    "LayerKV",
    "element_bytes",
    "gqa_kv_bytes_per_token",
    "kv_cache_memory",
    "recurrent_state_bytes",
    "mla_kv_bytes_per_token",
]

# Common accelerator memory sizes in GB (1e9 bytes): 24 (RTX 4090, L4), 80 (A100/H100), 141 (H200).
DEVICE_GB = (24, 80, 141)
_GROUP_SCALE_BYTES = 4  # fp16 scale + fp16 zero-point per group


def element_bytes(dtype: Any = "bf16", *, group_size: int | None = None) -> float:
    """Bytes stored per cache element, group scales and zero-points included when asked: the one count of qkv
    (:mod:`qkv.cache` uses it too).

    Args:
        dtype: storage dtype name (see :func:`qkv.costs.parse_dtype`) or a ``torch.dtype`` (read by its name, so
            this module needs no torch); float64 too (8 bytes: the float64 reference caches of :mod:`qkv.cache`),
            which the cost tables do not offer.
        group_size: elements sharing one fp16 scale and one fp16 zero-point, integer dtypes only;
            adds ``4 / group_size`` bytes per element. ``None`` counts the payload only.

    Example:
        >>> element_bytes("int4"), element_bytes("int4", group_size=32)
        (0.5, 0.625)
    """
    wide = str(dtype).strip().lower().removeprefix("torch.") in ("fp64", "float64", "double")
    size = 8.0 if wide else parse_dtype(dtype)
    if group_size is None:
        return size
    if wide or not _dtype_key(dtype).startswith("int"):
        raise ValueError(f"group_size applies to int8/int4/int2 caches, not {dtype!r}; drop it")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    return size + _GROUP_SCALE_BYTES / group_size


def gqa_kv_bytes_per_token(
    num_kv_heads: int, head_dim: int, *, v_head_dim: int | None = None, dtype: str = "bf16",
    group_size: int | None = None,
) -> float:
    """Cache bytes for one token in one MHA/GQA/MQA layer: ``Hkv * (Dqk + Dv) * bytes``.

    Example:
        >>> gqa_kv_bytes_per_token(8, 128)  # Llama 3 70B, bf16: 2 * 8 * 128 * 2
        4096.0
    """
    return num_kv_heads * (head_dim + (v_head_dim or head_dim)) * element_bytes(dtype, group_size=group_size)


def mla_kv_bytes_per_token(
    kv_lora_rank: int, qk_rope_head_dim: int, *, dtype: str = "bf16", group_size: int | None = None
) -> float:
    """Cache bytes for one token in one MLA layer: ``(kv_lora_rank + qk_rope_head_dim) * bytes``.

    Example:
        >>> mla_kv_bytes_per_token(512, 64)  # DeepSeek-V2, bf16
        1152.0
    """
    return (kv_lora_rank + qk_rope_head_dim) * element_bytes(dtype, group_size=group_size)


def recurrent_state_bytes(preset: ModelPreset, *, dtype: str = "bf16", group_size: int | None = None) -> float:
    """Bytes of one recurrent layer's state for one sequence, at any context: the short convolution's last
    ``K - 1`` inputs in ``dtype`` and a ``(Dk, Dv)`` state per value head in float32 (float64 for a float64
    cache), the dtype the gated delta rule accumulates in (what :class:`qkv.cache.RecurrentSpec` counts).

    Example:
        >>> from qkv.costs import PRESETS
        >>> recurrent_state_bytes(PRESETS["qwen3-next-80b-a3b"]) == 8192 * 3 * 2 + 32 * 128 * 128 * 4
        True
    """
    lin = preset.config.linear_attention
    if lin is None:
        raise ValueError(f"recurrent_state_bytes: {preset.name} has no recurrent (linear_attention) layers")
    conv, K, H, Dk, Dv = lin.recurrent_shape()
    wide = str(dtype).lower() in ("fp64", "float64", "torch.float64")
    return conv * (K - 1) * element_bytes(dtype, group_size=group_size) + H * Dk * Dv * (8 if wide else 4)


class LayerKV(NamedTuple):
    """Cache of the layers of one kind (``"global"``, ``"local"`` or ``"recurrent"``: a fixed state, ``tokens``
    and ``bytes_per_token`` 0; ``"shared"``: layers reading another layer's cache, 0 bytes); bytes rounded up."""

    kind: str
    num_layers: int
    tokens: int  # cached tokens per sequence in one layer: context, or min(context, window)
    bytes_per_token: float  # one token, one layer
    bytes_per_layer: int  # batch * tokens * bytes_per_token
    total_bytes: int  # num_layers * bytes_per_layer


class KVMemory(NamedTuple):
    """KV-cache size of a model at a context length and batch.

    ``bytes_per_token`` is one token of one sequence across all layers, before any window cap (the
    cost of a token at short context). ``fits[g]`` says whether the cache alone (no weights, no
    activations) fits in ``g`` GB, GB = 1e9 bytes.
    """

    preset: str
    context: int
    batch: int
    dtype: str
    bytes_per_element: float
    bytes_per_token: float
    total_bytes: int
    layers: tuple[LayerKV, ...]
    fits: dict[int, bool]

    @property
    def by_layer_type(self) -> dict[str, int]:
        """Total bytes per layer kind, e.g. ``{"global": ..., "local": ...}``."""
        return {g.kind: g.total_bytes for g in self.layers}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict."""
        out = self._asdict()
        out["layers"] = [g._asdict() for g in self.layers]
        out["fits"] = {f"{g}GB": ok for g, ok in self.fits.items()}
        out["by_layer_type"] = self.by_layer_type
        return out


def kv_cache_memory(
    preset: ModelPreset, *, context: int, batch: int = 1, dtype: str = "bf16", group_size: int | None = None
) -> KVMemory:
    """KV-cache bytes of ``preset`` holding ``context`` tokens for each of ``batch`` sequences.

    Args:
        preset: a :class:`ModelPreset` (``PRESETS[name]`` or :func:`preset_from_hf_config`).
        context: tokens per sequence (see :func:`parse_context` for ``"128k"``).
        batch: sequences; multiplies every total.
        dtype: storage dtype, ``fp32 fp16 bf16 fp8 int8 int4 int2``.
        group_size: count an fp16 scale and zero-point per group of this many elements (int dtypes).

    Returns:
        A :class:`KVMemory`.

    Example:
        >>> from qkv.costs import PRESETS
        >>> m = kv_cache_memory(PRESETS["llama-70b-mha"], context=128_000, dtype="fp16")
        >>> m.layers[0].bytes_per_layer, m.total_bytes
        (4194304000, 335544320000)
    """
    for arg, value in (("context", context), ("batch", batch)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    c = preset.config
    if c.compressed is not None:
        return _compressed_memory(preset, context=context, batch=batch, dtype=dtype, group_size=group_size)
    if c.head_dim_by_type or c.kv_heads_by_type or c.kv_shared_from is not None:
        return _per_layer_kv_memory(preset, context=context, batch=batch, dtype=dtype, group_size=group_size)
    if c.latent is not None:
        per_token = mla_kv_bytes_per_token(
            c.latent.kv_lora_rank, c.latent.qk_rope_head_dim + (c.indexer.index_head_dim if c.indexer else 0),
            dtype=dtype, group_size=group_size,
        )  # DeepSeek Sparse Attention caches its indexer key in the same row
    else:
        per_token = gqa_kv_bytes_per_token(
            c.num_key_value_heads, preset.key_head_dim, v_head_dim=preset.value_head_dim, dtype=dtype,
            group_size=group_size,
        )
    layers = []
    for kind, n in preset.layer_counts.items():
        if kind == "recurrent":  # a fixed state per sequence: the convolution's inputs and the (Dk, Dv) states
            state = batch * recurrent_state_bytes(preset, dtype=dtype, group_size=group_size)
            layers.append(LayerKV(kind, n, 0, 0, math.ceil(state), n * math.ceil(state)))
            continue
        tokens = min(context, c.sliding_window) if kind == "local" else context
        per_layer = math.ceil(batch * tokens * per_token)
        layers.append(LayerKV(kind, n, tokens, per_token, per_layer, n * per_layer))
    total = sum(g.total_bytes for g in layers)
    return KVMemory(
        preset=preset.name,
        context=context,
        batch=batch,
        dtype=_dtype_key(dtype),
        bytes_per_element=element_bytes(dtype, group_size=group_size),
        bytes_per_token=per_token * (c.num_hidden_layers - preset.layer_counts.get("recurrent", 0)),
        total_bytes=total,
        layers=tuple(layers),
        fits={g: total <= g * GB for g in DEVICE_GB},
    )


def _compressed_memory(preset: ModelPreset, *, context: int, batch: int, dtype: str,
                       group_size: int | None) -> KVMemory:
    """DeepSeek-V4's pools (as :class:`qkv.cache.CompressedSpec` counts them): every layer's window of K = V keys
    (``"local"``), ``context // rate`` compressed entries per CSA layer (each with its indexer key) and HCA layer,
    and the compressors' carries (``"carry"``: the pending tokens of an incomplete window, CSA's previous window;
    fixed per sequence). ``bytes_per_token`` is the long-run growth: one entry per ``rate`` tokens."""
    c = preset.config
    cc, D, eb = c.compressed, c.head_dim, element_bytes(dtype, group_size=group_size)
    kinds = cc.attention_types
    window = min(context, c.sliding_window)
    layers = [LayerKV("local", len(kinds), window, D * eb, math.ceil(batch * window * D * eb),
                      len(kinds) * math.ceil(batch * window * D * eb))]
    carry = 0.0
    growth = 0.0
    for kind in ("csa", "hca"):
        n = kinds.count(kind)
        if not n:
            continue
        rate, index = cc.compress_rates[kind], cc.index_head_dim if kind == "csa" else 0
        row = (D + index) * eb
        per_layer = math.ceil(batch * (context // rate) * row)
        layers.append(LayerKV(kind, n, context // rate, row, per_layer, n * per_layer))
        widths = (D, index) if index else (D,)
        per = 2 if index else 1
        carry += n * eb * sum(2 * per * w * (rate - 1) + (2 * w * rate if index else 0) for w in widths)
        growth += n * row / rate
    if carry:
        layers.append(LayerKV("carry", len(kinds) - kinds.count("sliding"), 0, 0, 0, math.ceil(batch * carry)))
    total = sum(g.total_bytes for g in layers)
    return KVMemory(preset=preset.name, context=context, batch=batch, dtype=_dtype_key(dtype), bytes_per_element=eb,
                    bytes_per_token=growth, total_bytes=total, layers=tuple(layers),
                    fits={g: total <= g * GB for g in DEVICE_GB})


def _per_layer_kv_memory(preset: ModelPreset, *, context: int, batch: int, dtype: str,
                         group_size: int | None) -> KVMemory:
    """:func:`kv_cache_memory` of a model whose attention layers differ in shape (Gemma 4): each layer as its cache
    spec has it (:meth:`qkv.config.mixers.MixerKind.cache`): a type's own KV heads and head width, a K = V layer
    caching its values alone, and a layer reading an earlier layer's keys and values (``"shared"``) caching nothing,
    so each pool counts once."""
    c = preset.config
    groups: dict[tuple[str, int, float], int] = {}
    for i in range(c.num_hidden_layers):
        shape = mixer_of(c, i).cache(c, i)
        if shape.kind == "shared":
            key = ("shared", 0, 0.0)
        else:
            local = shape.kind == "sliding"
            heads, dim, *rest = shape.args[1:] if local else shape.args  # Hkv, D[, Dv, values only]
            tokens = min(context, shape.args[0]) if local else context
            halve = 2 if len(rest) > 1 and rest[1] else 1  # K = V: the values alone are cached
            key = ("local" if local else "global", tokens,
                   gqa_kv_bytes_per_token(heads, dim, dtype=dtype, group_size=group_size) / halve)
        groups[key] = groups.get(key, 0) + 1
    layers = []
    for (kind, tokens, per_token), n in groups.items():
        per_layer = math.ceil(batch * tokens * per_token)
        layers.append(LayerKV(kind, n, tokens, per_token, per_layer, n * per_layer))
    total = sum(g.total_bytes for g in layers)
    return KVMemory(preset=preset.name, context=context, batch=batch, dtype=_dtype_key(dtype),
                    bytes_per_element=element_bytes(dtype, group_size=group_size),
                    bytes_per_token=sum(g.num_layers * g.bytes_per_token for g in layers), total_bytes=total,
                    layers=tuple(layers), fits={g: total <= g * GB for g in DEVICE_GB})
