"""Inference GEMMs on CPU through oneDNN, with weights packed once.

Shape legend: M rows, K inputs, N outputs.

``F.linear`` on CPU calls MKL's ``sgemm``, which re-packs the weight on every call. oneDNN (which torch ships
as ``mkldnn``) runs several-row products faster once the weight has been reordered into its blocked layout,
and that reorder can be done once for inference (``torch.ops.mkldnn._reorder_linear_weight``, the path
``torch.compile`` takes for frozen CPU linears); the measured rates are in ``benchmarks/RESULTS.md``.
Those operators are private to torch: :func:`onednn_unavailable_reason` checks that they exist and compute
``F.linear``'s product in this build (once, on a small probe), and when they do not every product here falls
back to ``F.linear``.
Inputs and outputs stay ordinary dense tensors. The products are float32 throughout; only the kernel, and
so the order of the K-term sums, differs from MKL's.

:class:`PrepackedLinear` is an ``nn.Linear`` (same parameters and names) that multiplies through the packed
copy when no gradient is recorded, and through ``F.linear`` otherwise; the copy is rebuilt when the weight
changes (another tensor, or an in-place write seen by its version counter). :func:`use_onednn` swaps a
model's ``nn.Linear`` layers for it and calls ``set_gemm("onednn")`` on modules that multiply by weights
of their own making (a fused QKV, a tied LM head). Training is untouched. The packed copies cost one more
weight's worth of memory, which is why decoders opt in (``use_onednn(model)``) while
:class:`qkv.models.embed.SentenceEncoder`, small, does by default.

Example:
    >>> import torch
    >>> from qkv.cpu.gemm import PrepackedLinear, onednn_available
    >>> lin = PrepackedLinear.from_linear(torch.nn.Linear(8, 16))
    >>> with torch.inference_mode():
    ...     y = lin(torch.randn(4, 8))
    >>> y.shape
    torch.Size([4, 16])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from .skinny import SkinnyLinear, sharing_parameters, skinny_linear

__all__ = ["onednn_available", "onednn_unavailable_reason", "prepacked_linear", "linear", "PrepackedWeight",
           "PrepackedLinear", "use_onednn", "can_fuse", "GemmChoice"]


@functools.cache
def onednn_unavailable_reason() -> str | None:
    """Why this torch build cannot run :func:`prepacked_linear`, or None when it can: oneDNN present, the private
    operators ``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise`` present, and a probe
    product through them equal to ``F.linear``'s (their signatures are not a public contract)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return f"this torch build ({torch.__version__}) lacks torch.ops.mkldnn.{name}"
    x = torch.arange(6, dtype=torch.float32).view(2, 3) / 4
    w = torch.arange(12, dtype=torch.float32).view(4, 3) / 8
    try:
        with torch.no_grad():
            got = ops._linear_pointwise(x, ops._reorder_linear_weight(w), None, "none", [], "")
    except (RuntimeError, TypeError) as e:
        return f"torch.ops.mkldnn._linear_pointwise fails in torch {torch.__version__}: {e}"
    if got.shape != (2, 4) or not torch.allclose(got, F.linear(x, w), atol=1e-5):
        return f"torch.ops.mkldnn._linear_pointwise gives a wrong product in torch {torch.__version__}"
    return None


def onednn_available() -> bool:
    """True when oneDNN's prepacked linear runs correctly here (CPU, float32)."""
    return onednn_unavailable_reason() is None


def _pointwise(*args):
    return torch.ops.mkldnn._linear_pointwise(*args)


class PrepackedWeight:
    """A weight reordered for oneDNN, rebuilt when the source changes: another tensor object (a freed
    tensor's address can be reused, so the object itself is compared, and held), new storage, or an
    in-place write (the version counter). Inference tensors (made under ``inference_mode``) keep no version
    counter, so an in-place write to one is not seen; qkv only hands it tensors it never writes to."""

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> PrepackedWeight:  # the packed tensor is opaque: a copy repacks lazily
        return PrepackedWeight()

    def __getstate__(self) -> dict:
        return {"_source": None, "_key": None, "_packed": None}

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        version = None if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, tuple(weight.shape), weight.dtype)
        if self._source is not weight or self._key != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
            self._source, self._key = weight, key
        return self._packed


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return (not grad and x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.numel() > 0 and onednn_available())


