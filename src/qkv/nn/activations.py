"""The one table of activation names in qkv.

HF's ``hidden_act`` names (``silu``, ``gelu_pytorch_tanh``, ``gelu_new``, ...) and qkv's own (``gelu_tanh``;
``swiglu`` and ``geglu`` select a gated :class:`qkv.nn.FeedForward` with a SiLU or GELU gate), each mapped
to exactly the function HF uses. GELU: Hendrycks & Gimpel 2016; SiLU: Elfwing et al. 2017.

Example:
    >>> import torch
    >>> from qkv.nn.activations import ACTIVATIONS
    >>> ACTIVATIONS["gelu_new"] is ACTIVATIONS["gelu_pytorch_tanh"]
    True
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "GATED", "GateKernel", "gelu_tanh", "check_activation", "gated"]

#: ``fn(h, activation) -> activation(gate) * up or None``: a faster gate put into a module's ``gate_kernel`` slot
#: from outside (``qkv.cpu.optimize``: SwiGLU's in one pass); None for a call it does not run.
GateKernel = Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], "torch.Tensor | None"]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF ``gelu_new``, ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


#: Activation name -> function (read-only).
ACTIVATIONS: MappingProxyType[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType({
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "relu": F.relu,
    "swiglu": F.silu,
    "geglu": F.gelu,
})

#: Names that make :class:`qkv.nn.FeedForward` gated.
GATED = ("swiglu", "geglu")


def check_activation(owner: str, name: str) -> None:
    """Raise ``ValueError`` naming ``owner`` when ``name`` is not a key of :data:`ACTIVATIONS`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")


def gated(h: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor],
          kernel: GateKernel | None = None) -> torch.Tensor:
    """``activation(gate) * up`` of a fused gate-up projection ``h`` (..., 2f), gate first, as torch's two ops;
    ``kernel`` (a module's ``gate_kernel``, None by default) is tried first.

    Example:
        >>> import torch
        >>> h = torch.randn(3, 8)
        >>> torch.equal(gated(h, F.silu), F.silu(h[:, :4]) * h[:, 4:])
        True
    """
    if kernel is not None:
        y = kernel(h, activation)
        if y is not None:
            return y
    gate, up = h.chunk(2, dim=-1)
    return activation(gate) * up
