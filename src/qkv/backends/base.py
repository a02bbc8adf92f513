"""What a backend is: it declines a request with a reason, estimates its cost, or runs it.

Backends import only the core's shared types (``qkv._request``, ``qkv.masks``, ``qkv.mods``), never
one another. The cost estimate is deliberately simple: the work a backend actually does (dense or
only the allowed tiles) over a nominal rate, plus a fixed per-call overhead; ``qkv.explain`` prints it.
"""

from __future__ import annotations

from typing import NamedTuple

from .._request import AttentionOutput, Request

__all__ = ["Backend", "Estimate", "NOMINAL_FLOPS", "dense_flops"]

#: Nominal matmul rates (FLOP/s) used to turn work into an estimated time; only ratios matter.
NOMINAL_FLOPS = {"cpu": 1.0e11, "cuda": 2.0e14}


class Estimate(NamedTuple):
    """Estimated seconds and what the estimate counted."""

    seconds: float
    note: str

    def __str__(self) -> str:
        return f"~{self.seconds * 1e3:.3g} ms ({self.note})"


class Backend:
    name: str = "?"
    #: True when ``run`` honours ``req.sinks`` itself; otherwise ``qkv.attention`` runs the backend without
    #: them, asks for its log-sum-exp and merges the sinks in (``qkv._sinks``), so a backend that returns an
    #: lse under autograd must also take its gradient (``dlse``) for the sinks' gradients to be right.
    native_sinks: bool = False

    def decline(self, req: Request) -> str | None:
        """``None`` when this backend honours the request exactly; otherwise the reason it cannot."""
        raise NotImplementedError

    def estimate(self, req: Request) -> Estimate:
        raise NotImplementedError

    def run(self, req: Request) -> AttentionOutput:
        """Compute the request. ``lse`` may be ``None`` when ``req.return_lse`` is False."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<qkv backend {self.name}>"


def dense_flops(req: Request) -> float:
    """FLOPs of the two attention matmuls over every (query, key) pair."""
    return 2.0 * req.B * req.Hq * req.Nq * req.Nk * (req.Dqk + req.Dv)
