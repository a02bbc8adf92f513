"""The one door to qkv's compiled CPU kernels: a function per kernel, plus whether the kernels can run here.

Code outside :mod:`qkv.cpu` never loads the kernels itself: a backend that runs a compiled kernel calls the
function of this module of the same name (arguments as the kernel's schema in ``csrc/``), and asks
:func:`unavailable_reason` (``None`` when the kernels run here) before choosing that path, so ``qkv.explain``
can name the reason when it does not. Each function raises ``RuntimeError`` with that reason where the kernels
cannot run; none of them falls back silently.

Example:
    >>> from qkv.cpu import ops
    >>> ops.unavailable_reason() is None or isinstance(ops.unavailable_reason(), str)
    True
"""

from __future__ import annotations

from . import kernels

__all__ = ["available", "unavailable_reason", "profiled", "gather_attention", "gated_delta_chunks", "delta_decode",
           "rows_linear", "moe_token", "moe_grouped", "silu_mul", "rotary", "rms_norm", "decode_attention",
           "paged_decode", "paged_prefill", "paged_store", "screen_pack", "screened_argmax"]

profiled = kernels.profiled


def unavailable_reason() -> str | None:
    """Why the compiled kernels cannot run here (``QKV_CPU_KERNELS=0``, a failed build), or ``None``."""
    return kernels.unavailable_reason()


def available() -> bool:
    """Whether the compiled kernels run here (builds them on first call where they are not built yet)."""
    return kernels.load() is not None


def _mod():
    mod = kernels.load()
    if mod is None:
        raise RuntimeError(f"qkv's compiled CPU kernels are unavailable: {kernels.unavailable_reason()}; ask "
                           "qkv.cpu.ops.unavailable_reason() before choosing a compiled path")
    return mod


def gather_attention(q, k, v, idx, scale, causal, offset, sinks, tile):
    return _mod().gather_attention(q, k, v, idx, scale, causal, offset, sinks, tile)


def gated_delta_chunks(q, k, v, g, beta, state, chunk, safe_log):
    return _mod().gated_delta_chunks(q, k, v, g, beta, state, chunk, safe_log)


def delta_decode(mixed, conv_state, conv_weight, g, beta, state, Hk, q_scale, eps):
    return _mod().delta_decode(mixed, conv_state, conv_weight, g, beta, state, Hk, q_scale, eps)


def rows_linear(x, weight, bias, nb):
    return _mod().rows_linear(x, weight, bias, nb)


def moe_token(x, ids, weights, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit, nb_gate_up, nb_down):
    return _mod().moe_token(x, ids, weights, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit,
                            nb_gate_up, nb_down)


def moe_grouped(x, token, weights, counts, gate_up, gate_up_bias, down, down_bias, clamped, alpha, limit,
                nb_gate_up, nb_down):
    return _mod().moe_grouped(x, token, weights, counts, gate_up, gate_up_bias, down, down_bias, clamped, alpha,
                              limit, nb_gate_up, nb_down)


def silu_mul(h):
    return _mod().silu_mul(h)


def rotary(x, cos, sin, interleaved):
    return _mod().rotary(x, cos, sin, interleaved)


def rms_norm(x, weight, eps, offset):
    return _mod().rms_norm(x, weight, eps, offset)


def decode_attention(q, k, v, q_pos, kv_pos, causal, window, sinks, scale):
    return _mod().decode_attention(q, k, v, q_pos, kv_pos, causal, window, sinks, scale)


def paged_decode(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks):
    return _mod().paged_decode(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks)


def paged_prefill(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks):
    return _mod().paged_prefill(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks)


def paged_store(k_pool, v_pool, k, v, blocks, offsets, src):
    return _mod().paged_store(k_pool, v_pool, k, v, blocks, offsets, src)


def screen_pack(weight):
    return _mod().screen_pack(weight)


def screened_argmax(x, weight, packed, A, B, C, S, R, P):
    return _mod().screened_argmax(x, weight, packed, A, B, C, S, R, P)
