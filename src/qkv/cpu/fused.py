"""Compiled implementations that :func:`qkv.cpu.optimize` puts into a model's modules from outside.

The modules of :mod:`qkv.nn`, :mod:`qkv.pos` and :mod:`qkv.linear` compute with torch's ops and import nothing from
here. Each one whose work a compiled kernel does faster declares a slot, ``None`` until :func:`qkv.cpu.optimize`
fills it with one of these (structural types: :mod:`qkv.cpu.optimize` declares them as ``typing.Protocol``\\ s):

- ``norm_kernel`` (``qkv.nn.RMSNorm``, ``qkv.nn.GatedRMSNorm``): :func:`rms_norm`, ``norms.cpp``;
- ``gate_kernel`` (``qkv.nn.GatedMLP``, ``qkv.nn.moe.Experts``): :func:`silu_gate`, SwiGLU's ``silu(gate) * up``
  in one pass (``activations.cpp``);
- ``rotary_kernel`` (the decoder's ``SelfAttention``): :func:`rotary` (``rotary.cpp``);
- ``experts_kernel`` (``qkv.nn.moe.Experts``, ``ClampedSwiGLUExperts``): :data:`EXPERTS`, one token's or a few
  tokens' routed experts in one call (``products.cpp``);
- ``delta_kernel`` (``qkv.nn.GatedDeltaNet``, ``qkv.nn.KimiDeltaAttention``): :data:`DELTA`, the gated-delta decode
  step after the projections (``delta_decode.cpp``) and the chunked gated delta rule (``gated_delta.cpp``, the
  ``kernel`` argument of ``qkv.linear.gated_delta_chunked``).

Each returns ``None`` for a call its kernel does not run (another device or dtype, autograd recording, the kernels
unavailable: :mod:`qkv.cpu.ops`' ``why_not_*`` says which), and the module then runs its torch ops, which give the
same values (bit for bit for the gate, rotary and experts; within a rounding for the rest).

Example:
    >>> import torch
    >>> from qkv.cpu import fused
    >>> x, w = torch.randn(2, 8), torch.ones(8)
    >>> y = fused.rms_norm(x, w, 1e-6, 0.0)
    >>> y is None or torch.allclose(y, torch.nn.functional.rms_norm(x, (8,), w, 1e-6), atol=1e-6)
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import ops
from .gemm import planned_row_blocks
from .rule import MEASURED_ROWS

__all__ = ["rms_norm", "silu_gate", "rotary", "CompiledExperts", "CompiledDelta", "EXPERTS", "DELTA"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor | None:
    """``x / rms(x) * (offset + weight)`` in one compiled loop (the sum of squares in float64), or None."""
    if ops.why_not_rms_norm(x, weight) is not None:
        return None
    return ops.rms_norm(x, weight, eps, offset)


def silu_gate(h: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """``silu(gate) * up`` of a fused gate-up projection ``h (..., 2f)`` in one pass (torch's values bit for bit),
    for a SiLU ``activation``; None for any other activation or a call the kernel does not run."""
    if activation is not F.silu or ops.why_not_silu_mul(h) is not None:
        return None
    return ops.silu_mul(h)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """``qkv.pos.apply_rotary`` in one call from C++ (the same ops, less dispatch), or None."""
    if ops.why_not_rotary(x, cos, sin) is not None:
        return None
    return ops.rotary(x, cos, sin, interleaved)


class CompiledExperts:
    """Routed experts of a stacked ``Experts`` / ``ClampedSwiGLUExperts`` module (``gate_up_proj (E, 2f, d)``,
    ``down_proj (E, d, f)``, optional biases, ``linear_fn``) in one compiled call: the same products
    (:func:`qkv.cpu.gemm.planned_row_blocks`) and activation ops as the module's loop, in the same order, so the same
    values."""

    @staticmethod
    def _declines(experts, x: torch.Tensor) -> bool:
        return ops.why_not_experts(x, experts.gate_up_proj, experts.down_proj) is not None

    def one_token(self, experts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, *,
                  clamped: bool) -> torch.Tensor | None:
        """One token's routed experts: x (1, d), idx and weights (1, k) -> (1, d), or None (the caller's loop)."""
        if self._declines(experts, x):
            return None
        up, down = experts.gate_up_proj, experts.down_proj
        nb_up = planned_row_blocks(experts.linear_fn, x, up[0])
        nb_down = planned_row_blocks(experts.linear_fn, x.new_empty(1, down.shape[-1]), down[0])
        if nb_up is None or nb_down is None:
            return None
        alpha, limit = (experts.alpha, experts.limit) if clamped else (0.0, 0.0)
        return ops.moe_token(x, idx[0].tolist(), weights[0], up, getattr(experts, "gate_up_proj_bias", None), down,
                             getattr(experts, "down_proj_bias", None), clamped, alpha, limit, nb_up, nb_down)

    def grouped(self, experts, x: torch.Tensor, token: torch.Tensor, w: torch.Tensor, counts: list[int], *,
                clamped: bool) -> torch.Tensor | None:
        """A few tokens' routed experts (x (T, d); the assignments grouped by expert: ``token`` and router weights
        ``w`` (A,), ``counts`` per expert) -> (T, d), or None (more rows than the product rule measured, an
        expert's row count that goes to oneDNN, or a call the kernel does not run)."""
        if x.shape[0] > MEASURED_ROWS or self._declines(experts, x):
            return None
        up, down = experts.gate_up_proj, experts.down_proj
        plans: dict[int, tuple[int | None, int | None]] = {}
        nb_up, nb_down = [], []
        for n in counts:
            if n not in plans:
                one = x.new_empty(1)  # stand-ins of the expert's (n, d) input and (n, f) hidden rows, for the plans
                rows_in, rows_h = one.expand(max(n, 1), x.shape[-1]), one.expand(max(n, 1), down.shape[-1])
                plans[n] = (planned_row_blocks(experts.linear_fn, rows_in, up[0]),
                            planned_row_blocks(experts.linear_fn, rows_h, down[0]))
            a, b = plans[n]
            if a is None or b is None:
                return None
            nb_up.append(a)
            nb_down.append(b)
        alpha, limit = (experts.alpha, experts.limit) if clamped else (0.0, 0.0)
        return ops.moe_grouped(x, token, w, counts, up, getattr(experts, "gate_up_proj_bias", None), down,
                               getattr(experts, "down_proj_bias", None), clamped, alpha, limit, nb_up, nb_down)


class CompiledDelta:
    """The gated delta rule's compiled kernels for a recurrent mixer: :meth:`step` (a decode step after the
    projections: the short convolution, L2 norms and the rule in one call) and :meth:`__call__` / :meth:`why_not`,
    the ``kernel`` of ``qkv.linear.gated_delta_chunked`` (the chunked rule a chunk at a time in cache)."""

    @staticmethod
    def why_not(*tensors: torch.Tensor | None) -> str | None:
        """Why the chunked kernel does not run these tensors, or None."""
        return ops.why_not_gated_delta_chunks(*tensors)

    def __call__(self, q, k, v, g, beta, state, chunk_size: int, safe_log: float):
        """The chunked rule over contiguous ``q, k (B, Hk, N, Dk)``, ``v (B, H, N, Dv)``, ``g (B, H, N[, Dk])``,
        ``beta (B, H, N)``, ``state (B, H, Dk, Dv)`` -> ``(out (B, H, N, Dv), state)``."""
        out, S = ops.gated_delta_chunks(q, k, v, g, beta, state, chunk_size, safe_log)
        return out, S

    @staticmethod
    def step_declines(*tensors: torch.Tensor | None) -> str | None:
        """Why :meth:`step` does not run these tensors (one float32/float64 dtype throughout, CPU, no gradient)."""
        return ops.why_not_delta_decode(*tensors)

    @staticmethod
    def step(mixed, conv_state, conv_weight, g, beta, state, Hk: int, q_scale: float, eps: float):
        """``mixed (B, Cc)``, ``conv_state (B, Cc, K - 1)``, ``conv_weight (Cc, K)``, ``g (B, H[, Dk])``,
        ``beta (B, H)``, ``state (B, H, Dk, Dv)``, all contiguous -> ``(o (B, H, Dv), conv_state, state)``."""
        o, conv, S = ops.delta_decode(mixed, conv_state, conv_weight, g, beta, state, Hk, q_scale, eps)
        return o, conv, S


#: The one :class:`CompiledExperts` :func:`qkv.cpu.optimize` gives every experts module.
EXPERTS = CompiledExperts()

#: The one :class:`CompiledDelta` :func:`qkv.cpu.optimize` gives every gated-delta mixer.
DELTA = CompiledDelta()
