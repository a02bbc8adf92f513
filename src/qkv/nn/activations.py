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

from ..cpu import kernels

__all__ = ["ACTIVATIONS", "GATED", "gelu_tanh", "check_activation", "gated"]


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


def gated(h: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``activation(gate) * up`` of a fused gate-up projection ``h`` (..., 2f), gate first. A SiLU gate (SwiGLU)
    on float32/float64 CPU inputs with no gradient being recorded runs as one pass of qkv's compiled kernels
    (:mod:`qkv.cpu.kernels`, ``activations.cpp``: the same values bit for bit, without the activation's
    intermediate tensor); the rest as torch's two ops.

    Example:
        >>> import torch
        >>> h = torch.randn(3, 8)
        >>> torch.equal(gated(h, F.silu), F.silu(h[:, :4]) * h[:, 4:])
        True
    """
    if (activation is F.silu and h.device.type == "cpu" and h.dtype in (torch.float32, torch.float64)
            and h.stride(-1) == 1 and not (torch.is_grad_enabled() and h.requires_grad)):
        mod = kernels.load()
        if mod is not None:
            return kernels.profiled("silu_mul", mod.silu_mul, h)
    gate, up = h.chunk(2, dim=-1)
    return activation(gate) * up
