"""The ``cpu_decode`` backend: a cached decode step on the CPU in one call of qkv's compiled kernel.

A decode step attends one new query per row to everything its cache holds, under a :func:`qkv.masks.positions`
mask (the cache's positions, causal and windowed by position, padding slots at -1). As torch ops that is a mask
built and materialized per step and SDPA over it; ``decode_attention.cpp`` (qkv's paged-decode kernel over the cache
as one block a row, after PagedAttention: Kwon et al. 2023, arXiv:2309.06180) reads each KV head once for its query
heads, applies the positions rule per slot and adds the sinks to the denominator, in one call reached through
:mod:`qkv.cpu.ops`. It takes one query per row, a positions mask, no score modifier, ``Dv == Dqk``, float32/float64
or bfloat16 (computed in float32, rounded once) CPU tensors that need no gradient, no ``return_lse``, and the
kernels built; it declines anything else with the reason (``qkv.explain`` names it), and a request naming it
that it declines raises.

``qkv.cpu.optimize`` makes it a model's single-query backend where the model's was ``"sdpa"``.

Example:
    >>> import torch, qkv
    >>> from qkv import masks
    >>> q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    >>> m = masks.positions(torch.tensor([[4]]), torch.arange(5)[None])
    >>> out = qkv.attention(q, k, v, mask=m, backend="auto")
    >>> torch.allclose(out, qkv.attention(q, k, v, mask=m, backend="reference"), atol=1e-5)
    True
"""

from __future__ import annotations

from .._request import AttentionOutput, Request
from ..cpu import ops
from ..masks.sequence import Positions
from .base import Backend, Estimate

__all__ = ["CPUDecodeBackend"]

#: Seconds per key and query head of the kernel, a rough CPU figure for ``auto``'s comparison (it reads K and V
#: once and does 4 D flops per pair; measured near torch SDPA's rate without SDPA's mask and dispatch).
_PAIR_SECONDS = 2e-10


class CPUDecodeBackend(Backend):
    """One query per row over a cache by positions, by qkv's compiled CPU kernel (``decode_attention.cpp``)."""

    name = "cpu_decode"
    native_sinks = True

    def decline(self, req: Request) -> str | None:
        if req.return_lse:
            return "return_lse=True: the decode kernel returns the output only"
        if req.dropout_p > 0:
            return "dropout: the decode kernel has none"
        if type(req.mask) is not Positions:
            return "needs a qkv.masks.positions mask (a cached decode step)"
        if req.Nq != 1:
            return f"one query per row only, got Nq={req.Nq}"
        if req.score_mod is not None:
            return f"score_mod {req.score_mod!r}: the decode kernel adds no score terms"
        if req.Dv != req.Dqk:
            return f"Dv={req.Dv} differs from Dqk={req.Dqk}"
        if req.Nk == 0:
            return "no keys"
        return ops.why_not_decode_attention(req.q, req.k, req.v, req.sinks)

    def estimate(self, req: Request) -> Estimate:
        pairs = req.B * req.Hq * req.Nk * (req.Dqk + req.Dv) / 64
        return Estimate(pairs * _PAIR_SECONDS + 5e-6, "compiled kernel, reads the cache in place by positions")

    def run(self, req: Request) -> AttentionOutput:
        m = req.mask
        m.check(req.B, req.Hq, 1, req.Nk)
        # its sums keep a NaN or +inf score (no per-register reduction drops it), so no non-finite check follows
        out = ops.decode_attention(req.q, req.k, req.v, m.qp, m.kp, m.causal, m.window or 0, req.sinks, req.scale)
        return AttentionOutput(out, None)  # type: ignore[arg-type]
