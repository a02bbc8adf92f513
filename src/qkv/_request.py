"""The operator's shared types: the validated request every backend receives, and the result shape.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Nq queries, Nk keys, Dqk query/key head
dim, Dv value head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .masks.base import Mask
from .mods.base import ScoreMod, as_score_mod

__all__ = ["AttentionOutput", "Request", "build_request", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class AttentionOutput(NamedTuple):
    """``out`` (B, Hq, Nq, Dv) in the input dtype; ``lse`` (B, Hq, Nq) float32, natural log of the sum of
    exp of the final scores over allowed keys (``-inf`` for a row with no allowed key)."""

    out: torch.Tensor
    lse: torch.Tensor


@dataclass(frozen=True)
class Request:
    """One validated call of :func:`qkv.attention`."""

    q: torch.Tensor  # (B, Hq, Nq, Dqk)
    k: torch.Tensor  # (B, Hkv, Nk, Dqk)
    v: torch.Tensor  # (B, Hkv, Nk, Dv)
    mask: Mask | None
    score_mod: ScoreMod | None
    scale: float
    return_lse: bool = False
    dropout_p: float = 0.0
    generator: torch.Generator | None = None

    @property
    def B(self) -> int:
        return self.q.shape[0]

    @property
    def Hq(self) -> int:
        return self.q.shape[1]

    @property
    def Hkv(self) -> int:
        return self.k.shape[1]

    @property
    def Nq(self) -> int:
        return self.q.shape[2]

    @property
    def Nk(self) -> int:
        return self.k.shape[2]

    @property
    def Dqk(self) -> int:
        return self.q.shape[3]

    @property
    def Dv(self) -> int:
        return self.v.shape[3]

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, Hq for MQA)."""
        return self.Hq // self.Hkv

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def requires_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        extra = self.score_mod.tensors() if self.score_mod is not None else ()
        return any(t.requires_grad for t in (self.q, self.k, self.v, *extra))

    def describe(self) -> str:
        return (f"B={self.B} Hq={self.Hq} Hkv={self.Hkv} Nq={self.Nq} Nk={self.Nk} Dqk={self.Dqk} Dv={self.Dv} "
                f"{str(self.dtype).replace('torch.', '')} {self.device.type}")


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _mask_hint(mask) -> str:
    if isinstance(mask, torch.Tensor):
        return " (wrap a boolean tensor with qkv.masks.dense(t))"
    if isinstance(mask, type) and issubclass(mask, Mask) or (callable(mask) and getattr(mask, "__module__", "")
                                                             .startswith("qkv.masks")):
        name = getattr(mask, "__name__", "mask")
        return f" (the function qkv.masks.{name} itself: did you mean {name}()?)"
    return ""


def _check_devices(arg: str, owner, tensors, device: torch.device) -> None:
    """Every tensor a mask or modifier holds must live on q's device, or on the CPU (masks and modifiers move
    CPU data to where it is read, gradients included). A meta tensor or another accelerator is refused.
    Attribute comparisons only: no tensor work per call."""
    for t in tensors:
        if t.device != device and t.device.type != "cpu":
            raise ValueError(f"attention: {arg} {owner!r} holds a tensor on {t.device} but q is on {device}; "
                             f"build it from tensors on {device} (or move them with .to(q.device))")


def build_request(q, k, v, *, mask=None, score_mod=None, scale=None, return_lse=False, dropout_p=0.0,
                  generator=None) -> Request:
    """Validate the arguments of :func:`qkv.attention`; every misuse raises with the fix."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"attention: {name} must have rank 4 with layout (B, H, N, D), got shape {_shape(t)}; "
                "for (B, N, H, D) inputs pass x.transpose(1, 2), for a single head add .unsqueeze(1)"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"attention: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them "
                        "with .to(dtype)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"attention: batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)} (dim 0)")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"attention: k and v must have the same number of heads, got k {_shape(k)}, v {_shape(v)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"attention: k and v must have the same length, got k {_shape(k)}, v {_shape(v)} (dim 2)")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q and k must have the same head dim, got q {_shape(q)}, k {_shape(k)} (dim 3)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"attention: query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]}) for "
            "grouped-query attention; query head h reads kv head h // (Hq // Hkv)"
        )
    if scale is None:
        scale = q.shape[3] ** -0.5 if q.shape[3] > 0 else 1.0
    elif isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = float(scale)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"attention: scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"attention: scale must be finite, got {scale}; the default is head_dim ** -0.5")
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"attention: mask must be a qkv.masks mask, got {type(mask).__name__}{_mask_hint(mask)}")
    mod = as_score_mod(score_mod)
    B, Hq, Nq, Nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if mask is not None:
        mask.check(B, Hq, Nq, Nk)
        _check_devices("mask", mask, mask.tensors(), q.device)
    if mod is not None:
        mod.check(B, Hq, Nq, Nk)
        _check_devices("score_mod", mod, mod.tensors(), q.device)
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be in [0, 1), got {dropout_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"attention: generator must be a torch.Generator, got {type(generator).__name__}")
    return Request(q, k, v, mask, mod, float(scale), bool(return_lse), float(dropout_p), generator)
