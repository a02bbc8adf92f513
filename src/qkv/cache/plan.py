"""``plan_memory``: whether a request's KV cache fits a memory budget, and where the bytes go, computed
before anything is allocated, from layer specs, a model, a model config, a preset name or an HF config.

The plan describes a :class:`qkv.cache.KVCache` after a prompt of ``context - new_tokens`` tokens was
prefilled in one step and ``new_tokens`` tokens were decoded one at a time, as ``generate`` does. Its
``needed_bytes`` equal ``cache.memory().used_bytes`` then, for every storage, quantizer and policy (the
quantizer says its bytes, ``Quantizer.bytes_for``; the policy its cap, ``CachePolicy.token_cap``, applied
from the first generated token on, since policies evict on a layer's next update). The allocation mirrors
each storage: dynamic contiguous buffers hold every row at the longest row's length (left padding) and
grow by doubling, with an int64 position per slot; static buffers hold ``max_len`` slots per row (rings of
``W + rollback`` for sliding layers); paged storage holds ``ceil(tokens / block_size)`` blocks per row and
group (sliding groups at most the blocks that cover ``W + rollback`` tokens); quantized layers as their
quantizer says (``Quantizer.allocated_for``); evicting layers as the store their policy gives them says
(``Store.planned_bytes``, the bytes held when a store does not say).

Example:
    >>> import torch
    >>> from qkv.cache import FullSpec, Paged, plan_memory
    >>> p = plan_memory([FullSpec(8, 128)] * 32, batch=4, context=[100, 900, 4000, 8000], dtype=torch.bfloat16,
    ...                 storage=Paged(block_size=16, num_blocks=4096), budget_bytes=8 * 2**30)
    >>> p.fits, p.needed_bytes == 32 * 13000 * 4096
    (True, True)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from ..config.decoder import DecoderConfig
from ..config.hf_config import description_dtype, read_layout
from ..config.presets import ModelPreset, get_preset
from .compressed import CompressedSpec
from .describe import cache_specs_of
from .paged import Paged
from .protocol import CachePolicy, HasCacheSpecs, Quantizer
from .specs import CrossSpec, FullSpec, LayerSpec, RecurrentSpec, SharedSpec, SlidingWindowSpec, element_bytes
from .storage import Dynamic, Static

__all__ = ["plan_memory", "MemoryPlan", "LayerPlan", "resolve_specs"]


class LayerPlan(NamedTuple):
    layer: int
    kind: str
    tokens: int  # tokens kept per row (longest row)
    needed_bytes: int  # bytes of the real tokens of every row
    allocated_bytes: int  # what the storage allocates for them


class MemoryPlan(NamedTuple):
    """The KV-cache bytes of one request. ``fits`` is ``None`` without a budget."""

    fits: bool | None
    allocated_bytes: int
    needed_bytes: int
    budget_bytes: int | None
    storage: str
    layers: tuple[LayerPlan, ...]
    blocks: dict | None  # paged: blocks needed per group (window, None = full) and the pool size
    pool_bytes: int  # paged: the preallocated pools; otherwise equal to allocated_bytes

    @property
    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lay in self.layers:
            out[lay.kind] = out.get(lay.kind, 0) + lay.allocated_bytes
        return out

    @property
    def held_by_kind(self) -> dict[str, int]:
        """Bytes holding real tokens per layer kind (``needed_bytes`` split by kind)."""
        out: dict[str, int] = {}
        for lay in self.layers:
            out[lay.kind] = out.get(lay.kind, 0) + lay.needed_bytes
        return out

    @property
    def wasted_fraction(self) -> float:
        return 1 - self.needed_bytes / self.allocated_bytes if self.allocated_bytes else 0.0

    def __str__(self) -> str:
        lines = [f"KV cache plan ({self.storage}): allocated {_fmt(self.allocated_bytes)}, "
                 f"needed {_fmt(self.needed_bytes)} ({100 * self.wasted_fraction:.1f}% waste)"]
        for kind, b in self.by_kind.items():
            lines.append(f"  {kind:<14} {_fmt(b)}")
        if self.budget_bytes is not None:
            lines.append(f"  budget {_fmt(self.budget_bytes)}: {'fits' if self.fits else 'does NOT fit'}")
        return "\n".join(lines)


def _fmt(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{int(b)} B"


def _model_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def resolve_specs(config) -> tuple[list[LayerSpec], torch.dtype | str]:
    """The layer specs of what ``plan_memory`` accepts, and the dtype its cache holds by default.

    The default dtype, one rule: a model (``torch.nn.Module`` with ``cache_specs()``) caches in its
    parameters' dtype; a qkv model config (:class:`qkv.nn.DecoderConfig`, or anything with ``cache_specs()``) in torch's
    default dtype, the dtype ``DecoderLM(config)`` is built in; every other description (an HF config dict,
    ``transformers`` config or ``config.json`` path, a preset name, a :class:`qkv.config.ModelPreset`, layer
    specs) in the dtype it declares (HF's ``dtype``/``torch_dtype``), else bfloat16, the dtype published
    checkpoints ship and serve in (:func:`qkv.config.hf_config.description_dtype`)."""
    if isinstance(config, torch.nn.Module) and isinstance(config, HasCacheSpecs):
        return list(config.cache_specs()), _model_dtype(config)
    if isinstance(config, HasCacheSpecs):
        return list(config.cache_specs()), torch.get_default_dtype()
    if isinstance(config, DecoderConfig):
        return cache_specs_of(config), torch.get_default_dtype()
    dtype = _torch_dtype(description_dtype(config))
    if isinstance(config, (str, os.PathLike)) and not os.path.exists(config):
        config = get_preset(config)
    if isinstance(config, ModelPreset):
        return cache_specs_of(config), dtype
    if isinstance(config, (Mapping, str, os.PathLike)) or _is_transformers_config(config):
        return cache_specs_of(read_layout(config)), dtype
    if isinstance(config, Sequence) and not isinstance(config, (str, bytes)) and all(
            isinstance(s, LayerSpec) for s in config):
        return list(config), dtype
    raise TypeError(f"plan_memory: expected layer specs, a model with cache_specs(), a model config (qkv.nn."
                    f"DecoderConfig), a preset name, a qkv.config.ModelPreset or an HF config, got "
                    f"{type(config).__name__}")


def _torch_dtype(name: str) -> torch.dtype | str:
    """``"bfloat16"`` -> ``torch.bfloat16``; a name torch has no dtype for stays a name (``element_bytes`` reads it)."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else name


def _is_transformers_config(config) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(config, transformers.PretrainedConfig)


def _kept(spec: LayerSpec, lengths: list[int], policy, new_tokens: int, rollback: int) -> list[int]:
    """Real tokens each row holds in a layer."""
    if isinstance(spec, CrossSpec):
        return [spec.source_len] * len(lengths)
    cap = spec.max_tokens
    if cap is not None and isinstance(spec, SlidingWindowSpec):
        cap += rollback
    if policy is not None:
        policy_cap = policy.token_cap(spec, new_tokens)
        if policy_cap is not None:  # the policy owns the layer: nothing is evicted before the first new token
            cap = policy_cap if new_tokens > 0 else None
    return [min(n, cap) if cap is not None else n for n in lengths]


def _keep(spec: LayerSpec, rollback: int) -> int | None:
    """Tokens a bounded layer's store keeps (its window plus ``rollback`` for sliding layers)."""
    if spec.max_tokens is None:
        return None
    return spec.max_tokens + (rollback if isinstance(spec, SlidingWindowSpec) else 0)


def plan_memory(config_or_specs, *, batch: int = 1, context: int | Sequence[int], dtype=None, storage=None,
                quant=None, policy=None, rollback: int = 0, new_tokens: int = 0,
                budget_bytes: int | None = None) -> MemoryPlan:
    """KV-cache bytes for ``batch`` rows of ``context`` tokens, before allocating anything.

    Args:
        config_or_specs: layer specs, a model (``DecoderLM``), a model config (``qkv.nn.DecoderConfig``), a
            preset name (``"llama-3-70b"``) or HF ``config.json`` path, a ``qkv.costs.ModelPreset``, or an HF
            config (dict or ``transformers.PretrainedConfig``).
        batch: rows; ignored when ``context`` lists one length per row.
        context: tokens per row (prompt + generated), an int or one int per row.
        dtype: key/value dtype (torch dtype or name such as ``"bf16"``). Default, one rule
            (:func:`resolve_specs`): a model's parameter dtype; for a ``DecoderConfig`` torch's default dtype
            (what ``DecoderLM`` builds in); for every other description the dtype it declares (an HF config's
            ``dtype``/``torch_dtype``), else bfloat16.
        storage: ``Dynamic()`` (default), ``Static(max_len)`` or ``Paged(...)``.
        quant: a :class:`qkv.cache.Quantizer` (``KIVI(...)``, ``Int8()``) for full-attention layers.
        policy: a :class:`qkv.cache.CachePolicy` (``StreamingLLM``, ``H2O``, ``SnapKV``, or your own).
        rollback: spare tokens kept by sliding layers (as in :class:`KVCache`).
        new_tokens: of ``context``, the tokens decoded one at a time after the prompt's one prefill step
            (policies cap layers from the first one on; dynamic buffers grow accordingly).
        budget_bytes: memory available for the cache; sets ``fits``.

    Returns:
        :class:`MemoryPlan`.
    """
    specs, model_dtype = resolve_specs(config_or_specs)
    _check_extensions(policy, quant)
    lengths = _lengths(context, batch)
    if not isinstance(new_tokens, int) or not 0 <= new_tokens <= min(lengths):
        raise ValueError(f"plan_memory: new_tokens must be an int in [0, shortest context = {min(lengths)}], got "
                         f"{new_tokens!r}")
    indexed = [i for i, s in enumerate(specs) if getattr(s, "index_tail", 0)]  # IndexedSpec layers
    if indexed and (policy is not None or quant is not None):  # KVCache refuses them the same way
        raise ValueError(f"plan_memory: layers {indexed} keep an indexer key in their value rows (IndexedSpec), "
                         f"which {'policy' if policy is not None else 'quant'}={policy or quant!r} does not support")
    values_only = [i for i, s in enumerate(specs) if getattr(s, "values_only", False)]
    if values_only and (policy is not None or quant is not None):  # KVCache refuses them the same way
        raise ValueError(f"plan_memory: layers {values_only} store their values only (K = V), which "
                         f"{'policy' if policy is not None else 'quant'}={policy or quant!r} does not support; plan "
                         f"the specs with keys stored: model.cache_specs(values_only=False)")
    if policy is not None:
        specs = [policy.apply_spec(s) for s in specs]
    storage = Dynamic() if storage is None else storage
    dtype = model_dtype if dtype is None else dtype
    eb = element_bytes(dtype)
    B, longest = len(lengths), max(lengths)
    layers, blocks, pool = [], {}, 0
    for i, spec in enumerate(specs):
        if isinstance(spec, SharedSpec):  # reads an earlier layer's pool, counted there once
            layers.append(LayerPlan(i, spec.kind, 0, 0, 0))
            continue
        if isinstance(spec, RecurrentSpec):  # a fixed state per row, whatever the context or storage
            state = B * spec.fixed_bytes(dtype)
            layers.append(LayerPlan(i, spec.kind, 0, int(state), int(state)))
            continue
        if isinstance(spec, CompressedSpec):  # DeepSeek-V4: every pool (window, entries, indexer keys, carries)
            needed = sum(spec.bytes_for(n, dtype) for n in lengths)
            layers.append(LayerPlan(i, spec.kind, max(spec.tokens_for(n) for n in lengths), int(needed), int(needed)))
            continue
        row = spec.row_elements() * eb
        kept = _kept(spec, lengths, policy, new_tokens, rollback)
        needed = sum(kept) * row
        if quant is not None and type(spec) is FullSpec:  # rows in lockstep: each holds the longest row's slots
            needed = sum(quant.bytes_for(spec, n, dtype) for n in kept)
            alloc = B * quant.allocated_for(spec, max(kept), dtype)
        elif policy is not None and (store := policy.store_for(spec, layer=f"layer {i}")) is not None:
            peak = max(longest - new_tokens, max(kept))  # the prompt is held whole until the first eviction
            alloc = store.planned_bytes(batch=B, peak=peak, spec=spec, dtype=dtype)
            alloc = needed if alloc is None else alloc
        elif isinstance(spec, CrossSpec):
            alloc = B * spec.source_len * row
        elif isinstance(storage, Paged):
            nblk = storage.layer_blocks(lengths, _keep(spec, rollback))
            key = spec.window if isinstance(spec, SlidingWindowSpec) else None
            blocks[key] = max(blocks.get(key, 0), nblk)
            alloc = nblk * storage.block_size * row
            pool += storage.num_blocks * storage.block_size * row
        elif isinstance(storage, Static):
            alloc = storage.layer_bytes(batch=B, keep=_keep(spec, rollback), row_bytes=row)
        else:
            alloc = storage.layer_bytes(batch=B, prompt=longest - new_tokens, new_tokens=new_tokens,
                                        keep=_keep(spec, rollback), row_bytes=row)
        layers.append(LayerPlan(i, spec.kind, max(kept), int(needed), int(alloc)))
    return _summarize(layers, blocks, pool, storage, budget_bytes)


def _check_extensions(policy, quant) -> None:
    if policy is not None and not isinstance(policy, CachePolicy):
        raise TypeError(f"plan_memory(policy): {type(policy).__name__} does not follow qkv.cache.CachePolicy "
                        f"(apply_spec, store_for, token_cap)")
    if quant is not None and not isinstance(quant, Quantizer):
        raise TypeError(f"plan_memory(quant): {type(quant).__name__} does not follow qkv.cache.Quantizer "
                        f"(store_for, bytes_for, allocated_for)")


def _lengths(context, batch: int) -> list[int]:
    if isinstance(context, Sequence) and not isinstance(context, (str, bytes)):
        lengths = list(context)
    else:
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"plan_memory: batch must be a positive int, got {batch!r}")
        lengths = [context] * batch
    if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in lengths):
        raise ValueError(f"plan_memory: context must be a non-negative int or a non-empty list of them, "
                         f"got {context!r}")
    return lengths


def _summarize(layers: list[LayerPlan], blocks: dict, pool: float, storage, budget_bytes) -> MemoryPlan:
    allocated = sum(lay.allocated_bytes for lay in layers)
    needed = sum(lay.needed_bytes for lay in layers)
    paged = isinstance(storage, Paged)
    if paged:
        blocks["pool"] = storage.num_blocks
    else:
        pool = allocated
    fits = None
    if budget_bytes is not None:
        fits = (pool if paged else allocated) <= budget_bytes
        if paged:
            fits = fits and all(v <= storage.num_blocks for k, v in blocks.items() if k != "pool")
    return MemoryPlan(fits, int(allocated), int(needed), budget_bytes, storage.describe(), tuple(layers),
                      blocks or None, int(pool))
