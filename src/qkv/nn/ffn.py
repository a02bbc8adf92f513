"""Position-wise feed-forward networks.

- Plain: ``down(act(up(x)))`` with GELU (Hendrycks & Gimpel 2016) or ReLU, as in Vaswani et al. 2017.
- Gated: ``down(act(gate(x)) * up(x))``: SwiGLU (SiLU gate) and GeGLU (GELU gate), Shazeer 2020,
  "GLU Variants Improve Transformer". :class:`FeedForward` keeps HF Llama's three projections
  (``gate_proj``, ``up_proj``, ``down_proj``); :class:`GatedMLP`, the decoder's, fuses gate and up into
  one ``gate_up_proj`` (one matmul instead of two, which matters when decoding one token at a time).
Activations come from the one table, :data:`qkv.nn.activations.ACTIVATIONS`. The modules are plain
``nn.Linear`` products; :func:`qkv.cpu.optimize` swaps in CPU ones from outside (and moves a plain
:class:`FeedForward`'s activation into its up projection's oneDNN GEMM: ``up_activation``).

Shape legend: B batch, N tokens, d model width, f hidden width.

Example:
    >>> import torch
    >>> from qkv.nn import FeedForward
    >>> FeedForward(16, 32, activation="swiglu")(torch.randn(2, 5, 16)).shape
    torch.Size([2, 5, 16])
"""

from __future__ import annotations

import torch
from torch import nn

from .activations import ACTIVATIONS, GATED, GateKernel, check_activation, gated

__all__ = ["FeedForward", "GatedMLP", "ACTIVATIONS", "GATED"]


class FeedForward(nn.Module):
    """Two-layer (or gated three-matrix) MLP applied to each token.

    Args:
        d_model: input and output width ``d``.
        d_ff: hidden width ``f``.
        activation: one of ``ACTIVATIONS``; ``"swiglu"`` / ``"geglu"`` add a gate projection.
        bias: biases on the projections.
        dropout: dropout on the hidden activations (training only).

    ``forward(x)``: (..., d) -> (..., d).

    ``up_activation`` is the function applied to ``up_proj``'s output (None when gated, or when the
    activation runs inside ``up_proj``, as :func:`qkv.cpu.optimize` arranges: a
    :class:`qkv.cpu.ActivatedUpProjection`).
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "gelu", bias: bool = True,
                 dropout: float = 0.0) -> None:
        super().__init__()
        check_activation("FeedForward", activation)
        self.activation = activation
        gated = activation in GATED
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.up_activation = None if gated else ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        if self.gate_proj is not None:
            h = ACTIVATIONS[self.activation](self.gate_proj(x)) * h
        elif self.up_activation is not None:
            h = self.up_activation(h)
        return self.down_proj(self.dropout(h))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one projection ``gate_up_proj`` (d -> 2f,
    gate rows first).

    Args:
        d_model: input and output width ``d``; d_ff: hidden width ``f``.
        activation: the gate's activation, a key of ``ACTIVATIONS`` (``"silu"``: SwiGLU).
        bias: biases on both projections.

    ``forward(x)``: (..., d) -> (..., d).
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "silu", bias: bool = False) -> None:
        super().__init__()
        check_activation("GatedMLP", activation)
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_up_proj = nn.Linear(d_model, 2 * d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.gate_kernel: GateKernel | None = None  # qkv.cpu.optimize puts SwiGLU's one-pass gate here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.act, self.gate_kernel))  # act(gate) * up

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
