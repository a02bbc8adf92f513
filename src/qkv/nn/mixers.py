"""The mixer registry, module half: the class of each kind of :mod:`qkv.config.mixers`, each a
:class:`qkv.nn.mixer.DecoderMixer` (built by ``for_decoder``, called by ``mix``).

Adding a kind of layer: its module file (a class with ``for_decoder``, ``mix`` and ``score_modifiers``), one
:class:`qkv.config.mixers.MixerKind` registered in :mod:`qkv.config.mixers` and one line in :data:`_MODULES` here.

Example:
    >>> from qkv.config import get_config
    >>> build_mixer(get_config("tiny-llama"), 0, None).__class__.__name__
    'SelfAttention'
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..config.mixers import MIXERS, mixer_of
from .compressed_attention import CompressedAttention
from .dsa import SparseLatentAttention
from .gated_deltanet import GatedDeltaNet, SplitGatedDeltaNet
from .kda import KimiDeltaAttention
from .latent import LatentAttention
from .mixer import DecoderMixer
from .qsa import IndexedAttention
from .self_attention import SelfAttention

if TYPE_CHECKING:
    from ..config.decoder import DecoderConfig

__all__ = ["MIXER_MODULES", "build_mixer", "mixer_module", "register_mixer_module"]

_MODULES: dict[str, type] = {
    "attention": SelfAttention,
    "mla": LatentAttention,
    "dsa": SparseLatentAttention,
    "gated_deltanet": GatedDeltaNet,
    "gated_deltanet_split": SplitGatedDeltaNet,
    "kda": KimiDeltaAttention,
    "qsa": IndexedAttention,
    "v4_sliding": CompressedAttention,
    "csa": CompressedAttention,
    "hca": CompressedAttention,
}

#: The module class of each registered mixer kind, read-only.
MIXER_MODULES: Mapping[str, type] = MappingProxyType(_MODULES)


def register_mixer_module(name: str, cls: type) -> type:
    """Register ``cls`` as the module of the mixer kind ``name`` (first registered in :mod:`qkv.config.mixers`).
    ``ValueError`` for a kind that has no torch-free half or already has a module; ``TypeError`` for a class that
    does not follow :class:`qkv.nn.mixer.DecoderMixer`."""
    if name not in MIXERS:
        raise ValueError(f"register_mixer_module: no mixer kind {name!r} in qkv.config.mixers.MIXERS "
                         f"({', '.join(MIXERS)}); register its MixerKind there first "
                         f"(qkv.config.mixers.register_mixer)")
    if name in _MODULES:
        raise ValueError(f"register_mixer_module: the mixer kind {name!r} already has a module, "
                         f"{_MODULES[name].__name__}")
    missing = [m for m in ("for_decoder", "mix", "score_modifiers") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise TypeError(f"register_mixer_module: {cls!r} does not follow qkv.nn.mixer.DecoderMixer (missing "
                        f"{', '.join(missing) or 'a class'})")
    _MODULES[name] = cls
    return cls


def mixer_module(name: str) -> type:
    """The module class of the mixer kind ``name``; ``ValueError`` naming the registered kinds otherwise."""
    if name not in _MODULES:
        raise ValueError(f"unknown mixer kind {name!r}: no module registered (registered: {', '.join(_MODULES)}); add "
                         "one with qkv.nn.mixers.register_mixer_module")
    return _MODULES[name]


def build_mixer(config: DecoderConfig, layer_idx: int, rope: Any) -> DecoderMixer:
    """The mixer of layer ``layer_idx`` of ``config`` (``rope``: the model's rotary table of its layer type)."""
    return mixer_module(mixer_of(config, layer_idx).name).for_decoder(config, layer_idx, rope)
