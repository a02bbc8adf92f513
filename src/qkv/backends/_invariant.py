"""Batch-invariant attention: every query row's bits depend on that row's own data only.

A kernel is batch invariant when a row's output does not change with the batch size, with what else is
in the batch, with how the prompt was split into prefill chunks, or with how the keys were split across
workers (He et al. 2025, "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab). CPU GEMMs
are not: torch picks kernels and blockings by the matrix sizes, so ``(q @ k.T)[i]`` changes with the
number of rows of ``q`` (``tests/test_batch_invariance.py`` shows it). This kernel removes every size
the caller controls from the arithmetic:

- query rows (of any batch row) in steps of a fixed count ``P`` that depends on the head count only (the
  last step padded by repeating a row), each row's ``G`` query heads stacked as the rows of its own
  ``(G, D) @ (D, BLOCK)`` product with every key tile: every product has the same shape whatever ``B``,
  ``Nq``, ``Nk`` and the row's place in its step, and every reduction runs over a fixed length (``BLOCK``
  keys) or is exact (a max) or a scan in key order;
- keys in fixed tiles of ``BLOCK`` from key 0, whole tiles read in place from the cache and the last one
  zero-padded to full width; the softmax subtracts the row's exact maximum (a max does not depend on the
  order it is taken in), sums each tile's terms over its ``BLOCK`` keys, and adds the tiles' sums and
  ``p @ v`` products in key order with a scan. A tile with no allowed key for the row contributes exact
  zeros, so it is left out, which changes no bit: causal prefill in chunks and in one pass agree, and there
  is no split-KV whose count could change the reduction order.

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
    col = torch.arange(width, device=dev)
    for r0 in range(0, R, P):
        n = min(P, R - r0)
        rows = torch.arange(r0, r0 + P, device=dev).clamp(max=R - 1)  # the last step repeats a row to stay full
        bi, ii = rows // Nq, rows % Nq
        allowed = _allowed_rows(req, bi, ii, col)  # (P, Hkv or 1, G or 1, width) bool
        used = allowed[:n].flatten(0, -2).any(0).view(tiles, BLOCK).any(-1).nonzero().flatten().tolist()
        if not used:  # no row of this step reads any key
            out[r0:r0 + n] = 0
            lse[r0:r0 + n] = float("-inf")
            continue
        lo, hi = used[0], used[-1] + 1  # tiles outside [lo, hi) hold no allowed key: their terms are exact zeros
        o, lse_step = _step(req, q_rows[rows], k, v, bi, ii, allowed, lo, hi)
        out[r0:r0 + n] = o[:n]
        lse[r0:r0 + n] = lse_step[:n]
    out = out.view(B, Nq, Hq, Dv).transpose(1, 2)
    lse = lse.view(B, Nq, Hq).transpose(1, 2)
    if req.sinks is not None:  # elementwise per row: stays invariant (qkv._sinks)
        out, lse = apply_sinks(out, lse, req.sinks)
    return AttentionOutput(out.to(req.dtype), lse.to(torch.float32))


def _step(req: Request, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bi: torch.Tensor, ii: torch.Tensor,
          allowed: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of P rows over key tiles ``lo .. hi``: (P, Hkv, G, Dv) output and (P, Hkv, G) LSE.

    Every tile's scores and its share of the output are ``(G, D) @ (D, BLOCK)`` and ``(G, BLOCK) @ (BLOCK, Dv)``
    products; the softmax subtracts the row's exact maximum over all its tiles, sums each tile's terms over its
    BLOCK keys, and adds the tiles in key order (a scan), so adding or removing tiles of exact zeros (keys the
    row may not read) changes no bit.
    """
    P, Hkv, G, _ = qg.shape
    Nk, T = k.shape[2], hi - lo
    s = _tile_products(qg, k, bi, lo, hi, transpose=True)  # (P, Hkv, T, G, BLOCK)
    s = s * req.scale
    cols = slice(lo * BLOCK, hi * BLOCK)
    mask = allowed[..., cols].unflatten(-1, (T, BLOCK)).transpose(2, 3)  # (P, Hkv|1, T, G|1, BLOCK)
    if req.score_mod is not None:
        s4 = s.permute(0, 1, 3, 2, 4).reshape(P, Hkv * G, 1, T * BLOCK)  # (P, Hq, 1, T * BLOCK)
        kj = torch.arange(lo * BLOCK, hi * BLOCK, device=s.device).clamp(max=max(Nk - 1, 0)).view(1, 1, 1, -1)
        heads = torch.arange(Hkv * G, device=s.device).view(1, -1, 1, 1)
        s4 = req.score_mod.apply(s4, bi.view(P, 1, 1, 1), heads, ii.view(P, 1, 1, 1), kj, req.Nq, Nk)
        s = s4.to(s.dtype).view(P, Hkv, G, T, BLOCK).transpose(2, 3)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=(2, 4))  # (P, Hkv, G): the row's exact maximum (max is order-free)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe[:, :, None, :, None])  # (P, Hkv, T, G, BLOCK)
    lsum = p.sum(-1).cumsum(2)[:, :, -1]  # each tile's BLOCK-long sum, then the tiles in order: (P, Hkv, G)
    o = _tile_products(p, v, bi, lo, hi, transpose=False).cumsum(2)[:, :, -1]  # (P, Hkv, G, Dv)
    nonempty = lsum > 0
    safe = torch.where(nonempty, lsum, torch.ones_like(lsum))
    return o / safe[..., None], torch.where(nonempty, m_safe + torch.log(safe), float("-inf"))


