"""The one door to qkv's compiled CPU kernels: a function per operator ``torch.ops.qkv_cpu.<name>``, its
eligibility test, and the shapes its outputs take (for FakeTensor tracing and ``torch.compile``).

Code outside :mod:`qkv.cpu` never loads the kernels itself. A caller that may run a compiled kernel asks the
kernel's ``why_not_<name>(...)`` first: ``None`` where the kernel runs these inputs (CPU tensors, the dtypes it
handles, no gradient being recorded, the kernels loaded), else a reason string that ``qkv.explain`` can name; then
it calls the function of the kernel's name (arguments as the schema in ``csrc/module.cpp``). Each function raises
``RuntimeError`` with the reason where the kernels cannot run; none of them falls back silently. Under autograd
every operator refuses an input that requires a gradient (they have no backward), naming itself.

Example:
    >>> import torch
    >>> from qkv.cpu import ops
    >>> x, w = torch.randn(2, 8), torch.ones(8)
    >>> why = ops.why_not_rms_norm(x, w)
    >>> y = ops.rms_norm(x, w, 1e-6, 0.0) if why is None else torch.nn.functional.rms_norm(x, (8,), w, 1e-6)
    >>> y.shape
    torch.Size([2, 8])
"""

from __future__ import annotations

import torch

from . import kernels

__all__ = ["available", "unavailable_reason", "profiled", "tile_keys", "OPERATORS", "gather_attention",
           "gated_delta_chunks", "delta_decode", "rows_linear", "weight_linear", "moe_token", "moe_grouped",
           "silu_mul", "rotary", "rms_norm", "decode_attention", "paged_decode", "paged_prefill", "paged_store",
           "screen_pack", "screened_argmax",
           "why_not", "why_not_rms_norm", "why_not_silu_mul", "why_not_rotary", "why_not_experts",
           "why_not_delta_decode", "why_not_gated_delta_chunks", "why_not_decode_attention",
           "why_not_gather_attention", "why_not_paged", "why_not_screen", "why_not_weight_linear"]

#: Every operator of the ``qkv_cpu`` library, as ``csrc/module.cpp`` declares them.
OPERATORS = ("gather_attention", "gated_delta_chunks", "delta_decode", "rows_linear", "weight_linear", "moe_token",
             "moe_grouped", "silu_mul", "rotary", "rms_norm", "decode_attention", "paged_decode", "paged_prefill",
             "paged_store", "screen_pack", "screened_argmax")

_FLOATS = (torch.float32, torch.float64)

profiled = kernels.profiled
tile_keys = kernels.tile_keys


def unavailable_reason() -> str | None:
    """Why the compiled kernels cannot run here (``QKV_CPU_KERNELS=0``, a failed build), or ``None``."""
    return kernels.unavailable_reason()


def available() -> bool:
    """Whether the compiled kernels run here (loads or builds them on first call)."""
    return kernels.load() is not None


def why_not(name: str, tensors, *, dtypes=_FLOATS, same_dtype: bool = True) -> str | None:
    """The checks every kernel shares, for the operator ``name`` over ``tensors`` (None entries skipped): CPU,
    a dtype of ``dtypes`` (one dtype throughout when ``same_dtype``), no gradient being recorded, the kernels
    loaded. ``None`` when the kernel runs them, else why not. A decode step asks this some thirty times, so the
    passing case is a few attribute reads per tensor; the reason is worded only when a check fails."""
    grad = torch.is_grad_enabled()
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if not t.is_cpu or t.dtype not in dtypes or (grad and t.requires_grad) or (
                same_dtype and dtype is not None and t.dtype != dtype):
            return _reason(name, tensors, dtypes, same_dtype)
        dtype = t.dtype
    return kernels.unavailable_reason()


