"""The shapes, dtypes and layouts of the ``qkv_cpu`` operators' outputs, computed without running them: their fake
implementations (``torch.library.register_fake``), which FakeTensor tracing, ``torch.export`` and ``torch.compile``
call in place of the C++ kernels. Each mirrors the allocations at the end of its kernel in ``csrc/``.

:func:`register` runs once, when :mod:`qkv.cpu.kernels` has loaded the library (a fake can only be attached to an
operator that exists).

Example:
    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> from qkv.cpu import ops
    >>> if ops.available():
    ...     with FakeTensorMode() as mode:
    ...         y = ops.rms_norm(mode.from_tensor(torch.randn(3, 8)), mode.from_tensor(torch.ones(8)), 1e-6, 0.0)
    ...     print(tuple(y.shape))
    ... else:
    ...     print((3, 8))
    (3, 8)
"""

from __future__ import annotations

import torch

__all__ = ["register", "SCREEN_BLOCK"]

#: Vocabulary entries per packed block of the LM head's int8 screen (``kBlock`` in ``greedy_head.cpp``).
SCREEN_BLOCK = 32

_done = False


def _rows(x: torch.Tensor, last: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], last), dtype=dtype or x.dtype)


def _gather_attention(q, k, v, idx, scale, causal, offset, sinks, tile):
    B, H, N, _ = q.shape
    return [q.new_empty(B, H, N, v.shape[-1]), q.new_empty(B, H, N)]


def _gated_delta_chunks(q, k, v, g, beta, state, chunk, safe_log):
    return [v.new_empty(v.shape), torch.empty_like(state, memory_format=torch.contiguous_format)]


def _delta_decode(mixed, conv_state, conv_weight, g, beta, state, Hk, q_scale, eps):
    B, H, _, Dv = state.shape
    return [mixed.new_empty(B, H, Dv), torch.empty_like(conv_state), torch.empty_like(state)]


def _rows_linear(x, weight, bias, nb):
    return _rows(x, weight.shape[0])


def _weight_linear(x, weight, scale, bias):
    return _rows(x, weight.shape[0])


def _moe(x, *args):
    return torch.empty_like(x)


def _silu_mul(h):
    return _rows(h, h.shape[-1] // 2)


def _rotary(x, cos, sin, interleaved):
    fused = (x.dtype in (torch.float32, torch.float64) and cos.dtype == x.dtype and sin.dtype == x.dtype
             and x.dim() == 4 and cos.dim() in (2, 3) and cos.shape == sin.shape and cos.shape[-2] == x.shape[2]
             and (cos.dim() == 2 or cos.shape[0] in (1, x.shape[0])) and x.stride(-1) == 1
             and cos.stride(-1) == 1 and sin.stride(-1) == 1)
    return torch.empty_like(x) if fused else x.new_empty(x.shape)


def _rms_norm(x, weight, eps, offset):
    return x.new_empty(x.shape)


def _decode_attention(q, k, v, q_pos, kv_pos, causal, window, sinks, scale):
    B, H = q.shape[:2]
    return q.new_empty(B, H, 1, v.shape[-1])


def _paged_decode(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks):
    B, H = q.shape[:2]
    return [q.new_empty(B, H, v_pool.shape[3]), q.new_empty(B, H)]


def _paged_prefill(q, k_pool, v_pool, tables, kv_pos, q_pos, scale, window, causal, sinks):
    B, H, N = q.shape[:3]
    return [q.new_empty(B, N, H, v_pool.shape[3]).permute(0, 2, 1, 3), q.new_empty(B, H, N)]


def _paged_store(k_pool, v_pool, k, v, blocks, offsets, src):
    return None


def _screen_pack(weight):
    V, K = weight.shape
    nb, Kp = (V + SCREEN_BLOCK - 1) // SCREEN_BLOCK, (K + 3) // 4 * 4
    Vp = nb * SCREEN_BLOCK
    floats = [weight.new_empty(Vp) for _ in range(4)]
    return [weight.new_empty(nb, Kp, SCREEN_BLOCK, dtype=torch.int8), *floats,
            weight.new_empty(Vp, dtype=torch.int32), weight.new_empty(1)]


def _screened_argmax(x, weight, packed, A, B, C, S, R, P, cap=0.0, logit_bits=24):
    M = x.shape[0]
    return [x.new_empty(M, dtype=torch.int64), x.new_empty(M, dtype=torch.bool), x.new_empty(M, dtype=torch.int64),
            x.new_empty(M, dtype=torch.int64)]


_FAKES = {"gather_attention": _gather_attention, "gated_delta_chunks": _gated_delta_chunks,
          "delta_decode": _delta_decode, "rows_linear": _rows_linear,
          "weight_linear": _weight_linear, "moe_token": _moe, "moe_grouped": _moe,
          "silu_mul": _silu_mul, "rotary": _rotary, "rms_norm": _rms_norm, "decode_attention": _decode_attention,
          "paged_decode": _paged_decode, "paged_prefill": _paged_prefill, "paged_store": _paged_store,
          "screen_pack": _screen_pack, "screened_argmax": _screened_argmax}


def register() -> None:
    """Attach every fake implementation to its operator (once; the library must be loaded)."""
    global _done
    if _done:
        return
    for name, fn in _FAKES.items():
        torch.library.register_fake(f"qkv_cpu::{name}", fn)
    _done = True
