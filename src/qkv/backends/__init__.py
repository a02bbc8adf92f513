"""The backend registry. Built-in backends are imported on first use, so ``import qkv`` stays light.

Example:
    >>> from qkv import backends
    >>> "reference" in backends.names()
    True
"""

from __future__ import annotations

import importlib

from .base import Backend, Estimate

__all__ = ["Backend", "Estimate", "get", "names", "register", "generation", "state_changed"]

# name -> "module:Class", in the order auto-dispatch lists them.
_BUILTIN: dict[str, str] = {
    "cpu_decode": "qkv.backends.cpu_decode:CPUDecodeBackend",
    "sdpa": "qkv.backends.sdpa:SDPABackend",
    "tiled": "qkv.backends.tiled:TiledBackend",
    "flex": "qkv.backends.flex:FlexBackend",
    "triton": "qkv.backends.triton:TritonBackend",
    "gather": "qkv.backends.gather:GatherBackend",
    "reference": "qkv.backends.reference:ReferenceBackend",
    "paged": "qkv.backends.paged:PagedBackend",
}
_loaded: dict[str, Backend] = {}
_generation = 0


def generation() -> int:
    """A counter that moves whenever a backend is registered or a backend's cost picture changes (a
    kernel compiled): ``backend="auto"`` keeps its per-shape decisions while it stays the same."""
    return _generation


def state_changed() -> None:
    """Called by a backend whose estimates just changed (it compiled a new kernel), and by ``register``."""
    global _generation
    _generation += 1


def names() -> list[str]:
    """Every registered backend name."""
    return list(dict.fromkeys([*_BUILTIN, *_loaded]))


def register(backend: Backend) -> None:
    """Add a backend instance under ``backend.name`` (replacing one of the same name)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register: expected a qkv.backends.Backend, got {type(backend).__name__}")
    _loaded[backend.name] = backend
    state_changed()


def get(name: str) -> Backend:
    """The backend called ``name``; ``ValueError`` listing the valid names otherwise."""
    if name in _loaded:
        return _loaded[name]
    if name not in _BUILTIN:
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(['auto', *names()])}")
    module, cls = _BUILTIN[name].split(":")
    _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]
