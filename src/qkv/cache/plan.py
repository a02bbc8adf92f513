"""``plan_memory``: whether a request's KV cache fits a memory budget, and where the bytes go, computed
from layer specs before anything is allocated.

The arithmetic mirrors the storages exactly: dynamic contiguous buffers hold every row at the longest
row's length (left padding) and grow by doubling; static buffers hold ``max_len`` slots per row (rings of
``W + rollback`` for sliding layers); paged storage holds ``ceil(tokens / block_size)`` blocks per row
and group (sliding groups at most the blocks that cover ``W + rollback`` tokens). Quantized layers
count packed codes, float16 scales and zero-points, and the full-precision residual.

Example:
    >>> import torch
    >>> from qkv.cache import FullSpec, Paged, plan_memory
    >>> p = plan_memory([FullSpec(8, 128)] * 32, batch=4, context=[100, 900, 4000, 8000], dtype=torch.bfloat16,
    ...                 storage=Paged(block_size=16, num_blocks=4096), budget_bytes=8 * 2**30)
    >>> p.fits, p.needed_bytes == 32 * 13000 * 4096
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .paged import Paged
from .specs import CrossSpec, FullSpec, LatentSpec, LayerSpec, SlidingWindowSpec, element_bytes
from .storage import Dynamic, Static

__all__ = ["plan_memory", "MemoryPlan", "LayerPlan"]


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


def _specs_from(config) -> list[LayerSpec]:
    if hasattr(config, "cache_specs"):
        return list(config.cache_specs())
    if isinstance(config, dict):
        from ..costs import preset_from_hf_config
        config = preset_from_hf_config(config)
    if hasattr(config, "layer_types") and hasattr(config, "num_key_value_heads"):
        if getattr(config, "kv_lora_rank", None):
            return [LatentSpec(config.kv_lora_rank, config.qk_rope_head_dim)] * config.num_hidden_layers
        out: list[LayerSpec] = []
        for t in config.layer_types:
            if t == "sliding_attention":
                out.append(SlidingWindowSpec(config.sliding_window, config.num_key_value_heads, config.head_dim,
                                             config.v_head_dim))
            else:
                out.append(FullSpec(config.num_key_value_heads, config.head_dim, config.v_head_dim))
        return out
    if isinstance(config, Sequence) and all(isinstance(s, LayerSpec) for s in config):
        return list(config)
    raise TypeError(f"plan_memory: expected layer specs, a model with cache_specs(), a qkv.costs.ModelPreset or "
                    f"an HF config dict, got {type(config).__name__}")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan_memory(config_or_specs, *, batch: int = 1, context: int | Sequence[int], dtype=torch.bfloat16,
                storage=None, quant=None, policy=None, rollback: int = 0,
                budget_bytes: int | None = None) -> MemoryPlan:
    """KV-cache bytes for ``batch`` rows of ``context`` tokens, before allocating anything.

    Args:
        config_or_specs: layer specs, a model with ``cache_specs()``, a ``qkv.costs.ModelPreset`` or an
            HF config dict.
        batch: rows; ignored when ``context`` lists one length per row.
        context: tokens per row (prompt + generated), an int or one int per row.
        dtype: key/value dtype (torch dtype or name such as ``"bf16"``).
        storage: ``Dynamic()`` (default), ``Static(max_len)`` or ``Paged(...)``.
        quant: ``KIVI(...)``/``Int8()`` for full-attention layers (dynamic storage).
        policy: ``StreamingLLM``, ``H2O`` or ``SnapKV``: caps full-attention layers at ``n_sink + window``,
            ``heavy + recent`` or SnapKV's ``budget`` (the compressed prompt; SnapKV keeps generated tokens on
            top of it, so count them in ``context`` beyond the budget yourself).
        rollback: spare tokens kept by sliding layers (as in :class:`KVCache`).
        budget_bytes: memory available for the cache; sets ``fits``.

    Returns:
        :class:`MemoryPlan`.
    """
    specs = _specs_from(config_or_specs)
    if policy is not None and hasattr(policy, "apply_spec"):
        specs = [policy.apply_spec(s) for s in specs]
    lengths = [int(c) for c in context] if isinstance(context, Sequence) else [int(context)] * batch
    if not lengths or min(lengths) < 0:
        raise ValueError(f"plan_memory: context must be a non-negative int or a non-empty list of them, "
                         f"got {context!r}")
    storage = Dynamic() if storage is None else storage
    eb = element_bytes(dtype)
    B = len(lengths)
    layers, blocks, pool = [], {}, 0
    for i, spec in enumerate(specs):
        row = spec.row_elements() * eb
        cap = spec.max_tokens
        if cap is not None and isinstance(spec, SlidingWindowSpec):
            cap += rollback
        policy_cap = getattr(policy, "budget", None) or (
            (policy.heavy + policy.recent) if hasattr(policy, "heavy") else None)
        if policy_cap is not None and type(spec) is FullSpec:
            cap = policy_cap
        kept = [min(n, cap) if cap is not None else n for n in lengths]
        if isinstance(spec, CrossSpec):
            kept = [spec.source_len] * B
        needed = sum(kept) * row
        if quant is not None and type(spec) is FullSpec:
            needed = sum(_quant_bytes(quant, spec, n, eb) for n in kept)
            alloc = needed
        elif isinstance(storage, Paged) and not isinstance(spec, CrossSpec):
            T = storage.block_size
            if cap is None:
                nblk = sum(math.ceil(n / T) for n in kept)
            else:  # blocks wholly before the last `cap` tokens are released when the next step is allocated
                nblk = sum(math.ceil(n / T) - max(0, (n - 1 - cap) // T) for n in lengths)
            key = spec.window if isinstance(spec, SlidingWindowSpec) else None
            blocks[key] = max(blocks.get(key, 0), nblk)
            alloc = nblk * T * row
            pool += storage.num_blocks * T * row
        elif isinstance(storage, Static) and not isinstance(spec, CrossSpec):
            slots = storage.max_len if cap is None or cap > storage.max_len else cap
            alloc = B * slots * row
        else:
            slots = max(kept)
            alloc = B * (slots if isinstance(spec, CrossSpec) else _pow2(max(slots, 16))) * row
        layers.append(LayerPlan(i, spec.kind, max(kept), int(needed), int(alloc)))
    allocated = sum(lay.allocated_bytes for lay in layers)
    needed = sum(lay.needed_bytes for lay in layers)
    if not isinstance(storage, Paged):
        pool = allocated
    if isinstance(storage, Paged):
        blocks["pool"] = storage.num_blocks
    limit = pool if isinstance(storage, Paged) else allocated
    fits = None
    if budget_bytes is not None:
        fits = limit <= budget_bytes
        if isinstance(storage, Paged):
            fits = fits and all(v <= storage.num_blocks for k, v in blocks.items() if k != "pool")
    return MemoryPlan(fits, int(allocated), int(needed), budget_bytes, storage.describe(), tuple(layers),
                      blocks or None, int(pool))


def _quant_bytes(quant, spec: FullSpec, n: int, eb: float) -> float:
    """Bytes of one row of ``n`` tokens in a quantized full-attention layer."""
    H, D, Dv = spec.n_kv_heads, spec.head_dim, spec.dv
    bits = getattr(quant, "bits", 8)
    if hasattr(quant, "residual"):
        G, R = quant.group_size, quant.residual
        q = max(0, (n - R) // G * G)
        res = n - q
        gv = G if Dv % G == 0 else Dv
        k_bytes = q * H * D * bits / 8 + (q // G) * H * D * 4
        v_bytes = q * H * Dv * bits / 8 + q * H * (Dv // gv) * 4
        return k_bytes + v_bytes + res * H * (D + Dv) * eb
    return n * H * (D + Dv) * bits / 8 + n * H * 2 * 4
