"""Batch-invariant attention: every query row's bits depend on that row's own data only.

A kernel is batch invariant when a row's output does not change with the batch size, with what else is
in the batch, with how the prompt was split into prefill chunks, or with how the keys were split across
workers (He et al. 2025, "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab). CPU GEMMs
are not: torch picks kernels and blockings by the matrix sizes, so ``(q @ k.T)[i]`` changes with the
number of rows of ``q`` (``tests/test_batch_invariance.py`` shows it). This kernel removes every size
the caller controls from the arithmetic:

- query rows (of any batch row) in steps of a fixed count ``P`` that depends on the head count only (the
  last step padded by repeating a row), each row's ``G`` query heads stacked as the rows of its own
  ``(G, D) @ (D, BLOCK)`` product in one batched matmul of ``P * Hkv`` products: every matmul and every
  elementwise op has the same shape whatever ``B``, ``Nq`` and the row's place in its step;
- keys in fixed tiles of ``BLOCK`` from key 0, the last one zero-padded to full width, merged in key order
  with the online softmax (Milakov & Gimelshein 2018); a tile with no allowed key for the row is skipped,
  which is bitwise the same as merging it (its terms are exact zeros), so causal prefill in chunks and in
  one pass agree, and there is no split-KV whose count could change the reduction order.

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv, Nq/Nk lengths, D/Dv head dims.
"""

from __future__ import annotations

import torch

from .._request import AttentionOutput, Request
from .._sinks import apply_sinks

__all__ = ["BLOCK", "invariant_attention", "invariant_decline"]

#: Key tile width. Fixed: changing it changes the bits (never the value beyond rounding).
BLOCK = 256


def invariant_decline(req: Request) -> str | None:
    """Why the batch-invariant kernel cannot run ``req`` (``None`` when it can)."""
    if req.dropout_p > 0:
        return "batch_invariant=True with dropout_p > 0 is not supported (dropout draws depend on the batch)"
    if req.device.type == "meta":
        return "meta tensors hold no values; batch_invariant=True needs real data"
    return None


