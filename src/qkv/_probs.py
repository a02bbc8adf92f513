"""``qkv.attention_probs`` and ``qkv.attention_stats``: exact attention probabilities of chosen heads and rows,
and statistics of all of them (column sums, entropy, attention to chosen keys) without the matrix.

Fast backends never form the (Nq, Nk) probability matrix; interpretation (attention maps, attention
rollout) and KV-eviction policies such as H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models") still need some of its rows. This module
takes the log-sum-exp from any backend that returns it, then recomputes only the requested rows,
chunk by chunk: ``P = exp(score - lse)`` with the same scores, modifiers and mask as the operator.
Statistics stream the rows the same way and keep only O(N) numbers per head.

Shape legend: B batch, Hq query heads, nh requested heads, nr requested rows, Nk keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._attention import attention
from ._request import build_request

__all__ = ["attention_probs", "attention_stats", "AttentionStats"]

#: Score elements (summed over batch and heads) materialized per chunk of rows.
_CHUNK_ELEMENTS = 1 << 22


def index_selection(sel, n: int, name: str, owner: str = "attention_probs") -> torch.Tensor:
    """Validate ``heads``/``rows``: None (all), an int, a sequence of ints or a 1-D integer tensor."""
    if sel is None:
        return torch.arange(n)
    if isinstance(sel, bool):
        raise TypeError(f"{owner}: {name} must be an int, a list of ints or a 1-D integer tensor, got bool")
    if isinstance(sel, int):
        sel = [sel]
    if isinstance(sel, range):
        sel = list(sel)
    if isinstance(sel, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in sel):
            raise TypeError(f"{owner}: {name} must contain ints, got {[type(i).__name__ for i in sel]}")
        sel = torch.tensor(sel, dtype=torch.int64)
    if not isinstance(sel, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be an int, a list of ints or a 1-D integer tensor, got "
                        f"{type(sel).__name__}")
    if sel.dtype.is_floating_point or sel.dtype == torch.bool or sel.dim() != 1:
        raise TypeError(f"{owner}: {name} must be a 1-D integer tensor, got dtype {sel.dtype} shape "
                        f"{tuple(sel.shape)}")
    sel = sel.to(torch.int64).cpu()
    if sel.numel() and (int(sel.min()) < 0 or int(sel.max()) >= n):
        raise ValueError(f"{owner}: {name} must lie in [0, {n}), got values from {int(sel.min())} to "
                         f"{int(sel.max())}")
    return sel


def _row_blocks(req, lse: torch.Tensor, heads_t: torch.Tensor, rows_t: torch.Tensor, block_rows: int | None = None):
    """Yield ``(start, k0, P)`` for consecutive blocks of ``rows_t``: P (B, nh, r, k1 - k0) in the accumulation
    dtype holds ``exp(score - lse)`` masked like the operator over keys ``k0 .. k1 - 1``, the span of keys the
    mask allows to any row of the block (outside it every probability is 0); rows with no allowed key are 0."""
    acc = torch.float64 if req.dtype == torch.float64 else torch.float32
    dev = req.device
    heads_d, rows_d = heads_t.to(dev), rows_t.to(dev)
    B, nh, nr, nk = req.B, heads_t.numel(), rows_t.numel(), req.Nk
    q_sel = req.q.index_select(1, heads_d).to(acc)  # (B, nh, Nq, Dqk)
    k_sel = req.k.index_select(1, torch.div(heads_d, req.group, rounding_mode="floor")).to(acc)  # (B, nh, Nk, Dqk)
    lse_sel = lse.index_select(1, heads_d).to(acc)  # (B, nh, Nq)
    b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
    h = heads_d.view(1, -1, 1, 1)
    kj = torch.arange(nk, device=dev).view(1, 1, 1, -1)
    step = block_rows or max(1, _CHUNK_ELEMENTS // max(1, B * nh * nk))
    for r0 in range(0, nr, step):
        r = rows_d[r0:r0 + step]
        qi = r.view(1, 1, -1, 1)
        k0, k1, allowed = 0, nk, None
        if req.mask is not None:
            allowed = req.mask.allowed(b, h, qi, kj, req.Nq, nk)
            if allowed.shape[-1] == nk:
                hit = allowed.reshape(-1, nk).any(0).nonzero()
                k0, k1 = (int(hit[0]), int(hit[-1]) + 1) if hit.numel() else (0, 0)
                allowed = allowed[..., k0:k1]
        kspan = kj[..., k0:k1]
        s = (q_sel.index_select(2, r) @ k_sel[:, :, k0:k1].transpose(-1, -2)).mul_(req.scale)  # (B, nh, r, span)
        if req.score_mod is not None:
            s = torch.broadcast_to(req.score_mod.apply(s, b, h, qi, kspan, req.Nq, nk).to(acc), s.shape).contiguous()
        if allowed is not None:
            s.masked_fill_(~allowed, float("-inf"))
        l_r = lse_sel.index_select(2, r).unsqueeze(-1)
        l_r = torch.where(torch.isinf(l_r), torch.full_like(l_r, float("inf")), l_r)  # empty rows: P = 0
        yield r0, k0, s.sub_(l_r).exp_()  # in place: one block of scores is the only large buffer


def _lse(q, k, v, lse, *, mask, score_mod, scale, backend, req, sinks=None) -> torch.Tensor:
    if lse is None:
        return attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, return_lse=True, backend=backend,
                         sinks=sinks).lse
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (req.B, req.Hq, req.Nq):
        raise ValueError(f"attention_probs: lse must be the operator's (B, Hq, Nq) = {(req.B, req.Hq, req.Nq)} "
                         f"log-sum-exp, got {tuple(getattr(lse, 'shape', ())) or type(lse).__name__}")
    return lse


def attention_probs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None, score_mod=None,
                    scale: float | None = None, heads=None, rows=None, backend: str = "auto",
                    sinks: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention probabilities for the chosen query heads and rows.

    Args:
        q, k, v, mask, score_mod, scale: as in :func:`qkv.attention` (``v`` is needed for the
            normalizer, which comes from ``qkv.attention(..., return_lse=True, backend=backend)``).
        heads: query heads to return (int, list or 1-D integer tensor in ``[0, Hq)``); default all.
        rows: query rows to return (in ``[0, Nq)``); default all.
        backend: the backend that computes the log-sum-exp; it must support ``return_lse``. With
            ``"auto"`` a tiled or Flex backend keeps that pass at O(N) memory.
        sinks: (Hq,) sink logits as in :func:`qkv.attention`: they join the normalizer (the lse), so a
            row's probabilities then sum to less than 1, the rest being the sink's.
        lse: (B, Hq, Nq) the operator's log-sum-exp of this very call when the caller has it (skips that pass).

    Returns:
        (B, nh, nr, Nk) float32 probabilities; each returned row sums to 1 over its allowed keys, and a
        row with no allowed key is all zeros. Only ``nr`` rows of scores are ever formed, a chunk at a
        time.

    Example:
        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 2, 64, 16)
        >>> p = qkv.attention_probs(q, k, v, mask=qkv.masks.causal(), heads=[1], rows=[0, 63])
        >>> p.shape, [round(float(s), 4) for s in p.sum(-1).flatten()]
        (torch.Size([1, 1, 2, 64]), [1.0, 1.0])
    """
    req = build_request(q, k, v, mask=mask, score_mod=score_mod, scale=scale, sinks=sinks)
    heads_t = index_selection(heads, req.Hq, "heads")
    rows_t = index_selection(rows, req.Nq, "rows")
    lse = _lse(q, k, v, lse, mask=mask, score_mod=score_mod, scale=scale, backend=backend, req=req, sinks=sinks)
    shape = (req.B, heads_t.numel(), rows_t.numel(), req.Nk)
    if 0 in shape:
        return torch.zeros(shape, dtype=torch.float32, device=req.device)
    out = None
    with torch.no_grad():
        for r0, k0, p in _row_blocks(req, lse, heads_t, rows_t):
            if out is None and tuple(p.shape) == shape and p.dtype == torch.float32:
                return p  # one block spans every row and key: it is the answer, no copy
            if out is None:
                out = torch.zeros(shape, dtype=torch.float32, device=req.device)
            out[:, :, r0:r0 + p.shape[2], k0:k0 + p.shape[3]] = p.float()
    return out


