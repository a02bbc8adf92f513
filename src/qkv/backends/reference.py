"""The reference backend: the specification of ``qkv.attention``, short and readable.

It materializes the full (B, Hq, Nq, Nk) score matrix, works in float64 for float64 inputs and in
float32 otherwise (low-precision inputs accumulate in float32), supports every mask, score modifier
and dropout, and is differentiable by plain autograd. Optimised backends never call it; tests compare
against it. Scaled dot-product attention as in Vaswani et al. 2017, "Attention Is All You Need":

    softmax(scale * q k^T + score terms, masked) v
"""

from __future__ import annotations

import torch

from .._dropout import draw_seed, keep_mask
from .._request import AttentionOutput, Request
from ._invariant import invariant_attention, invariant_decline
from .base import NOMINAL_FLOPS, Backend, Estimate, dense_flops, format_size

__all__ = ["ReferenceBackend", "reference_attention"]


def _indices(B: int, H: int, nq: int, nk: int, device):
    return (torch.arange(B, device=device).view(-1, 1, 1, 1), torch.arange(H, device=device).view(1, -1, 1, 1),
            torch.arange(nq, device=device).view(1, 1, -1, 1), torch.arange(nk, device=device).view(1, 1, 1, -1))


def reference_attention(req: Request, *, dropout_seed: int | None = None) -> AttentionOutput:
    """Attention by the definition. Returns out (B, Hq, Nq, Dv) in the input dtype, lse (B, Hq, Nq) float32
    (float64 for float64 inputs: the reference is the float64 oracle through merges and ring steps)."""
    acc = torch.float64 if req.dtype == torch.float64 else torch.float32
    q = req.q.to(acc)  # (B, Hq, Nq, Dqk)
    k = req.k.to(acc).repeat_interleave(req.group, dim=1)  # (B, Hq, Nk, Dqk): head h reads kv head h // group
    v = req.v.to(acc).repeat_interleave(req.group, dim=1)  # (B, Hq, Nk, Dv)
    b, h, qi, kj = _indices(req.B, req.Hq, req.Nq, req.Nk, q.device)

    s = req.scale * (q @ k.transpose(-1, -2))  # (B, Hq, Nq, Nk)
    if req.score_mod is not None:
        s = req.score_mod.apply(s, b, h, qi, kj, req.Nq, req.Nk).to(acc)
    if req.mask is not None:
        allowed = req.mask.allowed(b, h, qi, kj, req.Nq, req.Nk)
        s = torch.where(allowed, s, torch.tensor(float("-inf"), dtype=acc, device=s.device))
    if req.sinks is not None:  # the sink: one more softmax column, without a value (qkv._sinks)
        sink = req.sinks.to(acc).view(1, -1, 1, 1).expand(req.B, req.Hq, req.Nq, 1)
        s = torch.cat([s, sink], dim=-1)  # (B, Hq, Nq, Nk + 1)

    # Softmax that leaves rows with no allowed key at zero (no NaN in forward or backward).
    if s.shape[-1] == 0:
        m = torch.zeros(*s.shape[:-1], 1, dtype=acc, device=s.device)
    else:
        m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    empty = total == 0  # a NaN total (a NaN score or sink) is not empty: it propagates to out and lse
    safe_total = torch.where(empty, torch.ones_like(total), total)
    p = e / safe_total
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(safe_total)).squeeze(-1)
    if req.sinks is not None:
        p = p[..., :-1]  # the sink's probability has no value

    if req.dropout_p > 0:
        seed = draw_seed(req.generator) if dropout_seed is None else dropout_seed
        keep = keep_mask(seed, req.dropout_p, b, h, qi, kj, req.Hq, req.Nq, req.Nk)
        p = torch.where(keep, p / (1.0 - req.dropout_p), torch.zeros_like(p))
    out = p @ v
    return AttentionOutput(out.to(req.dtype), lse)  # lse float32, float64 for float64 inputs


class ReferenceBackend(Backend):
    """Eager, any dtype including float64, every feature; O(Nq * Nk) memory. The specification."""

    name = "reference"
    native_sinks = True
    batch_invariant = True

    def decline(self, req: Request) -> str | None:
        return invariant_decline(req) if req.batch_invariant else None

    def estimate(self, req: Request) -> Estimate:
        rate = NOMINAL_FLOPS.get(req.device.type, NOMINAL_FLOPS["cpu"]) / 4  # eager softmax passes over N^2
        score_bytes = 4.0 * req.B * req.Hq * req.Nq * req.Nk
        return Estimate(dense_flops(req) / rate + score_bytes / 2e10,
                        f"dense, materializes {format_size(score_bytes)} of scores")

    def run(self, req: Request) -> AttentionOutput:
        return invariant_attention(req) if req.batch_invariant else reference_attention(req)
