"""Attention dropout as a pure function of (seed, b, h, q_idx, kv_idx).

The keep/drop decision for each probability comes from a counter-based hash of its coordinates, so
any backend reproduces the same pattern tile by tile, and a backward pass recomputes it from the seed
instead of storing an (Nq, Nk) mask (the approach of Salmon et al. 2011, "Parallel random numbers:
as easy as 1, 2, 3", with a small integer hash in place of Philox). The hash is Chris Wellons'
"lowbias32" 32-bit mixer, applied twice to cover a 64-bit counter.
"""

from __future__ import annotations

import torch

__all__ = ["draw_seed", "keep_mask"]

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic; the low 32 bits are exact under wrap-around multiplication.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def draw_seed(generator: torch.Generator | None) -> int:
    """One 31-bit seed from ``generator`` (or torch's default generator)."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def keep_mask(seed: int, p: float, b, h, q_idx, kv_idx, H: int, nq: int, nk: int) -> torch.Tensor:
    """Boolean keep-mask (True = kept) for dropout probability ``p`` at broadcastable coordinates."""
    counter = ((b * H + h) * nq + q_idx) * nk + kv_idx
    lo, hi = counter & _M32, counter >> 32
    u = _mix32(lo ^ _mix32(hi ^ (seed & _M32)))
    return u >= int(p * 2**32)
