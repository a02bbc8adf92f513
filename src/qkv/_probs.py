"""``qkv.attention_probs``: the exact attention probabilities of chosen heads and query rows.

Fast backends never form the (Nq, Nk) probability matrix; interpretation (attention maps, attention
rollout) and KV-eviction policies such as H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models") still need some of its rows. This module
takes the log-sum-exp from any backend that returns it, then recomputes only the requested rows,
chunk by chunk: ``P = exp(score - lse)`` with the same scores, modifiers and mask as the operator.

Shape legend: B batch, Hq query heads, nh requested heads, nr requested rows, Nk keys.
"""

from __future__ import annotations

import torch

from ._attention import attention
from ._request import build_request

__all__ = ["attention_probs"]

#: Score elements (summed over batch and heads) materialized per chunk of rows.
_CHUNK_ELEMENTS = 1 << 22


def _selection(sel, n: int, name: str) -> torch.Tensor:
    """Validate ``heads``/``rows``: None (all), an int, a sequence of ints or a 1-D integer tensor."""
    if sel is None:
        return torch.arange(n)
    if isinstance(sel, bool):
        raise TypeError(f"attention_probs: {name} must be an int, a list of ints or a 1-D integer tensor, got bool")
    if isinstance(sel, int):
        sel = [sel]
    if isinstance(sel, range):
        sel = list(sel)
    if isinstance(sel, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in sel):
            raise TypeError(f"attention_probs: {name} must contain ints, got {[type(i).__name__ for i in sel]}")
        sel = torch.tensor(sel, dtype=torch.int64)
    if not isinstance(sel, torch.Tensor):
        raise TypeError(f"attention_probs: {name} must be an int, a list of ints or a 1-D integer tensor, got "
                        f"{type(sel).__name__}")
    if sel.dtype.is_floating_point or sel.dtype == torch.bool or sel.dim() != 1:
        raise TypeError(f"attention_probs: {name} must be a 1-D integer tensor, got dtype {sel.dtype} shape "
                        f"{tuple(sel.shape)}")
    sel = sel.to(torch.int64).cpu()
    if sel.numel() and (int(sel.min()) < 0 or int(sel.max()) >= n):
        raise ValueError(f"attention_probs: {name} must lie in [0, {n}), got values from {int(sel.min())} to "
                         f"{int(sel.max())}")
    return sel


def attention_probs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None, score_mod=None,
                    scale: float | None = None, heads=None, rows=None, backend: str = "auto",
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
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
    heads_t = _selection(heads, req.Hq, "heads")
    rows_t = _selection(rows, req.Nq, "rows")
    lse = attention(q, k, v, mask=mask, score_mod=score_mod, scale=scale, return_lse=True, backend=backend,
                    sinks=sinks).lse
    acc = torch.float64 if req.dtype == torch.float64 else torch.float32
    dev = req.device
    heads_d, rows_d = heads_t.to(dev), rows_t.to(dev)
    B, nh, nr, nk = req.B, heads_t.numel(), rows_t.numel(), req.Nk
    out = torch.full((B, nh, nr, nk), float("nan"), dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out
    with torch.no_grad():
        q_sel = req.q.index_select(1, heads_d).to(acc)  # (B, nh, Nq, Dqk)
        k_sel = req.k.index_select(1, torch.div(heads_d, req.group, rounding_mode="floor")).to(acc)  # (B, nh, Nk, Dqk)
        lse_sel = lse.index_select(1, heads_d).to(acc)  # (B, nh, Nq)
        b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
        h = heads_d.view(1, -1, 1, 1)
        kj = torch.arange(nk, device=dev).view(1, 1, 1, -1)
        step = max(1, _CHUNK_ELEMENTS // max(1, B * nh * nk))
        for r0 in range(0, nr, step):
            r = rows_d[r0:r0 + step]
            qi = r.view(1, 1, -1, 1)
            s = req.scale * (q_sel.index_select(2, r) @ k_sel.transpose(-1, -2))  # (B, nh, r, Nk)
            if req.score_mod is not None:
                s = torch.broadcast_to(req.score_mod.apply(s, b, h, qi, kj, req.Nq, nk).to(acc), s.shape)
            if req.mask is not None:
                s = s.masked_fill(~req.mask.allowed(b, h, qi, kj, req.Nq, nk), float("-inf"))
            l_r = lse_sel.index_select(2, r).unsqueeze(-1)
            l_r = torch.where(torch.isneginf(l_r), torch.full_like(l_r, float("inf")), l_r)  # empty rows: P = 0
            out[:, :, r0:r0 + r.numel()] = torch.exp(s - l_r).float()
    return out
