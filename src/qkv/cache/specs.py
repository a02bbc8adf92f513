"""Layer specs: what one attention layer keeps in its KV cache, and what that costs.

A spec is a frozen description, one per layer (``model.cache_specs()``). A storage decides where the
kept tokens live (:mod:`qkv.cache.storage`, :mod:`qkv.cache.paged`) and a policy what is dropped
(:mod:`qkv.cache.policies`). Because the cache is built from specs, a hybrid model (Gemma 3: five
sliding-window layers per global layer) gets its savings without a per-model cache class.

- :class:`FullSpec`: every token, keys and values per KV head (MHA, GQA: Ainslie et al. 2023, MQA); with
  ``values_only``, where one projection gives both (K = V, Gemma 4's global layers), only the values: the layer
  derives its keys from them each step (half the bytes).
- :class:`SlidingWindowSpec`: the last ``window`` tokens (Mistral's rolling buffer, Jiang et al. 2023,
  arXiv:2310.06825). ``window`` counts the query itself, as ``masks.positions(window=W)`` and HF's
  ``sliding_window`` do, so at most ``W`` tokens are ever needed.
- :class:`SinkSpec`: the first ``n_sink`` tokens ("attention sinks") plus the last ``window`` tokens,
  keys stored before RoPE and rotated by their position inside the cache (StreamingLLM, Xiao et al.
  2023, arXiv:2309.17453).
- :class:`LatentSpec`: Multi-head Latent Attention caches one compressed latent ``c_kv`` and one
  decoupled RoPE key ``k_rope`` per token, shared by all heads (DeepSeek-V2, arXiv:2405.04434, 2.1.2).
- :class:`IndexedLatentSpec`: MLA's row plus DeepSeek Sparse Attention's indexer key (DeepSeek-V3.2).
- :class:`IndexedSpec`: a full layer's keys and values plus one indexer key per token, shared by the layer's heads
  (MiniMax-M3's MSA), carried in the tail of the value rows so that paging, prefix sharing, crop and fork keep it
  with its token.
- :class:`CrossSpec`: encoder keys/values, computed once from ``source_len`` encoder tokens.
- :class:`SharedSpec`: a layer that reads another layer's keys and values instead of writing its own (cross-layer
  KV sharing: Brandon et al. 2024, "Reducing Transformer Key-Value Cache Size with Cross-Layer Attention",
  arXiv:2405.12981; Gemma 4's ``num_kv_shared_layers``). It allocates nothing and costs no bytes; its ``source``
  is an earlier layer with the same window and head shape, whose pool is counted once.
- :class:`RecurrentSpec`: a recurrent layer (Gated DeltaNet, Kimi Delta Attention, Mamba2; see
  :mod:`qkv.linear`): the short convolution's last ``conv_kernel - 1`` inputs and a ``(Dk, Dv)`` state per
  head, the same bytes at any context length; written with ``cache.update_recurrent``.

Cost: ``bytes_per_token(dtype)`` is what one more token of one sequence adds once the layer is past
its fixed part; ``fixed_bytes(dtype)`` is the bounded part. A sliding layer is all fixed
(``window`` tokens, 0 per token beyond); a full layer is all per-token. ``bytes_for(context, dtype)``
gives the bytes for one sequence holding ``context`` tokens.

Example:
    >>> import torch
    >>> from qkv.cache import FullSpec, SlidingWindowSpec
    >>> FullSpec(8, 128).bytes_per_token(torch.bfloat16)
    4096
    >>> s = SlidingWindowSpec(4096, 8, 128)
    >>> s.bytes_per_token(torch.bfloat16), s.fixed_bytes(torch.bfloat16)
    (0, 16777216)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..costs.memory import element_bytes  # the one count (a torch dtype or a name); scales are the quantizer's

__all__ = ["LayerSpec", "FullSpec", "IndexedSpec", "SlidingWindowSpec", "SinkSpec", "LatentSpec", "IndexedLatentSpec",
           "CrossSpec", "RecurrentSpec",
           "SharedSpec", "element_bytes"]



def _whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _positive(name: str, value, *, allow_zero: bool = False) -> None:
    lo = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


class LayerSpec:
    """Base of the layer specs. Subclasses are frozen dataclasses."""

    #: Most tokens of one sequence the layer ever keeps (``None``: unbounded).
    max_tokens: int | None = None

    def row_elements(self) -> int:
        """Elements stored per cached token of one sequence."""
        raise NotImplementedError

    def row_bytes(self, dtype: torch.dtype | str) -> int | float:
        """Bytes of one cached token of one sequence."""
        return _whole(self.row_elements() * element_bytes(dtype))

    def bytes_per_token(self, dtype: torch.dtype | str) -> int | float:
        """Bytes one more token adds to one sequence's cache beyond ``fixed_bytes``."""
        return 0 if self.max_tokens is not None else self.row_bytes(dtype)

    def fixed_bytes(self, dtype: torch.dtype | str) -> int | float:
        """Bytes of the bounded part of one sequence's cache (its cap, for bounded layers)."""
        return 0 if self.max_tokens is None else _whole(self.max_tokens * self.row_elements() * element_bytes(dtype))

    def tokens_for(self, context: int) -> int:
        """Tokens kept for one sequence that has seen ``context`` tokens."""
        return context if self.max_tokens is None else min(context, self.max_tokens)

    def bytes_for(self, context: int, dtype: torch.dtype | str) -> int | float:
        """Bytes for one sequence that has seen ``context`` tokens."""
        return _whole(self.tokens_for(context) * self.row_elements() * element_bytes(dtype))

    @property
    def kind(self) -> str:
        """``"full"``, ``"sliding"``, ``"sink"``, ``"latent"`` or ``"cross"``."""
        return _KINDS[type(self).__name__]