def _reason(name: str, tensors, dtypes, same_dtype: bool) -> str:
    present = [t for t in tensors if t is not None]
    for t in present:
        if not t.is_cpu:
            return f"qkv_cpu::{name} is CPU only, got a tensor on {t.device.type}"
    for t in present:
        if t.dtype not in dtypes:
            return (f"qkv_cpu::{name} runs {'/'.join(str(d).removeprefix('torch.') for d in dtypes)}, got "
                    f"{str(t.dtype).removeprefix('torch.')}")
        if same_dtype and t.dtype != present[0].dtype:
            return f"qkv_cpu::{name} needs one dtype, got {present[0].dtype} and {t.dtype}"
    return f"autograd records this call (qkv_cpu::{name} has no backward)"


def why_not_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Whether :func:`rms_norm` runs ``x (..., D)`` with ``weight (D,)``: float32/float64/bfloat16 of one dtype,
    CPU (bfloat16 normalizes in float32, rounded once)."""
    return why_not("rms_norm", (x, weight), dtypes=(torch.float32, torch.float64, torch.bfloat16))


def why_not_silu_mul(h: torch.Tensor) -> str | None:
    """Whether :func:`silu_mul` runs ``h (..., 2f)``: float32/float64 with a unit last stride, CPU."""
    if h.dim() < 1 or h.shape[-1] % 2 or h.stride(-1) != 1:
        return f"qkv_cpu::silu_mul needs h (..., 2f) with a unit last stride, got {tuple(h.shape)}"
    return why_not("silu_mul", (h,))


def why_not_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Whether :func:`rotary` runs ``x (B, H, N, D)`` with ``cos``/``sin`` (any floating dtype, CPU)."""
    return why_not("rotary", (x, cos, sin), dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16),
                   same_dtype=False)


def why_not_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str | None:
    """Whether :func:`moe_token` / :func:`moe_grouped` run these experts: contiguous stacked weights, CPU."""
    if not gate_up.is_contiguous() or not down.is_contiguous():
        return "qkv_cpu::moe_token needs contiguous stacked expert weights"
    return why_not("moe_token", (x, gate_up, down), dtypes=(torch.float32, torch.float64, torch.bfloat16,
                                                             torch.float16), same_dtype=False)


def why_not_delta_decode(*tensors: torch.Tensor | None) -> str | None:
    """Whether :func:`delta_decode` runs a gated-delta step over these tensors: float32/float64 of one dtype, CPU."""
    return why_not("delta_decode", tensors)


def why_not_gated_delta_chunks(*tensors: torch.Tensor | None) -> str | None:
    """Whether :func:`gated_delta_chunks` runs these tensors (CPU, any of them recording no gradient)."""
    return why_not("gated_delta_chunks", tensors, dtypes=(torch.float32, torch.float64, torch.float16,
                                                          torch.bfloat16), same_dtype=False)


def why_not_decode_attention(*tensors: torch.Tensor | None) -> str | None:
    """Whether :func:`decode_attention` runs queries, keys, values (and sinks): float32/float64/bfloat16 (computed in
    float32) of one dtype, CPU."""
    return why_not("decode_attention", tensors, dtypes=_FLOATS + (torch.bfloat16,))


def why_not_gather_attention(*tensors: torch.Tensor | None) -> str | None:
    """Whether :func:`gather_attention` runs queries, keys, values (and sinks): float32/float64, CPU."""
    return why_not("gather_attention", tensors)


def why_not_paged(*tensors: torch.Tensor | None, decode: bool = False) -> str | None:
    """Whether :func:`paged_decode` / :func:`paged_prefill` / :func:`paged_store` run these: float32/float64 (and
    bfloat16, computed in float32, for ``decode``: :func:`paged_decode`), CPU."""
    return why_not("paged_decode" if decode else "paged_prefill", tensors,
                   dtypes=_FLOATS + (torch.bfloat16,) if decode else _FLOATS)


