"""Real models on qkv: load HF checkpoints, generate, verify caches.

Family modules (``family_*.py``) register the HF ``model_type`` values they build in
``loading.FAMILIES``; ``from_hf`` finds them.
"""

from __future__ import annotations

import importlib

from .loading import FAMILIES, CheckpointError, from_hf

__all__ = ["from_hf", "FAMILIES", "CheckpointError", "generate", "verify_cache"]

_LAZY = {"generate": "qkv.models.generate", "verify_cache": "qkv.models.verify"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qkv.models' has no attribute {name!r}")