class _KVSpec(LayerSpec):
    """Layers that keep per-head keys and values: ``n_kv_heads`` heads of ``head_dim`` keys and ``dv`` values; with
    ``values_only`` (K = V, Gemma 4's global layers) the values alone, the keys derived from them when read."""

    values_only: bool = False

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    def row_elements(self) -> int:
        return self.n_kv_heads * (self.dv if self.values_only else self.head_dim + self.dv)


def _check_heads(spec) -> None:
    _positive("n_kv_heads", spec.n_kv_heads)
    _positive("head_dim", spec.head_dim)
    if spec.v_head_dim is not None:
        _positive("v_head_dim", spec.v_head_dim)
    if not isinstance(spec.values_only, bool):
        raise ValueError(f"values_only must be a bool, got {spec.values_only!r}")
    if spec.values_only and spec.dv != spec.head_dim:
        raise ValueError(f"values_only (keys derived from the stored values, K = V) needs keys and values of one "
                         f"width; got head_dim={spec.head_dim}, v_head_dim={spec.v_head_dim}")


@dataclass(frozen=True)
class FullSpec(_KVSpec):
    """Every token: a key ``(head_dim)`` and a value ``(v_head_dim or head_dim)`` per KV head; with
    ``values_only`` the value alone (the layer derives its keys from it: ``KVCache.update(..., keys_from_values=)``).
    """

    n_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    values_only: bool = False

    def __post_init__(self) -> None:
        _check_heads(self)