class AttentionStats(NamedTuple):
    """Statistics of the attention probabilities ``P`` (B, Hq, Nq, Nk), all float32.

    column_sums: (B, Hq, Nk) ``sum_i P[i, j]``, the attention each key receives (H2O's accumulated score).
    entropy: (B, Hq, Nq) ``-sum_j P[i, j] log P[i, j]`` in nats per query row (0 for a row with no key).
    to_positions: (B, Hq, Nq, P) ``P[i, positions]``, or None when no positions were asked for.
    """

    column_sums: torch.Tensor
    entropy: torch.Tensor
    to_positions: torch.Tensor | None


def attention_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None, score_mod=None,
                    scale: float | None = None, positions=None, rows=None, block_rows: int | None = None,
                    backend: str = "auto", lse: torch.Tensor | None = None) -> AttentionStats:
    """Column sums, per-row entropy and attention to chosen keys, without forming the (Nq, Nk) matrix.

    The log-sum-exp comes from one pass of the operator (a tiled or Flex backend keeps it at O(N) memory);
    then ``block_rows`` query rows at a time are recomputed exactly as :func:`attention_probs` does and
    folded into the statistics. Memory beyond the inputs: O(B Hq (Nq + Nk)) for the results plus one block
    of ``B Hq block_rows Nk`` scores (by default about 4M elements, whatever N).

    Args:
        q, k, v, mask, score_mod, scale, backend, lse: as in :func:`attention_probs`.
        positions: key indices (int, list or 1-D integer tensor in ``[0, Nk)``) whose probabilities to keep
            for every row, e.g. ``[0]`` for attention to the first token (the sink).
        rows: query rows to include (default all); column sums add up these rows only.
        block_rows: query rows per block (default: as many as fit about 4M score elements).

    Returns:
        :class:`AttentionStats`.

    Example:
        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 2, 128, 16)
        >>> st = qkv.attention_stats(q, k, v, mask=qkv.masks.causal(), positions=[0])
        >>> st.column_sums.shape, round(float(st.column_sums.sum()), 2), st.to_positions.shape
        (torch.Size([1, 2, 128]), 256.0, torch.Size([1, 2, 128, 1]))
    """
    if block_rows is not None and (not isinstance(block_rows, int) or isinstance(block_rows, bool) or block_rows < 1):
        raise ValueError(f"attention_stats: block_rows must be a positive int or None, got {block_rows!r}")
    req = build_request(q, k, v, mask=mask, score_mod=score_mod, scale=scale)
    rows_t = index_selection(rows, req.Nq, "rows", "attention_stats")
    pos_t = None if positions is None else index_selection(positions, req.Nk, "positions", "attention_stats")
    heads_t = torch.arange(req.Hq)
    lse = _lse(q, k, v, lse, mask=mask, score_mod=score_mod, scale=scale, backend=backend, req=req)
    acc = torch.float64 if req.dtype == torch.float64 else torch.float32
    dev = req.device
    B, H = req.B, req.Hq
    cols = torch.zeros(B, H, req.Nk, dtype=acc, device=dev)
    ent = torch.zeros(B, H, req.Nq, dtype=acc, device=dev)
    to_pos = None if pos_t is None else torch.zeros(B, H, req.Nq, pos_t.numel(), dtype=acc, device=dev)
    pos_d = None if pos_t is None else pos_t.to(dev)
    with torch.no_grad():
        for r0, k0, p in _row_blocks(req, lse, heads_t, rows_t, block_rows):
            r = rows_t[r0:r0 + p.shape[2]].to(dev)
            k1 = k0 + p.shape[3]
            cols[..., k0:k1] += p.sum(2)
            ent[:, :, r] = -torch.xlogy(p, p).sum(-1)
            if to_pos is not None:
                inside = (pos_d >= k0) & (pos_d < k1)
                got = p.index_select(3, (pos_d - k0).clamp(0, max(p.shape[3] - 1, 0))) if p.shape[3] else None
                to_pos[:, :, r] = got.masked_fill(~inside, 0.0) if got is not None else 0.0
    return AttentionStats(cols.float(), ent.float(), None if to_pos is None else to_pos.float())