def invariant_attention(req: Request) -> AttentionOutput:
    """Attention in fixed-shape steps. Returns out (B, Hq, Nq, Dv), lse (B, Hq, Nq)."""
    B, Hq, Nq, D = req.q.shape
    Hkv, Nk, Dv, G = req.Hkv, req.Nk, req.Dv, req.group
    acc = torch.float64 if req.dtype == torch.float64 else torch.float32
    dev = req.device
    tiles = (Nk + BLOCK - 1) // BLOCK
    width = tiles * BLOCK
    k, v = req.k.to(acc), req.v.to(acc)  # (B, Hkv, Nk, D), (B, Hkv, Nk, Dv): no copy in the compute dtype
    R = B * Nq
    P = rows_per_step(Hq)
    q_rows = req.q.to(acc).view(B, Hkv, G, Nq, D).permute(0, 3, 1, 2, 4).reshape(R, Hkv, G, D)
    out = torch.empty(R, Hkv, G, Dv, dtype=acc, device=dev)
    lse = torch.empty(R, Hkv, G, dtype=acc, device=dev)
    neg_inf = torch.tensor(float("-inf"), dtype=acc, device=dev)
    col = torch.arange(width, device=dev)
    heads = torch.arange(Hq, device=dev).view(1, Hq, 1, 1)
    for r0 in range(0, R, P):
        n = min(P, R - r0)
        rows = torch.arange(r0, r0 + P, device=dev).clamp(max=R - 1)  # the last step repeats a row to stay full
        bi, ii = rows // Nq, rows % Nq
        qg = q_rows[rows].reshape(P * Hkv, G, D)
        allowed = _allowed_rows(req, bi, ii, col)  # (P, Hkv or 1, G or 1, width) bool
        used = allowed[:n].flatten(0, -2).any(0).view(tiles, BLOCK).any(-1).tolist()
        m = torch.full((P, Hkv, G, 1), float("-inf"), dtype=acc, device=dev)
        lsum = torch.zeros(P, Hkv, G, 1, dtype=acc, device=dev)
        o = torch.zeros(P, Hkv, G, Dv, dtype=acc, device=dev)
        for t in range(tiles):
            if not used[t]:  # no row of this step reads the tile: merging it would add exact zeros
                continue
            sl = slice(t * BLOCK, (t + 1) * BLOCK)
            kt, vt = _tile(k, bi, t), _tile(v, bi, t)  # (P * Hkv, BLOCK, D), (P * Hkv, BLOCK, Dv)
            s = torch.bmm(qg, kt.transpose(1, 2)).view(P, Hkv, G, BLOCK) * req.scale
            if req.score_mod is not None:
                kj = col[sl].clamp(max=max(Nk - 1, 0)).view(1, 1, 1, BLOCK)
                s = req.score_mod.apply(s.view(P, Hq, 1, BLOCK), bi.view(P, 1, 1, 1), heads,
                                        ii.view(P, 1, 1, 1), kj, Nq, Nk)
                s = s.to(acc).view(P, Hkv, G, BLOCK)
            s = torch.where(allowed[..., sl], s, neg_inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            alpha = torch.exp(torch.where(torch.isfinite(m), m, neg_inf) - m_safe)
            p = torch.exp(s - m_safe)  # (P, Hkv, G, BLOCK)
            lsum = lsum * alpha + p.sum(-1, keepdim=True)
            pv = torch.bmm(p.view(P * Hkv, G, BLOCK), vt)
            o = o * alpha + pv.view(P, Hkv, G, Dv)
            m = m_new
        nonempty = lsum > 0
        safe = torch.where(nonempty, lsum, torch.ones_like(lsum))
        out[r0:r0 + n] = (o / safe)[:n]
        lse[r0:r0 + n] = torch.where(nonempty, m + torch.log(safe), neg_inf)[:n, ..., 0]
    out = out.view(B, Nq, Hq, Dv).transpose(1, 2)
    lse = lse.view(B, Nq, Hq).transpose(1, 2)
    if req.sinks is not None:  # elementwise per row: stays invariant (qkv._sinks)
        out, lse = apply_sinks(out, lse, req.sinks)
    return AttentionOutput(out.to(req.dtype), lse.to(torch.float32))


def _tile(x: torch.Tensor, bi: torch.Tensor, t: int) -> torch.Tensor:
    """Keys (or values) ``t * BLOCK ..`` of batch rows ``bi`` as a contiguous (P * Hkv, BLOCK, D), the last tile
    zero-padded to full width: every tile has the same shape and strides."""
    lo, hi = t * BLOCK, min(x.shape[2], (t + 1) * BLOCK)
    part = x[bi, :, lo:hi]  # (P, Hkv, hi - lo, D)
    if hi - lo < BLOCK:
        full = part.new_zeros(part.shape[0], part.shape[1], BLOCK, part.shape[3])
        full[:, :, :hi - lo] = part
        part = full
    return part.contiguous().view(-1, BLOCK, x.shape[3])


def rows_per_step(Hq: int) -> int:
    """Query rows per step: as many as fit one step's score tile in 8192 elements. That stays under torch's
    parallel grain (32768), so no elementwise op is split across threads at a place that depends on the rows,
    and keeps the padding small when few rows are decoded (one row per step from 32 heads up). A function of
    the head count only: every step of every call of a model has the same shape."""
    return max(1, _STEP_ELEMENTS // (Hq * BLOCK))


_STEP_ELEMENTS = 8192


def _allowed_rows(req: Request, bi: torch.Tensor, ii: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Which padded key columns each step row (batch row ``bi``, query row ``ii``) may read: (P, Hkv, G, width)
    bool, or (P, 1, 1, width) when the mask does not read the head."""
    P = bi.shape[0]
    real = (col < req.Nk).view(1, 1, 1, -1)
    if req.mask is None:
        return real.expand(P, 1, 1, -1)
    dev = col.device
    hs = req.Hq if req.mask.depends_on_head else 1
    h = torch.arange(hs, device=dev).view(1, -1, 1, 1)
    kj = col.clamp(max=max(req.Nk - 1, 0)).view(1, 1, 1, -1)
    allowed = req.mask.allowed(bi.view(-1, 1, 1, 1), h, ii.view(-1, 1, 1, 1), kj, req.Nq, req.Nk)
    allowed = torch.broadcast_to(allowed, (P, hs, 1, col.numel()))
    allowed = allowed.reshape(P, req.Hkv, req.group, -1) if hs > 1 else allowed.reshape(P, 1, 1, -1)
    return allowed & real