def _tile_products(a: torch.Tensor, x: torch.Tensor, bi: torch.Tensor, lo: int, hi: int, *,
                   transpose: bool) -> torch.Tensor:
    """Per-tile products of step rows with key tiles ``lo .. hi`` of ``x`` (keys or values, (B, Hkv, Nk, E)).

    ``transpose``: ``a`` is (P, Hkv, G, D) queries and the result the scores (P, Hkv, T, G, BLOCK), each tile
    ``q (G, D) @ k_tile^T``; else ``a`` is (P, Hkv, T, G, BLOCK) probabilities and the result (P, Hkv, T, G, E),
    each tile ``p_tile (G, BLOCK) @ v_tile``. Whole tiles are read in place (a view of the cache), the last
    partial tile zero-padded to BLOCK keys: every product has the same shape wherever the tile lies.
    """
    P, Hkv = a.shape[:2]
    G = a.shape[2] if transpose else a.shape[3]
    Nk, E = x.shape[2], x.shape[3]
    T, whole = hi - lo, min(hi, Nk // BLOCK) - lo  # tiles, and how many of them are whole
    res = a.new_empty(P, Hkv, T, G, BLOCK if transpose else E)
    for r in range(P):
        for h in range(Hkv):
            if whole > 0:
                xt = x[bi[r], h, lo * BLOCK:(lo + whole) * BLOCK].view(whole, BLOCK, E)
                if transpose:
                    torch.bmm(a[r, h].expand(whole, G, E), xt.transpose(1, 2), out=res[r, h, :whole])
                else:
                    torch.bmm(a[r, h, :whole], xt, out=res[r, h, :whole])
    if whole < T:  # the last tile, partial: zero-padded
        start = (lo + whole) * BLOCK
        xt = x.new_zeros(P, Hkv, BLOCK, E)
        xt[:, :, :Nk - start] = x[bi, :, start:]
        xt = xt.view(P * Hkv, BLOCK, E)
        if transpose:
            res[:, :, -1] = torch.bmm(a.reshape(P * Hkv, G, E), xt.transpose(1, 2)).view(P, Hkv, G, BLOCK)
        else:
            res[:, :, -1] = torch.bmm(a[:, :, -1].reshape(P * Hkv, G, BLOCK), xt).view(P, Hkv, G, E)
    return res


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
