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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config.decoder import NORMS

__all__ = ["rms_norm", "RMSNorm", "NormKernel", "make_norm", "NORMS"]

#: ``fn(x, weight, eps, offset) -> y or None``: a faster ``x / rms(x) * (offset + weight)`` put into a module's
#: ``norm_kernel`` slot from outside (``qkv.cpu.optimize``); None for a call it does not run.
NormKernel = Callable[[torch.Tensor, torch.Tensor, float, float], "torch.Tensor | None"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, *, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim; float16/bfloat16 inputs normalize in float32."""
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    xw = x.to(work)
    y = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(work)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMS normalization scaling by ``offset + weight``.

    ``offset = 0`` (Llama, T5): weights start at 1. ``offset = 1`` (Gemma, Qwen3-Next): weights start at 0.
    float32 and float64 inputs whose dtype matches the weight's go through torch's ``F.rms_norm`` (one or two ops
    instead of eight to eleven, which matters when decoding one token); low-precision inputs normalize in float32.
    ``norm_kernel`` (a :data:`NormKernel`, None by default) is tried first: ``qkv.cpu.optimize`` puts qkv's compiled
    loop there (one call on the CPU without autograd, the sum of squares in float64).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.norm_kernel: NormKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_kernel is not None:
            y = self.norm_kernel(x, self.weight, self.eps, self.offset)
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
