"""CPU speed applied to a model from outside: :func:`optimize` swaps in the products of this package.

Models are built plain (``nn.Linear`` layers; a module that multiplies by weights of its own calls
``self.linear_fn``, ``F.linear`` by default). :func:`optimize` rewrites one in place:

- every ``nn.Linear`` becomes a :class:`qkv.cpu.gemm.PrepackedLinear` holding the same parameter objects:
  its products follow the product rule (:mod:`qkv.cpu.rule`): oneDNN on a copy packed on first use for
  many rows, row blocks of the weight over torch's threads for few (:mod:`qkv.cpu.skinny`), ``F.linear``
  where those measured slower;
- every module with a ``linear_fn`` (:class:`LinearHost`: a tied LM head, stacked MoE experts, a fused
  QKV) gets a :class:`qkv.cpu.gemm.LinearProducts`, the same rule for its own weights and slices of them;
- a block computing ``up_activation(up_proj(x))`` (:class:`ActivatedUpProjection`, e.g. a GELU
  ``qkv.nn.FeedForward``) has a ReLU/GELU moved into the up projection's oneDNN GEMM;
- a model that declares :class:`qkv.cpu.greedy.GreedyHead` (``qkv.nn.DecoderLM``) gets a
  :class:`qkv.cpu.greedy.HeadScreen` for its greedy tokens, where the screen runs here (``screen=False``: never);
- every module with a compiled-kernel slot gets qkv's kernel (:mod:`qkv.cpu.fused`; ``compiled=False``: none, and
  the ones set before are removed): ``norm_kernel`` (:class:`NormHost`: RMSNorm), ``gate_kernel``
  (:class:`GateHost`: SwiGLU's gate), ``rotary_kernel`` (:class:`RotaryHost`: rotary embeddings),
  ``experts_kernel`` (:class:`ExpertsHost`: routed experts, one token or grouped), ``delta_kernel``
  (:class:`DeltaHost`: the gated-delta decode step and the chunked gated delta rule). Each kernel checks every call
  (:mod:`qkv.cpu.ops`' ``why_not_*``) and declines what it does not run, so the module's torch ops run then;
- an attention module whose single-query steps name ``decode_backend="sdpa"`` (:class:`DecodeHost`, the decoder's
  self-attention) has them name ``"auto"`` instead, which sends a cached decode step to ``"cpu_decode"``, the
  registry backend of qkv's compiled decode kernel, where it runs (``qkv.explain`` names it), and any other
  single-query call to torch SDPA as before (``compiled=False`` gives ``"sdpa"`` back).

``state_dict()`` keeps its names and standard contiguous values (the parameters are the same objects;
with ``input_major=True`` the wide weights are new parameters stored input-major, handed out contiguous),
so ``safetensors.torch.save_file(model.state_dict(), path)`` works as before. Gradients run through
``F.linear`` unchanged. The packed copies cost one more weight's worth of memory for each weight that is
multiplied by many rows. Calling :func:`optimize` again changes nothing (or applies new options);
:func:`optimized` says whether and how a model was. ``qkv.models.from_hf``, ``qkv.models.generate`` and
``qkv.models.embed.SentenceEncoder`` call it by default.

Example:
    >>> import torch
    >>> import qkv.cpu
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    >>> names = list(model.state_dict())
    >>> model = qkv.cpu.optimize(model)
    >>> type(model[0]).__name__, list(model.state_dict()) == names, qkv.cpu.optimized(model).input_major
    ('PrepackedLinear', True, None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from . import fused, gemm, ops
from . import threads as step_threads
from .gemm import LinearProducts, PrepackedLinear, can_fuse
from .greedy import GreedyHead, HeadScreen, screen_unavailable_reason
from .skinny import SkinnyLinear
from .weights import WEIGHT_FORMATS, Bf16ExactLinear, Int8Linear, is_bf16_exact

__all__ = ["optimize", "optimized", "use_onednn", "Optimized", "LinearHost", "ActivatedUpProjection", "NormHost",
           "GateHost", "RotaryHost", "ExpertsHost", "DeltaHost", "DecodeHost", "step"]

_MARK = "_qkv_cpu_optimized"
_HOOKS = "_qkv_cpu_step_hooks"  # the handles of the forward hooks that run each call under threads.step()


class Optimized(NamedTuple):
    """How :func:`optimize` left a model: ``onednn`` (packed oneDNN copies in use), the ``input_major``
    option it was given (None: layouts kept), ``screen`` (a greedy head was given an int8 screen) and
    ``weights`` (``"int8"``: some linear layers hold int8 weights, :class:`qkv.cpu.weights.Int8Linear`;
    ``"bf16-exact"``: some float32 layers hold their bfloat16-valued weights in bfloat16,
    :class:`qkv.cpu.weights.Bf16ExactLinear`; None: every weight in its own dtype). Which kernel slots hold qkv's
    compiled kernels the modules' slots say. ``threads``: ``"adapt"`` (each step on as many threads as cores are
    free, :mod:`qkv.cpu.threads`) or ``"fixed"`` (torch's setting)."""

    onednn: bool
    input_major: bool | None
    screen: bool = False
    weights: str | None = None
    threads: str = "adapt"


@runtime_checkable
class NormHost(Protocol):
    """A module whose RMS norm tries ``norm_kernel(x, weight, eps, offset)`` first (``qkv.nn.RMSNorm``,
    ``qkv.nn.GatedRMSNorm``; None: torch's ops)."""

    norm_kernel: Callable | None


@runtime_checkable
class GateHost(Protocol):
    """A module whose gated activation tries ``gate_kernel(h, activation)`` first (``qkv.nn.GatedMLP``,
    ``qkv.nn.moe.Experts``; None: torch's ops)."""

    gate_kernel: Callable | None


@runtime_checkable
class RotaryHost(Protocol):
    """A module whose rotary embedding tries ``rotary_kernel(x, cos, sin, interleaved)`` first (the decoder's
    self-attention; None: torch's ops)."""

    rotary_kernel: Callable | None


@runtime_checkable
class ExpertsHost(Protocol):
    """A stacked experts module that tries ``experts_kernel.one_token`` / ``.grouped`` first
    (``qkv.nn.moe.ExpertsKernel``; None: its loop)."""

    experts_kernel: object | None


@runtime_checkable
class DeltaHost(Protocol):
    """A gated-delta mixer that tries ``delta_kernel`` (``qkv.nn._recurrent.DeltaKernel``) for its decode step and
    its chunked rule first (None: torch's ops)."""

    delta_kernel: object | None


@runtime_checkable
class DecodeHost(Protocol):
    """An attention module whose single-query steps run on the backend named ``decode_backend``."""

    decode_backend: str | None


#: Each compiled-kernel slot and the kernel :func:`optimize` puts there.
_SLOTS = ((NormHost, "norm_kernel", fused.rms_norm), (GateHost, "gate_kernel", fused.silu_gate),
          (RotaryHost, "rotary_kernel", fused.rotary), (ExpertsHost, "experts_kernel", fused.EXPERTS),
          (DeltaHost, "delta_kernel", fused.DELTA))
_DECODE_MARK = "_qkv_cpu_decode_backend"  # the decode backend a module named before optimize gave it "auto"


@runtime_checkable
class LinearHost(Protocol):
    """A module that multiplies by weights it holds outside an ``nn.Linear`` (a tied LM head, stacked
    experts, a fused QKV) through ``self.linear_fn(x, weight, bias=None)``, ``F.linear``'s signature;
    ``F.linear`` by default. :func:`optimize` replaces ``F.linear`` (never a function the user set)."""

    linear_fn: Callable[..., torch.Tensor]


@runtime_checkable
class ActivatedUpProjection(Protocol):
    """A block whose hidden layer is ``up_activation(up_proj(x))`` (``up_activation`` None: nothing is
    applied after ``up_proj``). :func:`optimize` may move the activation into ``up_proj`` and set it None."""

    up_proj: nn.Module
    up_activation: Callable[[torch.Tensor], torch.Tensor] | None


def optimized(model: nn.Module) -> Optimized | None:
    """How :func:`optimize` last left ``model``, or None when it never ran on it."""
    return model.__dict__.get(_MARK)


def step(model) -> contextlib.AbstractContextManager:
    """The context one step of ``model`` runs under (``qkv.models.generate`` and the Engine open it around each
    step): :func:`qkv.cpu.threads.step` where :func:`optimize` left ``model`` with ``threads="adapt"``, else
    nothing."""
    mark = model.__dict__.get(_MARK) if isinstance(model, nn.Module) else None
    return step_threads.step() if mark is not None and mark.threads == "adapt" else contextlib.nullcontext()


def _set_step_hooks(model: nn.Module, adapt: bool) -> None:
    """Register (``adapt``) or remove the forward hooks that run each ``model(...)`` call under
    :func:`qkv.cpu.threads.step`."""
    handles = model.__dict__.pop(_HOOKS, None)
    if handles is not None:
        for h in handles:
            h.remove()
    if adapt:
        model.__dict__[_HOOKS] = (model.register_forward_pre_hook(step_threads.open_step),
                                  model.register_forward_hook(step_threads.close_step, always_call=True))


def _is_input_major(w: torch.Tensor) -> bool:
    return w.dim() == 2 and not w.is_contiguous() and w.t().is_contiguous()


def _product_layer(child: nn.Linear, pack: bool, input_major: bool | None) -> nn.Linear:
    """``child`` as a :class:`PrepackedLinear` with these options (``child`` itself when it already is one)."""
    want = None if input_major is None else input_major and child.out_features >= child.in_features
    if type(child) is PrepackedLinear and child.pack == pack and want in (None, _is_input_major(child.weight)):
        return child
    activation = child.activation if isinstance(child, PrepackedLinear) else None
    return PrepackedLinear.from_linear(child, pack=pack, activation=activation, input_major_weight=want)


def _head_layers(model: nn.Module) -> set[int]:
    """The ids of the LM head layers of ``model``'s greedy heads (:class:`GreedyHead` modules' ``lm_head``)."""
    return {id(m.lm_head) for m in model.modules()
            if isinstance(m, GreedyHead) and isinstance(getattr(m, "lm_head", None), nn.Linear)}


def _narrow_layer(child: nn.Linear, weights: str, pack: bool, input_major: bool | None) -> nn.Module:
    """``child`` in the weight format ``weights`` (a fused activation carried over): quantized to int8, or with its
    weight held in bfloat16 where that keeps every value (else the float32 product layer)."""
    activation = getattr(child, "activation", None)
    if weights == "int8":
        return Int8Linear.from_linear(child, activation=activation)
    if is_bf16_exact(child.weight):
        return Bf16ExactLinear.from_linear(child, activation=activation)
    return _product_layer(child, pack, input_major)


def optimize(model: nn.Module, *, onednn: bool | None = None, input_major: bool | None = None,
             screen: bool | None = None, compiled: bool = True, weights: str | None = None,
             threads: str = "adapt") -> nn.Module:
    """Swap the CPU products of :mod:`qkv.cpu` into ``model`` (in place) and return it.

    Args:
        model: any ``nn.Module``; a bare ``nn.Linear`` comes back as a new module sharing its parameters
            (use the return value).
        onednn: None (default): pack weights for oneDNN where this torch build runs it
            (:func:`qkv.cpu.gemm.onednn_unavailable_reason`); True: require it (``RuntimeError`` saying why
            it cannot run); False: never (row blocks and ``F.linear`` only, no second copy of any weight).
        input_major: True stores the weights of layers with at least as many outputs as inputs input-major
            (column blocks for few rows; an ablation, slower than row blocks in ``benchmarks/RESULTS.md``),
            False stores every weight standard, None (default) keeps each weight's layout. Where a layout
            changes the parameter becomes a new object: build a ``torch.optim`` optimizer after.
        screen: None (default): greedy heads (:class:`qkv.cpu.greedy.GreedyHead`) get an int8 screen where
            it runs here (:func:`qkv.cpu.greedy.screen_unavailable_reason`); True: require it (``RuntimeError``
            saying why it cannot run); False: never (and a screen set before is removed).
        compiled: True (default) puts qkv's compiled kernels (:mod:`qkv.cpu.fused`) into every module's slot for
            them (each declines, call by call, what it does not run: another device or dtype, autograd, the
            kernels unavailable); False removes them (the model computes with torch's ops alone).
        weights: None (default) keeps every weight in its dtype. ``"bf16-exact"``: every linear layer but a
            greedy LM head whose float32 weight holds only bfloat16 values (a bf16 checkpoint loaded as float32)
            keeps it in bfloat16, the same numbers at half the bytes, multiplied in float32
            (:class:`qkv.cpu.weights.Bf16ExactLinear`; lossless; the other layers as with None). ``"int8"``:
            every linear layer but the LM head quantized per channel (:class:`qkv.cpu.weights.Int8Linear`;
            lossy). Both are for inference (no weight gradient) and need qkv's compiled kernels.
        threads: ``"adapt"`` (default): each call of ``model`` (and each step ``qkv.models.generate`` and the
            Engine run) uses torch's intra-op threads, but no more than the cores other processes leave free
            (:mod:`qkv.cpu.threads`: beside busy processes a step of many small parallel regions waits for
            descheduled workers); ``"fixed"``: torch's setting always.

    Returns:
        ``model`` (see above for a bare ``nn.Linear``), marked so :func:`optimized` reports the options.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize: model must be a torch.nn.Module, got {type(model).__name__}")
    if not (onednn is None or isinstance(onednn, bool)):
        raise TypeError(f"optimize: onednn must be None (where available), True or False, got {onednn!r}")
    if not (input_major is None or isinstance(input_major, bool)):
        raise TypeError(f"optimize: input_major must be None (keep layouts), True or False, got {input_major!r}")
    if not (screen is None or isinstance(screen, bool)):
        raise TypeError(f"optimize: screen must be None (where available), True or False, got {screen!r}")
    if not isinstance(compiled, bool):
        raise TypeError(f"optimize: compiled must be True (qkv's compiled kernels) or False (torch's ops), got "
                        f"{compiled!r}")
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ValueError(f"optimize: weights must be None (keep each weight's dtype) or one of {WEIGHT_FORMATS}, got "
                         f"{weights!r}")
    if threads not in step_threads.THREAD_MODES:
        raise ValueError(f"optimize: threads must be one of {step_threads.THREAD_MODES} (\"adapt\": no more threads "
                         f"than free cores; \"fixed\": torch's setting), got {threads!r}")
    if weights is not None and ops.unavailable_reason() is not None:
        raise RuntimeError(f"optimize: weights={weights!r} needs qkv's compiled kernels, which cannot run here: "
                           f"{ops.unavailable_reason()}")
    heads = _head_layers(model) if weights is not None else set()
    no_screen = screen_unavailable_reason() if screen is not False else None
    if screen is True and no_screen is not None:
        raise RuntimeError(f"optimize: screen=True cannot run: {no_screen}; pass screen=None to use it where "
                           f"available")
    screened = screen is not False and no_screen is None
    screened_any = False  # some greedy head got a screen
    why = gemm.onednn_unavailable_reason()
    if onednn is True and why is not None:
        raise RuntimeError(f"optimize: onednn=True cannot run: {why}; pass onednn=None to use it where available")
    pack = onednn is not False and why is None
    if type(model) is nn.Linear or isinstance(model, SkinnyLinear):
        model = (_narrow_layer(model, weights, pack, input_major) if weights is not None
                 else _product_layer(model, pack, input_major))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if weights is not None and isinstance(child, nn.Linear) and id(child) not in heads:
                setattr(parent, name, _narrow_layer(child, weights, pack, input_major))
            elif type(child) is nn.Linear or isinstance(child, SkinnyLinear):
                setattr(parent, name, _product_layer(child, pack, input_major))
        if isinstance(parent, LinearHost) and (parent.linear_fn is F.linear
                                               or isinstance(parent.linear_fn, LinearProducts)):
            if not (isinstance(parent.linear_fn, LinearProducts) and parent.linear_fn.pack == pack):
                parent.linear_fn = LinearProducts(pack)
        if (pack and isinstance(parent, ActivatedUpProjection) and parent.up_activation is not None
                and isinstance(parent.up_proj, PrepackedLinear) and parent.up_proj.activation is None
                and can_fuse(parent.up_activation)):
            parent.up_proj.activation, parent.up_activation = parent.up_activation, None
        if isinstance(parent, GreedyHead):
            if (parent.head_screen is None) == screened:
                parent.head_screen = HeadScreen() if screened else None
            screened_any = screened_any or screened
        for host, slot, kernel in _SLOTS:
            if isinstance(parent, host) and getattr(parent, slot) in (None, kernel):
                setattr(parent, slot, kernel if compiled else None)
        if isinstance(parent, DecodeHost):
            if compiled and parent.decode_backend == "sdpa":
                parent.__dict__[_DECODE_MARK], parent.decode_backend = parent.decode_backend, "auto"
            elif not compiled and _DECODE_MARK in parent.__dict__:
                parent.decode_backend = parent.__dict__.pop(_DECODE_MARK)
    kinds = {type(m) for m in model.modules()}
    held = "int8" if Int8Linear in kinds else "bf16-exact" if Bf16ExactLinear in kinds else None
    _set_step_hooks(model, threads == "adapt")
    model.__dict__[_MARK] = Optimized(onednn=pack, input_major=input_major, screen=screened_any, weights=held,
                                      threads=threads)
    return model


def use_onednn(model: nn.Module) -> nn.Module:
    """``optimize(model, onednn=True)``, kept for code written before :func:`optimize` (which
    ``qkv.models.from_hf``, ``generate`` and ``SentenceEncoder`` call by default, so a user never needs
    this). Raises ``RuntimeError`` saying why when oneDNN cannot run here."""
    why = gemm.onednn_unavailable_reason()
    if why is not None:
        raise RuntimeError(f"use_onednn: {why}; qkv.cpu.optimize(model) applies the other CPU products without it")
    return optimize(model, onednn=True)
