"""Position-wise feed-forward networks.

- Plain: ``down(act(up(x)))`` with GELU (Hendrycks & Gimpel 2016) or ReLU, as in Vaswani et al. 2017.
- Gated: ``down(act(gate(x)) * up(x))``: SwiGLU (SiLU gate) and GeGLU (GELU gate), Shazeer 2020,
  "GLU Variants Improve Transformer". Projection names follow HF Llama (``gate_proj``, ``up_proj``,
  ``down_proj``) so checkpoints map one to one.

Shape legend: B batch, N tokens, d model width, f hidden width.

Example:
    >>> import torch
    >>> from qkv.nn import FeedForward
    >>> FeedForward(16, 32, activation="swiglu")(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gemm import FUSED_ACTIVATIONS, PackedLinear

__all__ = ["FeedForward", "ACTIVATIONS", "GATED"]

_ACT = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,
}
ACTIVATIONS = tuple(_ACT)
GATED = ("swiglu", "geglu")


class FeedForward(nn.Module):
    """Two-layer (or gated three-matrix) MLP applied to each token.

    Args:
        d_model: input and output width ``d``.
        d_ff: hidden width ``f``.
        activation: one of ``ACTIVATIONS``; ``"swiglu"`` / ``"geglu"`` add a gate projection.
        bias: biases on the projections.
        dropout: dropout on the hidden activations (training only).

    ``forward(x)``: (..., d) -> (..., d).
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "gelu", bias: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if activation not in _ACT:
            raise ValueError(f"FeedForward: activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias) if activation in GATED else None
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    fused = False  # set_gemm("onednn"): the activation runs inside the up projection's packed GEMM

    def set_gemm(self, engine: str) -> None:
        """Called by :func:`qkv.nn.gemm.use_onednn` after it swapped the projections."""
        self.fused = (engine == "onednn" and self.gate_proj is None and self.activation in FUSED_ACTIVATIONS
                      and isinstance(self.up_proj, PackedLinear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and not (self.training and self.dropout.p > 0):
            return self.down_proj(self.up_proj.forward_activated(x, self.activation))
        act = _ACT[self.activation]
        h = act(self.gate_proj(x)) * self.up_proj(x) if self.gate_proj is not None else act(self.up_proj(x))
        return self.down_proj(self.dropout(h))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
