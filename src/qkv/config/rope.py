"""Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864) parameters as data: the base ``theta``,
HF's frequency-scaling dict, the rotated fraction of each head and the channel pairing. The tensors are built
from them by :meth:`qkv.pos.RotaryEmbedding.from_params`.

Example:
    >>> p = RopeParams(theta=5e5, scaling={"rope_type": "linear", "factor": 2.0})
    >>> p.rope_type, check_rope_scaling(p.scaling, owner="example")
    ('linear', None)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["RopeParams", "ROPE_TYPES", "ROPE_REQUIRED", "rope_type_of", "check_rope_scaling"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "proportional")
#: Keys of HF's scaling dict each type needs (``max_position_embeddings`` may come from the model instead).
ROPE_REQUIRED: Mapping[str, tuple[str, ...]] = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "proportional": (),
}


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    """HF's ``rope_type`` (or transformers 4's ``type``) of a scaling dict; ``"default"`` for None."""
    params = scaling or {}
    return str(params.get("rope_type", params.get("type", "default")))


def check_rope_scaling(scaling: Mapping[str, Any] | None, *, owner: str) -> None:
    """Raise ``ValueError`` naming ``owner`` when ``scaling`` has an unknown ``rope_type`` or lacks a key it needs."""
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ValueError(f"{owner}: rope_scaling must be a dict with 'rope_type' or None, got {scaling!r}")
    kind = rope_type_of(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"{owner}: unsupported rope_type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    missing = [k for k in ROPE_REQUIRED[kind] if (scaling or {}).get(k) is None]
    if missing:
        raise ValueError(f"{owner}: rope_type {kind!r} needs {missing[0]!r} in rope_scaling; got {dict(scaling or {})}")


@dataclass(frozen=True, kw_only=True)
class RopeParams:
    """RoPE of one layer type: ``theta`` (HF ``rope_theta``), ``scaling`` (HF ``rope_parameters`` /
    ``rope_scaling`` dict with ``rope_type``; None: plain RoPE), ``partial_rotary_factor`` (the rotated
    fraction of each head), ``interleaved`` pairs ``(2f, 2f+1)`` (DeepSeek-V2) instead of ``(f, f + R/2)``."""

    theta: float = 10000.0
    scaling: Mapping[str, Any] | None = None
    interleaved: bool = False
    partial_rotary_factor: float = 1.0

    @property
    def rope_type(self) -> str:
        return rope_type_of(self.scaling)
