"""Batch-invariant attention: every query row's bits depend on that row's own data only.

A kernel is batch invariant when a row's output does not change with the batch size, with what else is
in the batch, with how the prompt was split into prefill chunks, or with how the keys were split across
workers (He et al. 2025, "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab). CPU GEMMs
are not: torch picks kernels and blockings by the matrix sizes, so ``(q @ k.T)[i]`` changes with the
number of rows of ``q`` (``tests/test_batch_invariance.py`` shows it). This kernel removes every size
the caller controls from the arithmetic:

- one batch row and one query row at a time, its ``G`` query heads stacked as the rows of one
  ``(Hkv, G, D) @ (Hkv, D, BLOCK)`` product, so every product has the same shape whatever ``B`` and ``Nq``;
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
    """Attention computed row by row in fixed-shape tiles. Returns out (B, Hq, Nq, Dv), lse (B, Hq, Nq)."""
    B, Hq, Nq, D = req.q.shape
    Hkv, Nk, Dv, G = req.Hkv, req.Nk, req.Dv, req.group
    acc = torch.float64 if req.dtype == torch.float64 else torch.float32
    dev = req.device
    tiles = (Nk + BLOCK - 1) // BLOCK
    width = tiles * BLOCK
    # (B, Hkv, D, width) and (B, Hkv, width, Dv), zero-padded so the last tile has the same shape as the others
    kt = torch.zeros(B, Hkv, D, width, dtype=acc, device=dev)
    kt[..., :Nk] = req.k.to(acc).transpose(-1, -2)
    vp = torch.zeros(B, Hkv, width, Dv, dtype=acc, device=dev)
    vp[:, :, :Nk] = req.v.to(acc)
    q = req.q.to(acc).view(B, Hkv, G, Nq, D)
    neg_inf = torch.tensor(float("-inf"), dtype=acc, device=dev)
    col = torch.arange(width, device=dev)
    outs, lses = [], []
    for b in range(B):
        bi = torch.tensor(b, device=dev)
        row_out, row_lse = [], []
        for i in range(Nq):
            allowed = _allowed_row(req, bi, i, col)  # (Hkv or 1, G or 1, width) bool
            m = torch.full((Hkv, G, 1), float("-inf"), dtype=acc, device=dev)
            lsum = torch.zeros(Hkv, G, 1, dtype=acc, device=dev)
            o = torch.zeros(Hkv, G, Dv, dtype=acc, device=dev)
            qi = q[b, :, :, i]  # (Hkv, G, D)
            for t in range(tiles):
                sl = slice(t * BLOCK, (t + 1) * BLOCK)
                ok = allowed[..., sl]
                if not bool(ok.any()):
                    continue
                s = req.scale * torch.bmm(qi, kt[b, :, :, sl])  # (Hkv, G, BLOCK)
                if req.score_mod is not None:
                    kj = col[sl].clamp(max=max(Nk - 1, 0)).view(1, 1, 1, BLOCK)
                    s = req.score_mod.apply(s.view(1, Hq, 1, BLOCK), bi.view(1, 1, 1, 1),
                                            torch.arange(Hq, device=dev).view(1, Hq, 1, 1),
                                            torch.tensor(i, device=dev).view(1, 1, 1, 1), kj, Nq, Nk)
                    s = s.to(acc).view(Hkv, G, BLOCK)
                s = torch.where(ok, s, neg_inf)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
                alpha = torch.exp(torch.where(torch.isfinite(m), m, neg_inf) - m_safe)
                p = torch.exp(s - m_safe)  # (Hkv, G, BLOCK)
                lsum = lsum * alpha + p.sum(-1, keepdim=True)
                o = o * alpha + torch.bmm(p, vp[b, :, sl])
                m = m_new
            nonempty = lsum > 0
            safe = torch.where(nonempty, lsum, torch.ones_like(lsum))
            row_out.append((o / safe).view(Hq, 1, Dv))
            row_lse.append(torch.where(nonempty, m + torch.log(safe), neg_inf).view(Hq, 1))
        outs.append(torch.cat(row_out, 1) if row_out else q.new_zeros(Hq, 0, Dv))
        lses.append(torch.cat(row_lse, 1) if row_lse else q.new_zeros(Hq, 0))
    out = torch.stack(outs) if outs else q.new_zeros(0, Hq, Nq, Dv)
    lse = torch.stack(lses) if lses else q.new_zeros(0, Hq, Nq)
    if req.sinks is not None:  # elementwise per row: stays invariant (qkv._sinks)
        out, lse = apply_sinks(out, lse, req.sinks)
    return AttentionOutput(out.to(req.dtype), lse.to(torch.float32))


def _allowed_row(req: Request, b: torch.Tensor, i: int, col: torch.Tensor) -> torch.Tensor:
    """Which padded key columns query row ``i`` of batch row ``b`` may read, per head: (Hkv, G, width) bool,
    or (1, 1, width) when the mask does not read the head."""
    real = (col < req.Nk).view(1, 1, -1)
    if req.mask is None:
        return real
    dev = col.device
    hs = req.Hq if req.mask.depends_on_head else 1
    h = torch.arange(hs, device=dev).view(1, -1, 1, 1)
    qi = torch.tensor(i, device=dev).view(1, 1, 1, 1)
    kj = col.clamp(max=max(req.Nk - 1, 0)).view(1, 1, 1, -1)
    allowed = req.mask.allowed(b.view(1, 1, 1, 1), h, qi, kj, req.Nq, req.Nk)
    allowed = torch.broadcast_to(allowed, (1, hs, 1, col.numel()))
    allowed = allowed.reshape(req.Hkv, req.group, -1) if hs > 1 else allowed.reshape(1, 1, -1)
    return allowed & real
