"""qkv: attention for PyTorch. Every mechanism in one place, one semantics across backends.

Example:
    >>> import torch, qkv
    >>> q = k = v = torch.randn(1, 4, 32, 64)
    >>> out = qkv.attention(q, k, v, mask=qkv.masks.causal())
    >>> out.shape
    torch.Size([1, 4, 32, 64])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import backends, masks, mods
from ._attention import Explanation, attention, explain
from ._merge import merge_states
from ._request import AttentionOutput

__version__ = "0.1.0"

__all__ = [
    "attention", "explain", "Explanation", "merge_states", "AttentionOutput",
    "masks", "mods", "backends", "__version__",
]

# Heavier subpackages load on first touch: `import qkv` needs only torch and numpy.
_LAZY = {"testing", "costs", "pos", "nn", "linear", "cache", "models", "interpret", "distributed", "cli"}


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"qkv.{name}")
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from . import testing  # noqa: F401
