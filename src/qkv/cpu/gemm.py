"""Inference GEMMs on CPU through oneDNN, with weights packed once; the product dispatcher that follows the rule.

Shape legend: M rows, K inputs, N outputs.

``F.linear`` on CPU calls MKL's ``sgemm``, which re-packs the weight on every call. oneDNN (which torch ships
as ``mkldnn``) runs several-row products faster once the weight has been reordered into its blocked layout,
and that reorder can be done once for inference (``torch.ops.mkldnn._reorder_linear_weight``, the path
``torch.compile`` takes for frozen CPU linears); the measured rates are in ``benchmarks/RESULTS.md``.
Those operators are private to torch: :func:`onednn_unavailable_reason` checks that they exist and compute
``F.linear``'s product in this build (once, on a small probe), and when they do not every product here falls
back to the blocks of :mod:`qkv.cpu.skinny` or ``F.linear``.
Inputs and outputs stay ordinary dense tensors. The products are float32 throughout; only the kernel, and
so the order of the K-term sums, differs from MKL's.

:func:`linear` is ``F.linear`` the way the product rule (:mod:`qkv.cpu.rule`) says for the shape at hand:
oneDNN through a packed copy for many rows, row (or column) blocks for few, ``F.linear`` otherwise.
:class:`PrepackedLinear` is an ``nn.Linear`` (same parameters and names) that multiplies through it when no
gradient is recorded, and through ``F.linear`` otherwise; the packed copy is built on first use and rebuilt
when the weight changes (another tensor, or an in-place write seen by its version counter).
:class:`LinearProducts` does the same for a module's own weights (a tied LM head, stacked experts, a fused
QKV), one packed copy per weight or weight slice. Training is untouched. The packed copies cost one more
weight's worth of memory for every weight multiplied by many rows. :func:`qkv.cpu.optimize` applies all of
this to a model.

Example:
    >>> import torch
    >>> from qkv.cpu.gemm import PrepackedLinear
    >>> lin = PrepackedLinear.from_linear(torch.nn.Linear(8, 16))
    >>> with torch.inference_mode():
    ...     y = lin(torch.randn(4, 8))
    >>> y.shape
    torch.Size([4, 16])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import ops
from .rule import BF16_STREAM_ROWS, MEASURED_ROWS, STREAM_ROWS, choose
from .skinny import (
    SkinnyLinear,
    block_count,
    blockable,
    input_major,
    row_blocks,
    rows_linear,
    sharing_parameters,
    skinny_linear,
    standard_layout_state_dict,
)

__all__ = ["onednn_available", "onednn_unavailable_reason", "prepacked_linear", "linear", "planned_row_blocks",
           "PrepackedWeight", "PrepackedWeights", "WeightPacks", "PrepackedLinear", "LinearProducts", "can_fuse",
           "epilogue"]

Activation = Callable[[torch.Tensor], torch.Tensor]


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


class WeightPacks(Protocol):
    """Where :func:`prepacked_linear` gets the packed copy of a weight: :class:`PrepackedWeight` (one weight)
    or :class:`PrepackedWeights` (every weight, or slice of one, a module multiplies by)."""

    def get(self, weight: torch.Tensor) -> torch.Tensor: ...


class PrepackedWeights:
    """oneDNN copies of the weights one module multiplies by: whole tensors or views of one (an expert's
    slice of a stacked parameter, made anew on every call), each kept under the tensor it views (held
    weakly, so a replaced weight's copies go with it) and the view's offset, shape and strides, and rebuilt
    after an in-place write (the version counter, which views share). As :class:`PrepackedWeight`, an
    in-place write to an inference tensor is not seen."""

    def __init__(self) -> None:
        self._by_base: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __deepcopy__(self, memo) -> PrepackedWeights:  # packed tensors are opaque: a copy repacks lazily
        return PrepackedWeights()

    def __reduce__(self):
        return (PrepackedWeights, ())

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        base = weight if weight._base is None else weight._base
        slots = self._by_base.get(base)
        if slots is None:
            slots = self._by_base[base] = {}
        version = None if weight.is_inference() else weight._version
        key = (weight.storage_offset(), tuple(weight.shape), weight.stride(), weight.dtype)
        hit = slots.get(key)
        if hit is None or hit[0] != version:
            with torch.no_grad():
                hit = slots[key] = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()))
        return hit[1]


_PACKED_DTYPES = (torch.float32, torch.bfloat16)  # what the packed oneDNN products take (x and weight alike)


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return (not grad and x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype in _PACKED_DTYPES
            and weight.dtype == x.dtype and x.numel() > 0 and onednn_available())


def _reference_epilogues() -> tuple[tuple[str, str, Activation], ...]:
    return (("gelu", "none", F.gelu), ("gelu", "tanh", lambda x: F.gelu(x, approximate="tanh")),
            ("relu", "", F.relu))


@functools.cache
def epilogue(activation: Activation) -> tuple[str, str] | None:
    """The oneDNN epilogue ``(attr, algorithm)`` that computes ``activation`` inside the GEMM, or None.

    oneDNN applies ReLU, GELU and tanh-approximated GELU; a function is matched by what it computes on a
    fixed probe of 2,401 points over [-12, 12] (bitwise equal to torch's own function), so aliases of those
    (``qkv.nn.activations``' ``gelu_tanh``, HF's ``gelu_new``) fuse without this layer importing them.
    """
    probe = torch.linspace(-12.0, 12.0, 2401)
    got = activation(probe)
    for attr, algorithm, fn in _reference_epilogues():
        if torch.equal(got, fn(probe)):
            return attr, algorithm
    return None


def can_fuse(activation: Activation) -> bool:
    """Whether :func:`prepacked_linear` can apply ``activation`` inside the GEMM (:func:`epilogue`)."""
    return epilogue(activation) is not None


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: WeightPacks,
                     activation: Activation | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``packed`` (the oneDNN copy of ``weight``) for float32 CPU
    inputs without gradient, else ``F.linear`` itself. x (..., K), weight (N, K) -> (..., N).
    ``activation`` (one :func:`can_fuse` accepts) is applied to the result, inside the GEMM when packed."""
    fused = epilogue(activation) if callable(activation) else None
    if activation is not None and fused is None:
        raise ValueError(f"prepacked_linear: activation must compute ReLU, GELU or tanh-approximated GELU (the "
                         f"oneDNN epilogues) or be None, got {activation!r}; apply other activations to the result")
    if not _eligible(x, weight):
        y = F.linear(x, weight, bias)
        return y if activation is None else activation(y)
    attr, algorithm = ("none", "") if fused is None else fused
    K = x.shape[-1]
    y = _pointwise(x.reshape(-1, K), packed.get(weight), bias, attr, [], algorithm)
    return y.view(*x.shape[:-1], weight.shape[0])


_STREAMED_ROWS = {torch.bfloat16: BF16_STREAM_ROWS, torch.float32: STREAM_ROWS}  # dtype -> rows the kernel takes


def _streams(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` streams this product through ``qkv_cpu::weight_linear`` (before the rule)."""
    K = x.shape[-1]
    return bool(x.dtype == weight.dtype and K and weight.dim() == 2
                and x.numel() // K <= _STREAMED_ROWS.get(x.dtype, 0)
                and ops.why_not_weight_linear(x, weight, None, bias) is None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: WeightPacks | None = None, activation: Activation | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (then ``activation``, if given) the way the product rule says for this
    shape and thread count (:func:`qkv.cpu.rule.choose`): oneDNN through ``packed`` (the activation fused)
    where the rule takes it and this product can run it, else row or column blocks
    (:func:`qkv.cpu.skinny.skinny_linear`), else ``F.linear``. Before the rule, a bfloat16 product of up to
    :data:`qkv.cpu.rule.BF16_STREAM_ROWS` rows and a float32 one of up to :data:`qkv.cpu.rule.STREAM_ROWS` rows run
    the weight-streaming kernel (:mod:`qkv.cpu.weights`: float32 sums) where it runs; a bfloat16 product of more
    rows runs oneDNN's bfloat16 GEMM through ``packed`` where it can (the table is float32's), else ``F.linear``.
    x (..., K), weight (N, K) -> (..., N)."""
    if x.device.type != "cpu":  # the CPU paths only: elsewhere nothing to decide
        y = F.linear(x, weight, bias)
        return y if activation is None else activation(y)
    K = x.shape[-1]
    if _streams(x, weight, bias):
        y = ops.weight_linear(x, weight, None, bias)
        return y if activation is None else activation(y)
    if x.dtype == torch.bfloat16:
        path = "onednn" if K else "linear"
    else:
        path = choose(x.numel() // K, weight.shape[0], K) if K else "linear"
    if path == "onednn" and packed is not None and _eligible(x, weight):
        if activation is not None and epilogue(activation) is None:
            return activation(prepacked_linear(x, weight, bias, packed))
        return prepacked_linear(x, weight, bias, packed, activation)
    if (path == "row_blocks" and weight.dim() == 2 and weight.shape[1] == K and weight.is_contiguous()
            and blockable(x, weight)):  # skinny_linear's row blocks, decided here
        y = rows_linear(x, weight, bias, block_count())
    else:
        y = skinny_linear(x, weight, bias)
    return y if activation is None else activation(y)


class PrepackedLinear(SkinnyLinear):
    """``nn.Linear`` (same parameters, names and layout) multiplied the product rule's way (:func:`linear`):
    oneDNN through a copy of the weight packed on first use (when ``pack``), row or column blocks, or
    ``F.linear``; ``activation``, when set, is applied to the output (inside oneDNN's GEMM where it can)."""

    pack: bool = True
    activation: Activation | None = None

    @property
    def computes_linear(self) -> bool:
        """``F.linear``'s product and nothing more (no activation applied after it)."""
        return self.activation is None

    def _packed(self) -> PrepackedWeight:
        p = self.__dict__.get("_prepacked_weight")
        if p is None:
            p = self.__dict__["_prepacked_weight"] = PrepackedWeight()
        return p

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, pack: bool = True, activation: Activation | None = None,
                    input_major_weight: bool | None = None) -> PrepackedLinear:
        """The same layer, sharing ``linear``'s parameters. ``input_major_weight`` True stores the weight
        input-major, False standard (a new parameter with the same values where the layout changes; None
        keeps it); an input-major weight still comes out of ``state_dict()`` contiguous."""
        new = sharing_parameters(cls, linear)
        new.pack = pack
        if activation is not None:
            new.activation = activation
        w = linear.weight
        was = not w.is_contiguous() and w.t().is_contiguous()
        if input_major_weight is not None and input_major_weight != was:
            values = input_major(w) if input_major_weight else w.detach().contiguous()
            new.weight = nn.Parameter(values, requires_grad=w.requires_grad)
        if not new.weight.is_contiguous():
            new._register_state_dict_hook(standard_layout_state_dict)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._packed() if self.pack else None, self.activation)

    def extra_repr(self) -> str:
        act = f", activation={self.activation!r}" if self.activation is not None else ""
        return f"{super().extra_repr()}, pack={self.pack}{act}"


class LinearProducts:
    """A function with ``F.linear``'s signature for the weights a module holds outside ``nn.Linear`` (a tied
    LM head, stacked experts, a fused QKV): each product the product rule's way (:func:`linear`), with one
    packed copy per weight or weight slice (:class:`PrepackedWeights`) when ``pack``.
    :func:`qkv.cpu.optimize` sets it as such a module's ``linear_fn``."""

    computes_linear = True  # F.linear's product and nothing more

    def __init__(self, pack: bool = True) -> None:
        self.pack = pack
        self._packs = PrepackedWeights() if pack else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, weight, bias, self._packs)

    def __deepcopy__(self, memo) -> LinearProducts:
        return LinearProducts(self.pack)

    def __reduce__(self):
        return (LinearProducts, (self.pack,))

    def __repr__(self) -> str:
        return f"LinearProducts(pack={self.pack})"


def planned_row_blocks(linear_fn: Callable, x: torch.Tensor, weight: torch.Tensor) -> int | None:
    """The row blocks ``linear_fn(x, weight, bias)`` multiplies through (1: ``F.linear`` itself, 0: the weight
    streamed by ``qkv_cpu::weight_linear``), for a ``linear_fn`` that is ``F.linear`` or a :class:`LinearProducts`
    and a contiguous ``weight`` (N, K); None where it takes another path (oneDNN, column blocks, a function of the
    caller's own), so that a fused caller (:mod:`qkv.nn.moe`'s one-token experts) runs exactly the products
    ``linear_fn`` would."""
    if linear_fn is F.linear:
        return 1
    if type(linear_fn) is not LinearProducts or not weight.is_contiguous() or x.device.type != "cpu":
        return None
    K, N = x.shape[-1], weight.shape[0]
    rows = x.numel() // K if K else 0
    if _streams(x, weight, None):
        return 0
    if linear_fn.pack and choose(rows, N, K) == "onednn" and _eligible(x, weight):
        return None
    if rows > MEASURED_ROWS or not blockable(x, weight):
        return 1
    return row_blocks(rows, N, K)