@dataclass(frozen=True)
class IndexedSpec(FullSpec):
    """Every token: a key and a value per KV head, plus one indexer key of ``index_head_dim`` shared by the layer's
    heads (MiniMax-M3's MSA: the indexer scores cached tokens by it to pick key blocks). The indexer key rides in the
    value rows' tail: each head's stored value row is ``value_width + index_tail`` wide, head h's tail holding
    channels ``[h t, (h + 1) t)`` of the indexer key (``t = index_tail = ceil(index_head_dim / n_kv_heads)``, the
    last head's zero-padded), so every store, paged pool, prefix share, crop and fork keeps it with its token. ``dv``
    is that stored width (what ``update`` takes as values); the layer splits the view (:meth:`split_values`)."""

    index_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.values_only is not False:
            raise ValueError("IndexedSpec: values_only is not defined for an indexed layer (its values carry the "
                             "indexer key); store keys and values")
        super().__post_init__()
        _positive("IndexedSpec(index_head_dim)", self.index_head_dim)

    @property
    def value_width(self) -> int:
        """The attention values' width per head (``v_head_dim or head_dim``)."""
        return self.v_head_dim or self.head_dim

    @property
    def index_tail(self) -> int:
        """Indexer-key channels each head's value row carries."""
        return -(-self.index_head_dim // self.n_kv_heads)

    @property
    def dv(self) -> int:
        return self.value_width + self.index_tail

    def pack_values(self, v: torch.Tensor, index_keys: torch.Tensor) -> torch.Tensor:
        """Values ``(B, Hkv, N, value_width)`` and indexer keys ``(B, N, index_head_dim)`` -> the stored values
        ``(B, Hkv, N, dv)``."""
        B, H, N, _ = v.shape
        t = self.index_tail
        tail = torch.nn.functional.pad(index_keys.to(v.dtype), (0, H * t - self.index_head_dim))
        return torch.cat((v, tail.view(B, N, H, t).transpose(1, 2)), dim=-1)

    def split_values(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored values ``(B, Hkv, S, dv)`` -> ``(values (B, Hkv, S, value_width), indexer keys (B, S,
        index_head_dim))`` (views where they can be)."""
        B, H, S, _ = stored.shape
        keys = stored[..., self.value_width:].transpose(1, 2).reshape(B, S, H * self.index_tail)
        return stored[..., :self.value_width], keys[..., :self.index_head_dim]


@dataclass(frozen=True)
class SlidingWindowSpec(_KVSpec):
    """The last ``window`` tokens (the query itself included): at most ``window`` tokens ever kept."""

    window: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    values_only: bool = False

    def __post_init__(self) -> None:
        _positive("SlidingWindowSpec(window)", self.window)
        _check_heads(self)

    @property
    def max_tokens(self) -> int:  # type: ignore[override]
        return self.window


@dataclass(frozen=True)
class SinkSpec(_KVSpec):
    """StreamingLLM: the first ``n_sink`` tokens plus the last ``window`` tokens; keys kept un-rotated
    and rotated at their in-cache position, so positions never exceed ``n_sink + window``."""

    n_sink: int
    window: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        _positive("SinkSpec(n_sink)", self.n_sink, allow_zero=True)
        _positive("SinkSpec(window)", self.window)
        _check_heads(self)

    @property
    def max_tokens(self) -> int:  # type: ignore[override]
        return self.n_sink + self.window


@dataclass(frozen=True)
class LatentSpec(LayerSpec):
    """MLA: per token one latent ``c_kv`` (``kv_lora_rank``) and one RoPE key (``qk_rope_head_dim``),
    shared by every head. Written with ``cache.update_latent``."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    def __post_init__(self) -> None:
        _positive("LatentSpec(kv_lora_rank)", self.kv_lora_rank)
        _positive("LatentSpec(qk_rope_head_dim)", self.qk_rope_head_dim, allow_zero=True)

    def row_elements(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def tail_width(self) -> int:
        """Channels after the latent in one cached row (what ``update_latent`` takes as ``k_rope``)."""
        return self.row_elements() - self.kv_lora_rank


@dataclass(frozen=True)
class IndexedLatentSpec(LatentSpec):
    """DeepSeek Sparse Attention (DeepSeek-V3.2): MLA's latent and RoPE key plus the lightning indexer's key
    (``index_head_dim``) per token, kept in one row. ``cache.update_latent`` takes ``k_rope`` as the row's tail
    ``[k_rope | indexer key]`` (``tail_width`` channels); see :class:`qkv.nn.SparseLatentAttention`."""

    index_head_dim: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("IndexedLatentSpec(index_head_dim)", self.index_head_dim)

    def row_elements(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim


@dataclass(frozen=True)
class CrossSpec(_KVSpec):
    """Cross attention: keys/values of ``source_len`` encoder tokens, computed once per request
    (``cache.cross_kv``). Decoding adds nothing."""

    n_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    source_len: int = 0

    def __post_init__(self) -> None:
        _check_heads(self)
        _positive("CrossSpec(source_len)", self.source_len, allow_zero=True)


    def bytes_per_token(self, dtype) -> int:
        return 0

    def fixed_bytes(self, dtype) -> int | float:
        return _whole(self.source_len * self.row_elements() * element_bytes(dtype))

    def tokens_for(self, context: int) -> int:
        return self.source_len

    def bytes_for(self, context: int, dtype) -> int | float:
        return self.fixed_bytes(dtype)


@dataclass(frozen=True)
class RecurrentSpec(LayerSpec):
    """A recurrent layer: the convolution's last ``conv_kernel - 1`` inputs of ``conv_dim`` channels (in the
    cache dtype) and a ``(head_k_dim, head_v_dim)`` state per head (float32, float64 for a float64 cache: the
    dtype the gated rules accumulate in). Nothing per token: its bytes do not grow with the context.

    ``side``: the per-row shapes of more fixed-size state kept with the layer's (Qwen4-Exp's Per-Layer Embedding
    before the layer: its n-gram context and its convolution's last inputs), the first ``side_ints`` of them int64
    (token ids), the others in the cache dtype; ``update_recurrent`` then takes ``(conv, recurrent, *side)``."""

    conv_dim: int
    conv_kernel: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    side: tuple[tuple[int, ...], ...] = ()
    side_ints: int = 0

    def __post_init__(self) -> None:
        _positive("RecurrentSpec(conv_dim)", self.conv_dim, allow_zero=True)
        _positive("RecurrentSpec(conv_kernel)", self.conv_kernel)
        _positive("RecurrentSpec(num_heads)", self.num_heads)
        _positive("RecurrentSpec(head_k_dim)", self.head_k_dim)
        _positive("RecurrentSpec(head_v_dim)", self.head_v_dim)
        if not isinstance(self.side, tuple) or not all(
                isinstance(shape, tuple) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                 for n in shape) for shape in self.side):
            raise ValueError(f"RecurrentSpec(side) must be a tuple of per-row shapes (tuples of ints >= 0), got "
                             f"{self.side!r}")
        _positive("RecurrentSpec(side_ints)", self.side_ints, allow_zero=True)
        if self.side_ints > len(self.side):
            raise ValueError(f"RecurrentSpec(side_ints)={self.side_ints} counts more int64 parts than side has "
                             f"({len(self.side)})")

    @property
    def max_tokens(self) -> int:  # type: ignore[override]
        return 0

    def row_elements(self) -> int:
        return 0

    def conv_elements(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

    def state_elements(self) -> int:
        return self.num_heads * self.head_k_dim * self.head_v_dim

    def side_bytes(self, dtype: torch.dtype | str) -> int | float:
        """Bytes of one row's ``side`` state: its int64 parts and the others in ``dtype``."""
        sizes = [math.prod(shape) for shape in self.side]
        return _whole(8 * sum(sizes[:self.side_ints]) + element_bytes(dtype) * sum(sizes[self.side_ints:]))

    def fixed_bytes(self, dtype: torch.dtype | str) -> int | float:
        wide = dtype == torch.float64 or (isinstance(dtype, str) and dtype.lower() in ("fp64", "float64"))
        return _whole(self.conv_elements() * element_bytes(dtype) + self.state_elements() * (8 if wide else 4)
                      + self.side_bytes(dtype))

    def tokens_for(self, context: int) -> int:
        return 0

    def bytes_for(self, context: int, dtype: torch.dtype | str) -> int | float:
        return self.fixed_bytes(dtype)


@dataclass(frozen=True)
class SharedSpec(LayerSpec):
    """A layer that attends over layer ``source``'s cache (an earlier layer) and stores nothing itself.

    ``window`` (None: full attention), ``n_kv_heads`` and ``head_dim`` are what the layer reads; the cache checks
    them against the source's spec, so a shared layer cannot point at a layer of another type or shape.

    Example:
        >>> import torch
        >>> s = SharedSpec(0, None, 2, 16)
        >>> s.kind, s.bytes_per_token(torch.bfloat16), s.fixed_bytes(torch.bfloat16)
        ('shared', 0, 0)
    """

    source: int
    window: int | None
    n_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _positive("SharedSpec(source)", self.source, allow_zero=True)
        if self.window is not None:
            _positive("SharedSpec(window)", self.window)
        _positive("SharedSpec(n_kv_heads)", self.n_kv_heads)
        _positive("SharedSpec(head_dim)", self.head_dim)

    @property
    def max_tokens(self) -> int:  # type: ignore[override]
        return 0

    def row_elements(self) -> int:
        return 0

    def tokens_for(self, context: int) -> int:
        return 0

    def matches(self, spec: LayerSpec) -> bool:
        """Whether ``spec`` (the source's) holds what this layer reads: same window, KV heads and head width."""
        return (isinstance(spec, (FullSpec, SlidingWindowSpec)) and getattr(spec, "window", None) == self.window
                and spec.n_kv_heads == self.n_kv_heads and spec.head_dim == self.head_dim
                and spec.dv == self.head_dim)


_KINDS = {"FullSpec": "full", "IndexedSpec": "full", "SlidingWindowSpec": "sliding", "SinkSpec": "sink",
          "LatentSpec": "latent",
          "IndexedLatentSpec": "latent", "CrossSpec": "cross", "RecurrentSpec": "recurrent", "SharedSpec": "shared",
          "CompressedSpec": "compressed"}