def why_not_screen(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Whether :func:`screened_argmax` runs ``x (M, K)`` float32 against ``weight (V, K)`` float32 or bfloat16 (packed
    by :func:`screen_pack` from float32), CPU (the int8 GEMM itself is probed by
    :func:`qkv.cpu.greedy.screen_unavailable_reason`)."""
    return why_not("screened_argmax", (x,), dtypes=(torch.float32,)) or why_not(
        "screened_argmax", (weight,), dtypes=(torch.float32, torch.bfloat16))


def why_not_weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                          bias: torch.Tensor | None) -> str | None:
    """Whether :func:`weight_linear` runs ``x (..., K)`` (float32/bfloat16) by a contiguous ``weight (N, K)``,
    float32 or bfloat16 without ``scale`` or int8 with a float32 ``scale (N,)``, and ``bias (N,)`` or None, on the
    CPU."""
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.int8) or not weight.is_contiguous():
        return (f"qkv_cpu::weight_linear needs a contiguous float32, bfloat16 or int8 weight, got "
                f"{str(weight.dtype).removeprefix('torch.')}{'' if weight.is_contiguous() else ' (not contiguous)'}")
    if (weight.dtype == torch.int8) != (scale is not None) or (scale is not None and scale.dtype != torch.float32):
        return "qkv_cpu::weight_linear needs a float32 scale with an int8 weight and none with another"
    why = why_not("weight_linear", (x,), dtypes=(torch.float32, torch.bfloat16))
    return why or why_not("weight_linear", (weight, scale, bias), dtypes=(torch.int8, torch.bfloat16, torch.float32,
                                                                         torch.float16), same_dtype=False)


def _op(name: str):
    """The operator ``qkv_cpu::<name>`` (its one overload), or ``RuntimeError`` saying why the kernels are off."""
    mod = kernels.load()
    if mod is None:
        raise RuntimeError(f"qkv's compiled CPU kernels are unavailable: {kernels.unavailable_reason()}; ask "
                           "qkv.cpu.ops.unavailable_reason() (or the kernel's why_not_*) before choosing a "
                           "compiled path")
    return getattr(mod, name).default


def gather_attention(q, k, v, idx, scale, causal, offset, sinks, tile):
    return _op("gather_attention")(q, k, v, idx, scale, causal, offset, sinks, tile)


def gated_delta_chunks(q, k, v, g, beta, state, chunk, safe_log):
    return _op("gated_delta_chunks")(q, k, v, g, beta, state, chunk, safe_log)


def delta_decode(mixed, conv_state, conv_weight, g, beta, state, Hk, q_scale, eps):
    return _op("delta_decode")(mixed, conv_state, conv_weight, g, beta, state, Hk, q_scale, eps)


def rows_linear(x, weight, bias, nb):
    return _op("rows_linear")(x, weight, bias, nb)


def weight_linear(x, weight, scale, bias):
    return profiled("weight_linear", _op("weight_linear"), x, weight, scale, bias)


def moe_token(x, ids, weights, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit, nb_gate_up, nb_down):
    return _op("moe_token")(x, ids, weights, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit,
                            nb_gate_up, nb_down)


def moe_grouped(x, token, weights, counts, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit,
                nb_gate_up, nb_down):
    return _op("moe_grouped")(x, token, weights, counts, gate_up, gate_up_bias, down, down_bias, clamped, alpha,
                              limit, nb_gate_up, nb_down)


def silu_mul(h):
    return profiled("silu_mul", _op("silu_mul"), h)


def rotary(x, cos, sin, interleaved):
    return profiled("rotary", _op("rotary"), x, cos, sin, interleaved)


def rms_norm(x, weight, eps, offset):
    return profiled("rms_norm", _op("rms_norm"), x, weight, eps, offset)


def decode_attention(q, k, v, q_pos, kv_pos, causal, window, sinks, scale):
    return profiled("decode_attention", _op("decode_attention"), q, k, v, q_pos, kv_pos, causal, window, sinks,
                    scale)


def paged_decode(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks):
    return _op("paged_decode")(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks)


def paged_prefill(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks):
    return _op("paged_prefill")(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks)


def paged_store(k_pool, v_pool, k, v, blocks, offsets, src):
    return _op("paged_store")(k_pool, v_pool, k, v, blocks, offsets, src)


def screen_pack(weight):
    return _op("screen_pack")(weight)


def screened_argmax(x, weight, packed, A, B, C, S, R, P, cap=0.0, logit_bits=24):
    return _op("screened_argmax")(x, weight, packed, A, B, C, S, R, P, float(cap), int(logit_bits))
