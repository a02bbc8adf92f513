"""What a backend is: it declines a request with a reason, estimates its cost, or runs it.

Backends import only the core's shared types (``qkv._request``, ``qkv.masks``, ``qkv.mods``), never
one another. The cost estimate is deliberately simple: the work a backend actually does (dense or
only the allowed tiles) over a nominal rate, plus a fixed per-call overhead; ``qkv.explain`` prints it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._request import AttentionOutput, Request

__all__ = ["Backend", "Estimate", "NOMINAL_FLOPS", "PREDICATE_PAIR_SECONDS", "dense_flops", "predicate_seconds",
           "restore_nonfinite", "format_seconds", "format_size", "format_work"]

#: Nominal matmul rates (FLOP/s) used to turn work into an estimated time; only ratios matter.
NOMINAL_FLOPS = {"cpu": 1.0e11, "cuda": 2.0e14}


class Estimate(NamedTuple):
    """Estimated seconds and what the estimate counted."""

    seconds: float
    note: str

    def __str__(self) -> str:
        return f"~{format_seconds(self.seconds)} ({self.note})"


def format_seconds(seconds: float) -> str:
    """A duration in the unit that keeps 1-999 of it: ``'12.3 us'``, ``'4.5 ms'``, ``'40 s'``, ``'2.1 h'``."""
    for unit, size in (("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def format_size(num_bytes: float) -> str:
    """Bytes with a decimal prefix: ``'512 B'``, ``'4.19 MB'``."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.3g} B"


def format_work(flops: float) -> str:
    """A FLOP count with a decimal prefix: ``'307 kFLOP'``, ``'1.2 GFLOP'``."""
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops:.3g} FLOP"


class Backend:
    name: str = "?"
    #: True when ``run`` honours ``req.sinks`` itself; otherwise ``qkv.attention`` runs the backend without
    #: them, asks for its log-sum-exp and merges the sinks in (``qkv._sinks``), so a backend that returns an
    #: lse under autograd must also take its gradient (``dlse``) for the sinks' gradients to be right.
    native_sinks: bool = False
    #: True when ``run`` honours ``req.batch_invariant`` (each row's bits independent of the rest of the batch,
    #: of prefill chunking and of key splits); the others are declined for such requests by ``qkv.attention``.
    batch_invariant: bool = False
    #: True for a backend that reads block-pool operands (``req.paged``: ``qkv.attention(..., paged=PagedKV(...))``),
    #: and only those; ``qkv.attention`` declines the other requests for it, and paged requests for the others.
    paged_operands: bool = False

    def decline(self, req: Request) -> str | None:
        """``None`` when this backend honours the request exactly; otherwise the reason it cannot."""
        raise NotImplementedError

    def estimate(self, req: Request) -> Estimate:
        raise NotImplementedError

    def run(self, req: Request) -> AttentionOutput:
        """Compute the request. ``lse`` may be ``None`` when ``req.return_lse`` is False."""
        raise NotImplementedError

    def path(self, req: Request) -> str:
        """Which of its paths this backend takes for ``req`` and why, for ``qkv.explain``; "" (the default) for a
        backend with one path."""
        return ""

    def __repr__(self) -> str:
        return f"<qkv backend {self.name}>"


#: Nominal seconds per (batch row, head, query, key) evaluation of a mask predicate without an analytic block map
#: (a vectorized user function: a few elementwise tensor ops per pair, index tensors included).
PREDICATE_PAIR_SECONDS = 2e-9


def predicate_seconds(req: Request) -> float:
    """Nominal cost of evaluating the request's mask predicate on every pair its block map (or dense view) reads:
    0 for analytic masks (``Mask.predicate_pairs``)."""
    if req.mask is None:
        return 0.0
    return req.mask.predicate_pairs(req.B, req.Hq, req.Nq, req.Nk) * PREDICATE_PAIR_SECONDS


def dense_flops(req: Request) -> float:
    """FLOPs of the two attention matmuls over every (query, key) pair."""
    return 2.0 * req.B * req.Hq * req.Nq * req.Nk * (req.Dqk + req.Dv)


def restore_nonfinite(req: Request, out: torch.Tensor, lse: torch.Tensor | None = None):
    """Make non-finite scores propagate as the contract says, for kernels that turn them into zeros.

    Some fused kernels (torch's CPU SDPA kernel when a row is shorter than one vector register, Flex on CPU)
    treat a row whose scores are all NaN like a fully masked row and return zeros. The reference gives NaN
    wherever an allowed score is NaN or +inf, and a score can be +inf from finite inputs (float32 overflow of
    ``q . k``). The common case costs one max of |q| and of |k| and one sync: only when the bound
    ``scale * max|q| * max|k| * D`` on every score is not safely finite in the compute dtype are the scores
    recomputed (detached) to find the rows to set to NaN.

    Returns ``(out, lse)`` with those rows NaN (``lse`` passes through when None).
    """
    q, k = req.q.detach(), req.k.detach()
    if q.numel() == 0 or k.numel() == 0:
        return out, lse
    bound = float(q.abs().amax()) * float(k.abs().amax()) * req.Dqk * abs(req.scale)
    limit = torch.finfo(torch.float64 if req.dtype == torch.float64 else torch.float32).max / 4
    if math.isfinite(bound) and bound < limit:  # no score can be NaN or overflow: q and k are finite and small
        return out, lse
    rows = _nonfinite_rows(req)  # (B, Hq, Nq)
    if not bool(rows.any()):
        return out, lse
    out = out.masked_fill(rows.unsqueeze(-1), float("nan"))
    return out, (None if lse is None else lse.masked_fill(rows, float("nan")))


def _nonfinite_rows(req: Request) -> torch.Tensor:
    """Query rows with an allowed score that is NaN or +inf, (B, Hq, Nq) bool."""
    acc = torch.float64 if req.dtype == torch.float64 else torch.float32
    B, Hq, Nq, D = req.q.shape
    Hkv, Nk = req.Hkv, req.Nk
    q = req.q.detach().to(acc).reshape(B, Hkv, req.group * Nq, D)  # query head h reads kv head h // group
    s = (req.scale * (q @ req.k.detach().to(acc).transpose(-1, -2))).view(B, Hq, Nq, Nk)
    dev = s.device
    b, h = torch.arange(B, device=dev).view(-1, 1, 1, 1), torch.arange(Hq, device=dev).view(1, -1, 1, 1)
    qi, kj = torch.arange(Nq, device=dev).view(1, 1, -1, 1), torch.arange(Nk, device=dev).view(1, 1, 1, -1)
    if req.score_mod is not None:
        with torch.no_grad():
            s = req.score_mod.apply(s, b, h, qi, kj, Nq, Nk)
    bad = torch.isnan(s) | torch.isposinf(s)
    if req.mask is not None:
        bad = bad & req.mask.dense(B, Hq, Nq, Nk, device=dev)
    return torch.broadcast_to(bad, (B, Hq, Nq, Nk)).any(-1)
