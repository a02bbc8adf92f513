"""KV caches: layer specs say what is kept, a storage says where, a policy says what is dropped.

- specs: :class:`FullSpec`, :class:`SlidingWindowSpec`, :class:`SinkSpec`, :class:`LatentSpec`,
  :class:`CrossSpec`, :class:`RecurrentSpec`, :class:`SharedSpec` (a layer reading an earlier one's cache) (each
  reports ``bytes_per_token`` and ``fixed_bytes``);
- storages: :class:`Dynamic` (grows), :class:`Static` (preallocated, rings for sliding layers),
  :class:`Paged` (blocks, copy-on-write forks, prefix caching);
- quantizers (:class:`Quantizer`): :class:`KIVI` (int4/int2, keys per channel, values per token), :class:`Int8`;
- policies (:class:`CachePolicy`): :class:`StreamingLLM` (attention sinks), :class:`H2O` (heavy hitters),
  :class:`SnapKV`;
- :class:`KVCache`, the model-level object that implements :mod:`qkv.cache.protocol`;
- :func:`plan_memory`: will a request fit, and where do the bytes go, before allocating.

Example:
    >>> import torch
    >>> from qkv.cache import KVCache, FullSpec, SlidingWindowSpec, Paged, plan_memory
    >>> specs = [SlidingWindowSpec(1024, 8, 128)] * 5 + [FullSpec(8, 128)]   # Gemma 3's 5:1 pattern
    >>> plan = plan_memory(specs, batch=1, context=32768, dtype=torch.bfloat16)
    >>> plan.held_by_kind["full"] > plan.held_by_kind["sliding"]
    True
    >>> cache = KVCache(specs, storage=Paged(block_size=16, num_blocks=64))
"""

from .cache import CacheMemory, KVCache, LayerMemory
from .compressed import CompressedCache, CompressedSpec
from .paged import CacheFull, Paged, PoolStats, prefix_hashes
from .plan import LayerPlan, MemoryPlan, plan_memory
from .policies import H2O, SnapKV, StreamingLLM
from .protocol import (
    AttentionCache,
    CachePolicy,
    CacheView,
    CroppableCache,
    DecoderModel,
    DecodingCache,
    DeferredViewCache,
    ForkableCache,
    HasCacheSpecs,
    LatentCache,
    LatentView,
    PrefixMatchingCache,
    Quantizer,
    ResettableCache,
    RopeFn,
    RowSlots,
)
from .quant import KIVI, Int8, QuantError
from .specs import (
    CrossSpec,
    FullSpec,
    IndexedLatentSpec,
    IndexedSpec,
    LatentSpec,
    LayerSpec,
    RecurrentSpec,
    SharedSpec,
    SinkSpec,
    SlidingWindowSpec,
    element_bytes,
)
from .storage import Dynamic, Static

__all__ = [
    "KVCache", "CacheMemory", "LayerMemory",
    "LayerSpec", "FullSpec", "IndexedSpec", "SlidingWindowSpec", "SinkSpec", "LatentSpec", "IndexedLatentSpec",
    "CrossSpec",
    "RecurrentSpec", "SharedSpec", "CompressedSpec", "CompressedCache",
    "element_bytes",
    "Dynamic", "Static", "Paged", "CacheFull", "PoolStats", "prefix_hashes",
    "KIVI", "Int8", "QuantError",
    "StreamingLLM", "H2O", "SnapKV",
    "plan_memory", "MemoryPlan", "LayerPlan",
    "CacheView", "LatentView", "AttentionCache", "LatentCache", "DecoderModel", "HasCacheSpecs", "RopeFn",
    "CachePolicy", "Quantizer",
    "DecodingCache", "DeferredViewCache", "PrefixMatchingCache", "CroppableCache", "ForkableCache", "ResettableCache",
    "RowSlots",
]
