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

__version__ = "0.1.0"

# Everything loads on first touch: `import qkv` is fast, and `import qkv.costs` (pure arithmetic)
# does not even import torch.
_ATTRS = {
    "attention": "qkv._attention",
    "explain": "qkv._attention",
    "Explanation": "qkv._attention",
    "MAX_PLAUSIBLE_HEADS": "qkv._attention",
    "merge_states": "qkv._merge",
    "AttentionOutput": "qkv._request",
    "PagedKV": "qkv._request",
    "attention_probs": "qkv._probs",
    "sdpa": "qkv.integrations.sdpa",
    "scaled_dot_product_attention": "qkv.integrations.sdpa",
    "varlen_attention": "qkv.varlen",
    "attention_stats": "qkv._probs",
    "AttentionStats": "qkv._probs",
}
_SUBMODULES = {"masks", "mods", "backends", "testing", "costs", "conformance", "pos", "nn", "linear", "cache", "models",
               "interpret", "distributed", "cli", "lse", "varlen", "integrations", "sparse"}

__all__ = ["attention", "explain", "Explanation", "MAX_PLAUSIBLE_HEADS", "merge_states", "AttentionOutput",
           "PagedKV",
           "attention_probs", "attention_stats", "AttentionStats", "sdpa", "scaled_dot_product_attention",
           "varlen_attention", "masks", "mods", "backends", "lse", "varlen", "__version__"]


def __getattr__(name: str):
    if name in _ATTRS:
        value = getattr(importlib.import_module(_ATTRS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"qkv.{name}")
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ATTRS, *_SUBMODULES})


if TYPE_CHECKING:  # pragma: no cover
    from . import backends, masks, mods  # noqa: F401
    from ._attention import MAX_PLAUSIBLE_HEADS, Explanation, attention, explain  # noqa: F401
    from ._merge import merge_states  # noqa: F401
    from ._probs import AttentionStats, attention_probs, attention_stats  # noqa: F401
    from ._request import AttentionOutput, PagedKV  # noqa: F401
    from .integrations.sdpa import scaled_dot_product_attention, sdpa  # noqa: F401
    from .varlen import varlen_attention  # noqa: F401
