"""Normalization layers for transformer blocks.

- LayerNorm: Ba et al. 2016, "Layer Normalization" (``torch.nn.LayerNorm``).
- RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization": ``x / rms(x) * weight``, no
  centering and no bias (Llama, T5, Mistral). Computed in float32 for low-precision inputs. Gemma's
  variant scales by ``1 + weight`` (``offset=1``, weights stored around 0).

Example:
    >>> import torch
    >>> from qkv.nn import RMSNorm
    >>> RMSNorm(8)(torch.randn(2, 3, 8)).shape
    torch.Size([2, 3, 8])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu import kernels
from ..spec.config import NORMS

__all__ = ["rms_norm", "compiled_rms_norm", "RMSNorm", "make_norm", "NORMS"]



def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, *, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim; float16/bfloat16 inputs normalize in float32."""
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    xw = x.to(work)
    y = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(work)
    return y.to(x.dtype)


def compiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, offset: float = 0.0) -> torch.Tensor | None:
    """``x / rms(x) * (offset + weight)`` in one call of qkv's compiled loop (:mod:`qkv.cpu.kernels`,
    ``norms.cpp``) for float32/float64 CPU inputs with a weight of their dtype and no gradient being recorded;
    None otherwise (the caller runs torch's ops)."""
    if (x.dtype not in (torch.float32, torch.float64) or weight.dtype != x.dtype or x.device.type != "cpu"
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return None
    mod = kernels.load()
    return None if mod is None else kernels.profiled("rms_norm", mod.rms_norm, x, weight, eps, offset)


class RMSNorm(nn.Module):
    """RMS normalization scaling by ``offset + weight``.

    ``offset = 0`` (Llama, T5): weights start at 1. ``offset = 1`` (Gemma, Qwen3-Next): weights start at 0.
    float32 and float64 inputs whose dtype matches the weight's go through torch's ``F.rms_norm`` (one or two ops
    instead of eight to eleven, which matters when decoding one token), or on the CPU without autograd through
    qkv's compiled loop (:mod:`qkv.cpu.kernels`, ``norms.cpp``: one call, the sum of squares in float64);
    low-precision inputs normalize in float32.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = compiled_rms_norm(x, self.weight, eps=self.eps, offset=self.offset)
        if y is not None:
            return y
        full = x.dtype in (torch.float32, torch.float64)
        if self.offset == 0:
            if full and self.weight.dtype == x.dtype:
                return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return rms_norm(x, self.weight, eps=self.eps)
        if full and self.weight.dtype == x.dtype:  # (offset + weight) rounded once, as HF's Gemma and Qwen3-Next
            return F.rms_norm(x, self.weight.shape, self.offset + self.weight, self.eps)
        work = x.dtype if full else torch.float32
        return (rms_norm(x.to(work), eps=self.eps) * (self.offset + self.weight.to(work))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset:g}" if self.offset else "")


def make_norm(kind: str, dim: int, *, eps: float = 1e-5) -> nn.Module:
    """``"layer"`` -> ``nn.LayerNorm``, ``"rms"`` -> :class:`RMSNorm`."""
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    if kind == "rms":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
