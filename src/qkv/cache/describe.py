"""Layer specs of a model description: one :mod:`qkv.cache` spec per layer of a :class:`qkv.config.DecoderConfig`
(what :func:`qkv.config.hf_config.read_layout` reads from an HF config too) or a :class:`qkv.config.ModelPreset`:
``RecurrentSpec`` for the
recurrent (``linear_attention``) layers of hybrid models, ``LatentSpec`` for MLA (``IndexedLatentSpec`` with
DeepSeek Sparse Attention's indexer key), ``SharedSpec`` for layers that read an earlier layer's keys and values
(cross-layer KV sharing), ``SlidingWindowSpec`` for local layers, ``FullSpec`` otherwise; a layer whose key
projection gives its values too (K = V) stores the values only (``values_only``). The
description (in :mod:`qkv.config`) knows
nothing of the cache; the cache reads it here.

Example:
    >>> from qkv.config import get_config
    >>> [s.kind for s in cache_specs_of(get_config("tiny-gemma"))][:2]
    ['sliding', 'full']
"""

from __future__ import annotations

from dataclasses import replace

from ..config.decoder import DecoderConfig
from ..config.mixers import CacheShape, mixer_of
from ..config.presets import ModelPreset
from .compressed import CompressedSpec
from .specs import (
    FullSpec,
    IndexedLatentSpec,
    IndexedSpec,
    LatentSpec,
    LayerSpec,
    RecurrentSpec,
    SharedSpec,
    SlidingWindowSpec,
)

__all__ = ["cache_specs_of", "spec_of"]

#: The layer spec class of each cache kind a mixer declares (:data:`qkv.config.mixers.CACHE_KINDS`).
_SPECS: dict[str, type[LayerSpec]] = {"full": FullSpec, "indexed": IndexedSpec, "sliding": SlidingWindowSpec,
                                      "latent": LatentSpec,
                                      "indexed_latent": IndexedLatentSpec, "recurrent": RecurrentSpec,
                                      "shared": SharedSpec, "compressed": CompressedSpec}


def spec_of(shape: CacheShape) -> LayerSpec:
    """The :mod:`qkv.cache` layer spec of a mixer's :class:`qkv.config.mixers.CacheShape`.

    Example:
        >>> spec_of(CacheShape("sliding", (8, 2, 16))).max_tokens
        8
    """
    if not isinstance(shape, CacheShape) or shape.kind not in _SPECS:
        raise ValueError(f"spec_of: expected a qkv.config.mixers.CacheShape of kind {', '.join(_SPECS)}, got {shape!r}")
    return _SPECS[shape.kind](*shape.args)


def cache_specs_of(description: DecoderConfig | ModelPreset, *, values_only: bool = True) -> list[LayerSpec]:
    """One layer spec per layer of ``description`` (what :meth:`qkv.nn.DecoderLM.cache_specs` returns for its
    config: each layer's mixer declares its cache, :mod:`qkv.config.mixers`); a preset through its
    :attr:`~qkv.config.ModelPreset.description`; ``TypeError`` for anything else. ``values_only=False``: K = V
    layers store keys and values apart (twice the bytes; what eviction policies and quantized caches need) instead
    of the values alone."""
    if not isinstance(values_only, bool):
        raise TypeError(f"cache_specs_of: values_only must be a bool, got {values_only!r}")
    if isinstance(description, DecoderConfig):
        c = description
        specs = [spec_of(mixer_of(c, i).cache(c, i)) for i in range(c.num_hidden_layers)]
        return specs if values_only else [replace(s, values_only=False) if getattr(s, "values_only", False) else s
                                          for s in specs]
    if isinstance(description, ModelPreset):
        return cache_specs_of(description.description, values_only=values_only)
    raise TypeError(f"cache_specs_of: expected a qkv.config.DecoderConfig or ModelPreset, got "
                    f"{type(description).__name__}")