@functools.cache
def _fused_table() -> dict:
    """Activation functions (those of :data:`qkv.nn.activations.ACTIVATIONS`) oneDNN applies to a GEMM's output
    in its epilogue: function -> (oneDNN attr, algorithm). Built on first use (qkv.nn imports this module)."""
    from ..nn.activations import gelu_tanh

    return {F.gelu: ("gelu", "none"), gelu_tanh: ("gelu", "tanh"), F.relu: ("relu", "")}


def can_fuse(activation: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether :func:`prepacked_linear` can apply ``activation`` inside the GEMM."""
    return activation in _fused_table()


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PrepackedWeight,
                  activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``packed`` (the oneDNN copy of ``weight``) for float32 CPU
    inputs without gradient, else ``F.linear`` itself. x (..., K), weight (N, K) -> (..., N).
    ``activation`` (one :func:`can_fuse` accepts) is applied to the result, inside the GEMM when packed."""
    if activation is not None and not can_fuse(activation):
        names = [fn.__name__ for fn in _fused_table()]
        raise ValueError(f"prepacked_linear: activation must be one of the functions {names} or None, "
                         f"got {activation!r}")
    if not _eligible(x, weight):
        y = F.linear(x, weight, bias)
        return y if activation is None else activation(y)
    attr, algorithm = ("none", "") if activation is None else _fused_table()[activation]
    K = x.shape[-1]
    y = _pointwise(x.reshape(-1, K), packed.get(weight), bias, attr, [], algorithm)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PrepackedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` the fastest measured way: a single row (a one-sequence decode step)
    through :func:`qkv.cpu.skinny.skinny_linear` (blocked over threads, faster there), several rows
    through ``packed`` when given (oneDNN; ``F.linear`` where it cannot run)."""
    if packed is None or x.numel() <= x.shape[-1]:
        return skinny_linear(x, weight, bias)
    return prepacked_linear(x, weight, bias, packed)


class PrepackedLinear(nn.Linear):
    """``nn.Linear`` whose inference runs through a oneDNN-packed copy of its weight (see module notes);
    one-row products go through :func:`qkv.cpu.skinny.skinny_linear` instead (see :func:`linear`)."""

    def _packed(self) -> PrepackedWeight:
        p = self.__dict__.get("_prepacked_weight")
        if p is None:
            p = self.__dict__["_prepacked_weight"] = PrepackedWeight()
        return p

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PrepackedLinear:
        """The same layer, sharing ``linear``'s parameters."""
        return sharing_parameters(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._packed())

    def forward_activated(self, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act(self(x))`` with the activation (one :func:`can_fuse` accepts) fused into the GEMM."""
        return prepacked_linear(x, self.weight, self.bias, self._packed(), activation)


@runtime_checkable
class GemmChoice(Protocol):
    """A module that multiplies by weights of its own making (a fused QKV, a tied LM head, a fused activation)
    and so chooses its GEMM itself: ``set_gemm("onednn")`` (prepacked oneDNN) or ``set_gemm("blas")``."""

    def set_gemm(self, engine: str) -> None: ...


def use_onednn(model: nn.Module) -> nn.Module:
    """Swap every plain ``nn.Linear`` inside ``model`` for a :class:`PrepackedLinear` sharing its parameters
    (in place; returns ``model``). Raises ``RuntimeError`` saying why when oneDNN cannot run here."""
    why = onednn_unavailable_reason()
    if why is not None:
        raise RuntimeError(f"use_onednn: {why}; keep torch's default GEMM (gemm='blas')")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear or isinstance(child, SkinnyLinear):  # the weight (and its layout) is shared
                setattr(parent, name, PrepackedLinear.from_linear(child))
        if isinstance(parent, GemmChoice):  # modules with their own fused products
            parent.set_gemm("onednn")
    return model
