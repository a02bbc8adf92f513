"""Selection for sparse attention: score, pool, force, keep a budget, list the tokens.

Every "select keys" scheme of 2025-2026 is a point in one small space:

================  ====================================  ============  ==============  ================  ===========
scheme            scorer                                granularity   sharing         forced            budget
================  ====================================  ============  ==============  ================  ===========
DSA (V3.2, GLM-5) ReLU heads weighted per token         token         all heads       none              K tokens
QSA (Qwen4-exp)   ReLU heads, unweighted, pooled keys   micro-block   all heads       tail block        K tokens
MSA (MiniMax-M3)  one key head, max-pooled scores       block         per KV group    local blocks      K blocks
MoBA              mean key of each block                block         per head        own block         K blocks
CSA (V4)          ReLU heads weighted per token         comp. entry   all heads       none              K entries
================  ====================================  ============  ==============  ================  ===========

Papers: DeepSeek-AI 2025, "DeepSeek-V3.2-Exp" (Section 2.1, the lightning indexer); Lu et al. 2025, "MoBA"
(arXiv:2502.13189, Section 2.2); GLM-5, MiniMax-M3 and Qwen4-exp model reports (2026), whose indexers are
HF transformers' ``GlmMoeDsaIndexer``, ``MiniMaxM3VLIndexer`` and ``Qwen4ExpTextQSAIndexer``.

The pieces are functions, composed in that order:

- scorers give ``(B, Hs, Nq, T)`` scores of T keys (or pooled keys) per query, Hs being the sharing (1 for all
  heads): :func:`weighted_relu_scores` (DSA with weights, QSA without), :func:`dot_scores` (MSA, MoBA);
- granularity: :func:`pool_keys` pools keys before scoring (MoBA's mean key, QSA's micro-blocks),
  :func:`pool_scores` pools token scores after it (MSA's max), both by *position* block ``pos // block``, so
  left padding (position ``-1``) never shifts a block;
- :func:`entry_visible` says which entries a query may pick (a block once it starts, or once it is complete);
- :func:`select_topk` keeps the forced entries (:func:`local_entries`: the query's own block and the ones
  before it) and fills the budget with the best-scored visible others; ties go to the earlier entry, so a
  cached decode picks what a full recompute picks;
- :func:`blocks_to_tokens` and :func:`tail_tokens` turn picked blocks (and QSA's incomplete tail block) into
  key slots.

The result is a :func:`qkv.masks.topk` index list ``(B, Hs, Nq, K)`` of key slots, ``-1`` for none, which
every backend serves (the gather backend reads only the listed keys). :func:`dsa_select`,
:func:`qsa_select`, :func:`msa_select` and :func:`moba_select` are the named points. Selection has no
gradient (a top-k); everything here runs under ``torch.no_grad``.

Positions: ``q_positions`` (B, Nq) and ``kv_positions`` (B, Nk) int64 absolute positions of the queries and
the key slots, ``-1`` for padding (never picked; a padded query picks nothing). Key slots hold contiguous
positions (slot = position + a per-row offset, as a left-padded or contiguous cache has them); the functions
that map positions back to slots check it.

Shape legend: B batch, Hi scorer query heads, Hk scorer key heads, Hs selection heads (1 = shared by all),
Nq queries, Nk key slots, T entries (tokens or blocks), K budget, D scorer head dim.

Example:
    >>> import torch
    >>> from qkv.sparse import select
    >>> q = torch.randn(1, 2, 6, 8)                       # (B, Hi, Nq, D) indexer queries
    >>> k = torch.randn(1, 1, 6, 8)                       # (B, 1, Nk, D) one indexer key per token
    >>> w = torch.randn(1, 6, 2)                          # (B, Nq, Hi) per-token head weights
    >>> pos = torch.arange(6).expand(1, 6)
    >>> idx = select.dsa_select(q, k, w, budget=3, q_positions=pos, kv_positions=pos)
    >>> idx.shape, idx[0, 0, 0].tolist()                  # the first query sees only itself
    (torch.Size([1, 1, 6, 3]), [0, -1, -1])
"""

from __future__ import annotations

import torch

from ..config.select import GRANULARITIES, SCORERS, SHARINGS, SelectSpec

__all__ = [
    "SelectSpec",
    "weighted_relu_scores",
    "dot_scores",
    "pool_keys",
    "pool_scores",
    "entry_visible",
    "local_entries",
    "select_topk",
    "blocks_to_tokens",
    "tail_tokens",
    "expand_heads",
    "dsa_select",
    "qsa_select",
    "msa_select",
    "moba_select",
    "SCORERS",
    "GRANULARITIES",
    "SHARINGS",
]

def _int(fn: str, name: str, value, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{fn}: {name} must be an int >= {low}, got {value!r}")
    return value


def _acc(*ts: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _tensor(fn: str, name: str, t, dims: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        seen = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be a {what} tensor, got {seen}")
    return t


def _positions(fn: str, name: str, pos, B: int, N: int | None = None) -> torch.Tensor:
    """``pos`` checked as (B, N) integer positions (N = its own length when None)."""
    _tensor(fn, name, pos, 2, f"(B={B}, N) int64 positions")
    N = pos.shape[1] if N is None else N
    if pos.dtype.is_floating_point or pos.dtype == torch.bool or tuple(pos.shape) != (B, N):
        raise ValueError(f"{fn}: {name} must be (B={B}, N={N}) integer positions (-1 for padding), got "
                         f"{pos.dtype} {tuple(pos.shape)}")
    return pos.long()


def weighted_relu_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor | None = None, *,
                         scale: float | None = None) -> torch.Tensor:
    """Index scores summed over the scorer heads: ``I[i, t] = sum_h w[i, h] * ReLU(scale * q[h, i] . k[t])``
    (DSA with ``weights``; QSA without, ``w = 1``). One selection shared by every attention head.

    Computed in float32 (float64 when an input is float64), without gradients.

    Args:
        q: (B, Hi, Nq, D) scorer queries. k: (B, 1, T, D) one scorer key per entry.
        weights: (B, Nq, Hi) per-query head weights, or None for 1.
        scale: default ``D ** -0.5``.

    Returns:
        (B, 1, Nq, T) scores.

    Example:
        >>> import torch
        >>> weighted_relu_scores(torch.ones(1, 2, 3, 4), torch.ones(1, 1, 5, 4)).shape
        torch.Size([1, 1, 3, 5])
    """
    fn = "weighted_relu_scores"
    _tensor(fn, "q", q, 4, "(B, Hi, Nq, D)")
    _tensor(fn, "k", k, 4, "(B, 1, T, D)")
    B, Hi, Nq, D = q.shape
    if k.shape[0] != B or k.shape[1] != 1 or k.shape[-1] != D:
        raise ValueError(f"{fn}: k must be (B={B}, 1, T, D={D}), one key head shared by the {Hi} query heads; "
                         f"got {tuple(k.shape)}")
    if weights is not None:
        _tensor(fn, "weights", weights, 3, f"(B={B}, Nq={Nq}, Hi={Hi})")
        if tuple(weights.shape) != (B, Nq, Hi):
            raise ValueError(f"{fn}: weights must be (B={B}, Nq={Nq}, Hi={Hi}), one weight per query and "
                             f"scorer head; got {tuple(weights.shape)}")
    acc = _acc(q, k)
    with torch.no_grad():
        s = torch.relu((q.to(acc) @ k.to(acc).transpose(-1, -2)) * (D ** -0.5 if scale is None else scale))
        if weights is None:
            return s.sum(1, keepdim=True)  # (B, 1, Nq, T)
        return (weights.to(acc).transpose(1, 2).unsqueeze(-1) * s).sum(1, keepdim=True)


def dot_scores(q: torch.Tensor, k: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """Per-head scores ``scale * q[h, i] . k[h // (Hi / Hk), t]``: one selection per scorer head (MSA: one per
    KV group, with one key head; MoBA: one per query head, against its KV head's mean keys).

    Args:
        q: (B, Hi, Nq, D). k: (B, Hk, T, D) with ``Hi % Hk == 0``. scale: a factor on the scores.

    Returns:
        (B, Hi, Nq, T) scores in float32 (float64 for float64 inputs), without gradients.

    Example:
        >>> import torch
        >>> dot_scores(torch.ones(1, 4, 3, 2), torch.ones(1, 1, 5, 2))[0, 3, 0].tolist()
        [2.0, 2.0, 2.0, 2.0, 2.0]
    """
    fn = "dot_scores"
    _tensor(fn, "q", q, 4, "(B, Hi, Nq, D)")
    _tensor(fn, "k", k, 4, "(B, Hk, T, D)")
    B, Hi, Nq, D = q.shape
    Hk = k.shape[1]
    if k.shape[0] != B or k.shape[-1] != D or Hk < 1 or Hi % Hk:
        raise ValueError(f"{fn}: k must be (B={B}, Hk, T, D={D}) with Hi={Hi} a multiple of Hk; got "
                         f"{tuple(k.shape)}")
    acc = _acc(q, k)
    with torch.no_grad():
        G, T = Hi // Hk, k.shape[2]
        s = q.to(acc).reshape(B, Hk, G * Nq, D) @ k.to(acc).transpose(-1, -2)  # (B, Hk, G*Nq, T)
        return (s * scale if scale != 1.0 else s).view(B, Hi, Nq, T)


def _blocks_of(positions: torch.Tensor, block: int) -> torch.Tensor:
    return torch.where(positions >= 0, positions.div(block, rounding_mode="floor"), torch.full_like(positions, -1))


def pool_keys(k: torch.Tensor, block: int, *, positions: torch.Tensor | None = None, complete: bool = False
              ) -> torch.Tensor:
    """The mean key of each position block ``pos // block`` (MoBA's block means, QSA's micro-blocks).

    Args:
        k: (B, H, N, D) keys of N slots. block: tokens per block.
        positions: (B, N) the slots' positions, ``-1`` for padding (left out); default ``0 .. N - 1``.
        complete: pool only blocks whose every position is present (QSA); a partial last block then gets a
            zero mean (never visible: see :func:`entry_visible` with ``complete=True``).

    Returns:
        (B, H, T, D) block means (float32 or float64 as ``k``'s precision), T = ``ceil((max position + 1) /
        block)`` (``floor`` with ``complete``); a block with no present token has a zero mean.

    Example:
        >>> import torch
        >>> pool_keys(torch.arange(5.).view(1, 1, 5, 1), 2)[0, 0, :, 0].tolist()
        [0.5, 2.5, 4.0]
    """
    fn = "pool_keys"
    _tensor(fn, "k", k, 4, "(B, H, N, D)")
    B, H, N, D = k.shape
    block = _int(fn, "block", block)
    pos = torch.arange(N, device=k.device).expand(B, N) if positions is None else \
        _positions(fn, "positions", positions, B, N)
    top = int(pos.max()) + 1 if pos.numel() else 0
    T = top // block if complete else -(-top // block)
    bid = _blocks_of(pos, block)  # (B, N)
    bid = torch.where((bid >= 0) & (bid < T), bid, torch.full_like(bid, T))  # T: a spill row
    acc = torch.promote_types(k.dtype, torch.float32)
    sums = torch.zeros(B, H, T + 1, D, dtype=acc, device=k.device)
    sums.scatter_add_(2, bid.view(B, 1, N, 1).expand(B, H, N, D), k.to(acc))
    counts = torch.zeros(B, T + 1, dtype=acc, device=k.device).scatter_add_(1, bid, torch.ones_like(bid, dtype=acc))
    return (sums / counts.clamp_min(1).view(B, 1, T + 1, 1))[:, :, :T]


def pool_scores(scores: torch.Tensor, block: int, *, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Token scores max-pooled to position blocks ``pos // block`` (MSA). Mask what a query may not see with
    ``-inf`` first: a block's score is the best of its visible tokens.

    Args:
        scores: (B, Hs, Nq, N) scores of N key slots. block: tokens per block.
        positions: (B, N) the slots' positions, ``-1`` for padding (left out); default ``0 .. N - 1``.

    Returns:
        (B, Hs, Nq, T) block scores, T = ``ceil((max position + 1) / block)``; ``-inf`` where no token counts.

    Example:
        >>> import torch
        >>> pool_scores(torch.tensor([[[[1., 3., 2.]]]]), 2).tolist()
        [[[[3.0, 2.0]]]]
    """
    fn = "pool_scores"
    _tensor(fn, "scores", scores, 4, "(B, Hs, Nq, N)")
    B, Hs, Nq, N = scores.shape
    block = _int(fn, "block", block)
    pos = torch.arange(N, device=scores.device).expand(B, N) if positions is None else \
        _positions(fn, "positions", positions, B, N)
    top = int(pos.max()) + 1 if pos.numel() else 0
    T = -(-top // block)
    bid = _blocks_of(pos, block)
    bid = torch.where(bid >= 0, bid, torch.full_like(bid, T))
    out = torch.full((B, Hs, Nq, T + 1), float("-inf"), dtype=scores.dtype, device=scores.device)
    out.scatter_reduce_(3, bid.view(B, 1, 1, N).expand(B, Hs, Nq, N), scores, "amax", include_self=True)
    return out[..., :T]


def entry_visible(q_positions: torch.Tensor, T: int, block: int, *, complete: bool) -> torch.Tensor:
    """Which of T position blocks each query may pick: block ``t`` covers positions ``t*block .. (t+1)*block - 1``;
    with ``complete`` it is visible once all its tokens are (``(t + 1) * block <= p + 1``: QSA's micro-blocks,
    V4's compressed entries), else once it starts (``t * block <= p``: MSA, MoBA, and tokens with block 1).

    Args:
        q_positions: (B, Nq) positions, ``-1`` for padding (sees nothing). T: entries. block: tokens per entry.

    Returns:
        (B, 1, Nq, T) bool.

    Example:
        >>> import torch
        >>> entry_visible(torch.tensor([[4]]), 3, 2, complete=True).tolist()
        [[[[True, True, False]]]]
    """
    fn = "entry_visible"
    _tensor(fn, "q_positions", q_positions, 2, "(B, Nq) positions")
    block = _int(fn, "block", block)
    t = torch.arange(T, device=q_positions.device).view(1, 1, T)
    p = q_positions.long().unsqueeze(-1)  # (B, Nq, 1)
    seen = (t + 1) * block <= p + 1 if complete else t * block <= p
    return (seen & (p >= 0)).unsqueeze(1)


def local_entries(q_positions: torch.Tensor, T: int, block: int, local: int) -> torch.Tensor:
    """The forced blocks: the query's own block ``p // block`` and the ``local - 1`` before it (MSA's local
    blocks; MoBA's own block is ``local=1``; a token window when ``block=1``).

    Args:
        q_positions: (B, Nq) positions, ``-1`` for padding (forces nothing). T: entries. local: blocks.

    Returns:
        (B, 1, Nq, T) bool.

    Example:
        >>> import torch
        >>> local_entries(torch.tensor([[5]]), 4, 2, 2).tolist()
        [[[[False, True, True, False]]]]
    """
    _tensor("local_entries", "q_positions", q_positions, 2, "(B, Nq) positions")
    block = _int("local_entries", "block", block)
    local = _int("local_entries", "local", local, 0)
    t = torch.arange(T, device=q_positions.device).view(1, 1, T)
    own = _blocks_of(q_positions.long(), block).unsqueeze(-1)  # (B, Nq, 1)
    return ((t <= own) & (t > own - local) & (own >= 0)).unsqueeze(1)


def select_topk(scores: torch.Tensor, budget: int, *, visible: torch.Tensor | None = None,
                forced: torch.Tensor | None = None) -> torch.Tensor:
    """The entries each row keeps: the forced visible ones, then the best-scored other visible ones, up to
    ``budget`` in all. Order: forced first, then by score, descending; equal scores go to the earlier entry
    (a stable sort), so a cached decode keeps what a full recompute keeps.

    Args:
        scores: (B, Hs, Nq, T) entry scores; ``-inf`` counts as not visible.
        budget: entries per row (forced ones included). Rows see at most T: the list is ``min(budget, T)`` long.
        visible: bool broadcastable to ``scores``, the entries a row may pick (default: all).
        forced: bool broadcastable to ``scores``, entries kept whatever their score (if more than ``budget`` are
            forced and visible, the earliest are kept).

    Returns:
        (B, Hs, Nq, min(budget, T)) int64 entry ids, ``-1`` past the row's visible entries.

    Example:
        >>> import torch
        >>> s = torch.tensor([[[[0.1, 0.9, 0.5, 0.7]]]])
        >>> select_topk(s, 2).tolist(), select_topk(s, 3, forced=torch.tensor([True, False, False, False])).tolist()
        ([[[[1, 3]]]], [[[[0, 1, 3]]]])
    """
    fn = "select_topk"
    _tensor(fn, "scores", scores, 4, "(B, Hs, Nq, T)")
    budget = _int(fn, "budget", budget)
    with torch.no_grad():
        s = scores
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
        if forced is not None:
            keep = forced & ~torch.isneginf(s)
            s = s.masked_fill(keep, float("inf"))
        vals, idx = s.sort(dim=-1, descending=True, stable=True)
        K = min(budget, s.shape[-1])
        vals, idx = vals[..., :K], idx[..., :K]
        return torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)  # NaN scores stay picked: NaN out


def _slot_offset(fn: str, kv_positions: torch.Tensor) -> torch.Tensor:
    """Per row, ``slot - position`` of the present slots (B,), checked constant: contiguous positions."""
    N = kv_positions.shape[1]
    slots = torch.arange(N, device=kv_positions.device).expand_as(kv_positions)
    present = kv_positions >= 0
    off = slots - kv_positions
    hi = torch.where(present, off, torch.full_like(off, -(N + 1))).amax(1)
    lo = torch.where(present, off, torch.full_like(off, 2 * N + 1)).amin(1)
    rows = present.any(1)
    if bool((rows & (hi != lo)).any()):
        raise ValueError(f"{fn}: kv_positions must be contiguous per row (slot = position + a fixed offset, "
                         f"-1 for padding), as a left-padded or contiguous cache holds them; got "
                         f"{kv_positions.tolist() if kv_positions.numel() <= 64 else 'a row that is not'}")
    return torch.where(rows, hi, torch.zeros_like(hi))


def _to_slots(pos: torch.Tensor, ok: torch.Tensor, kv_positions: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Positions (B, ...) to key slots, -1 where not ``ok`` or the position has no slot."""
    B, N = kv_positions.shape
    slot = pos + off.view(B, *([1] * (pos.dim() - 1)))
    ok = ok & (pos >= 0) & (slot >= 0) & (slot < N)
    flat = torch.where(ok, slot, torch.zeros_like(slot)).reshape(B, -1)
    held = torch.gather(kv_positions, 1, flat).view_as(slot)
    ok = ok & (held == pos)
    return torch.where(ok, slot, torch.full_like(slot, -1))


def blocks_to_tokens(ids: torch.Tensor, block: int, kv_positions: torch.Tensor, *,
                     q_positions: torch.Tensor | None = None) -> torch.Tensor:
    """The key slots of picked position blocks: block ``t`` lists the slots at positions ``t*block ..
    (t+1)*block - 1`` that are present (and, with ``q_positions``, at or before the query: causal inside the
    own block).

    Args:
        ids: (B, Hs, Nq, K) block ids, ``-1`` for none. block: tokens per block.
        kv_positions: (B, Nk) the slots' positions (contiguous per row, ``-1`` for padding).
        q_positions: (B, Nq) optional, drops slots after the query.

    Returns:
        (B, Hs, Nq, K * block) int64 key slots, ``-1`` for none: a :func:`qkv.masks.topk` list.

    Example:
        >>> import torch
        >>> blocks_to_tokens(torch.tensor([[[[1, -1]]]]), 2, torch.tensor([[-1, 0, 1, 2]])).tolist()
        [[[[3, -1, -1, -1]]]]
    """
    fn = "blocks_to_tokens"
    _tensor(fn, "ids", ids, 4, "(B, Hs, Nq, K) block ids")
    block = _int(fn, "block", block)
    B, Hs, Nq, K = ids.shape
    kvp = _positions(fn, "kv_positions", kv_positions, B)
    off = _slot_offset(fn, kvp)
    pos = ids.unsqueeze(-1) * block + torch.arange(block, device=ids.device)  # (B, Hs, Nq, K, block)
    ok = ids.unsqueeze(-1) >= 0
    if q_positions is not None:
        qp = _positions(fn, "q_positions", q_positions, B, Nq)
        ok = ok & (pos <= qp.view(B, 1, Nq, 1, 1))
    return _to_slots(pos, ok, kvp, off).flatten(-2)


def tail_tokens(q_positions: torch.Tensor, block: int, kv_positions: torch.Tensor) -> torch.Tensor:
    """QSA's tail: the slots of the query's incomplete block, positions ``((p + 1) // block) * block .. p``
    (at most ``block - 1`` of them; none when ``p + 1`` is a multiple of ``block``).

    Args:
        q_positions: (B, Nq) positions, ``-1`` for padding. block: tokens per block.
        kv_positions: (B, Nk) the slots' positions (contiguous per row, ``-1`` for padding).

    Returns:
        (B, 1, Nq, block - 1) int64 key slots, ``-1`` for none.

    Example:
        >>> import torch
        >>> tail_tokens(torch.tensor([[5]]), 4, torch.arange(6).view(1, 6)).tolist()
        [[[[4, 5, -1]]]]
    """
    fn = "tail_tokens"
    block = _int(fn, "block", block)
    _tensor(fn, "q_positions", q_positions, 2, "(B, Nq) positions")
    B, Nq = q_positions.shape
    qp = q_positions.long()
    kvp = _positions(fn, "kv_positions", kv_positions, B)
    off = _slot_offset(fn, kvp)
    start = ((qp + 1) // block) * block  # (B, Nq)
    pos = start.unsqueeze(-1) + torch.arange(block - 1, device=qp.device)  # (B, Nq, block - 1)
    ok = (pos <= qp.unsqueeze(-1)) & (qp.unsqueeze(-1) >= 0)
    return _to_slots(pos, ok, kvp, off).unsqueeze(1)


def expand_heads(indices: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Lists per KV group (B, Hs, Nq, K) repeated for each query head of the group: (B, num_heads, Nq, K), as
    :func:`qkv.masks.topk` takes one list per query head (or one for all). Hs = 1 or num_heads pass through.

    Example:
        >>> import torch
        >>> expand_heads(torch.tensor([[[[0]], [[1]]]]), 4)[0, :, 0, 0].tolist()
        [0, 0, 1, 1]
    """
    _tensor("expand_heads", "indices", indices, 4, "(B, Hs, Nq, K)")
    Hs = indices.shape[1]
    num_heads = _int("expand_heads", "num_heads", num_heads)
    if Hs in (1, num_heads):
        return indices
    if num_heads % Hs:
        raise ValueError(f"expand_heads: {Hs} selection heads do not divide num_heads={num_heads}; MSA needs one "
                         f"indexer head per KV head (index_n_heads == num_key_value_heads)")
    return indices.repeat_interleave(num_heads // Hs, dim=1)


def _check_positions(fn: str, B: int, Nq: int, Nk: int, q_positions, kv_positions):
    return _positions(fn, "q_positions", q_positions, B, Nq), _positions(fn, "kv_positions", kv_positions, B, Nk)


def dsa_select(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *, budget: int,
               q_positions: torch.Tensor, kv_positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """DSA (DeepSeek-V3.2, GLM-5): the ``budget`` key slots with the largest weighted ReLU index score among those
    at or before the query, one list shared by all heads.

    Args:
        q: (B, Hi, Nq, D) indexer queries (rotated). k: (B, 1, Nk, D) indexer keys (rotated).
        weights: (B, Nq, Hi) head weights (the model's scaling included). budget: tokens per query.
        q_positions: (B, Nq), kv_positions: (B, Nk) positions, ``-1`` for padding.
        scale: on ``q . k`` before the ReLU, default ``D ** -0.5``.

    Returns:
        (B, 1, Nq, min(budget, Nk)) int64 key slots, ``-1`` for none.
    """
    _tensor("dsa_select", "q", q, 4, "(B, Hi, Nq, D)")
    _tensor("dsa_select", "k", k, 4, "(B, 1, Nk, D)")
    qp, kvp = _check_positions("dsa_select", q.shape[0], q.shape[2], k.shape[2], q_positions, kv_positions)
    scores = weighted_relu_scores(q, k, weights, scale=scale)
    seen = (kvp.unsqueeze(1) >= 0) & (kvp.unsqueeze(1) <= qp.unsqueeze(2)) & (qp.unsqueeze(2) >= 0)
    return select_topk(scores, budget, visible=seen.unsqueeze(1))


def qsa_select(q: torch.Tensor, block_keys: torch.Tensor, *, budget: int, block: int, q_positions: torch.Tensor,
               kv_positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """QSA (Qwen4-exp): the ``budget // block`` complete micro-blocks with the largest unweighted ReLU score, plus
    the query's incomplete tail block, one list shared by all heads.

    Args:
        q: (B, Hi, Nq, D) indexer queries (normed, rotated).
        block_keys: (B, 1, T, D) one key per micro-block (positions ``t*block ..``), as the model makes them:
            :func:`pool_keys` with ``complete=True``, then its norm and RoPE at the block's first position.
        budget: tokens per query, a multiple of ``block`` (tail not counted). block: the compression ratio.
        q_positions: (B, Nq), kv_positions: (B, Nk) positions, ``-1`` for padding.
        scale: on ``q . k``, default ``D ** -0.5``.

    Returns:
        (B, 1, Nq, budget + block - 1) int64 key slots, ``-1`` for none (picked blocks first, then the tail).
    """
    fn = "qsa_select"
    block = _int(fn, "block", block)
    budget = _int(fn, "budget", budget)
    if budget % block:
        raise ValueError(f"{fn}: budget={budget} tokens must be a multiple of block={block} (whole micro-blocks)")
    _tensor(fn, "q", q, 4, "(B, Hi, Nq, D)")
    _tensor(fn, "block_keys", block_keys, 4, "(B, 1, T, D)")
    B, T = q.shape[0], block_keys.shape[2]
    qp, kvp = _positions(fn, "q_positions", q_positions, B, q.shape[2]), _positions(fn, "kv_positions", kv_positions, B)
    scores = weighted_relu_scores(q, block_keys, None, scale=scale)  # (B, 1, Nq, T)
    ids = select_topk(scores, budget // block, visible=entry_visible(qp, T, block, complete=True))
    toks = blocks_to_tokens(ids, block, kvp)
    toks = torch.nn.functional.pad(toks, (0, budget - toks.shape[-1]), value=-1)
    return torch.cat((toks, tail_tokens(qp, block, kvp)), dim=-1)


def msa_select(q: torch.Tensor, k: torch.Tensor, *, block: int, topk_blocks: int, local_blocks: int,
               q_positions: torch.Tensor, kv_positions: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor]:
    """MSA (MiniMax-M3): per scorer head (one per KV group), token scores ``q . k`` against one key head,
    max-pooled to position blocks over the tokens at or before the query; the ``local_blocks`` latest blocks
    are forced, the best others fill ``topk_blocks``.

    Args:
        q: (B, Hi, Nq, D) scorer queries (normed, rotated); Hi is the model's KV heads. k: (B, 1, Nk, D).
        block, topk_blocks, local_blocks: the model's ``index_block_size``, ``index_topk_blocks``,
            ``index_local_blocks`` (``local_blocks <= topk_blocks``).
        q_positions: (B, Nq), kv_positions: (B, Nk) positions, ``-1`` for padding.

    Returns:
        ``(blocks (B, Hi, Nq, min(topk_blocks, T)), slots (B, Hi, Nq, that * block))``: the picked block ids and
        their key slots at or before each query, ``-1`` for none.
    """
    fn = "msa_select"
    block = _int(fn, "block", block)
    topk_blocks = _int(fn, "topk_blocks", topk_blocks)
    local_blocks = _int(fn, "local_blocks", local_blocks, 0)
    if local_blocks > topk_blocks:
        raise ValueError(f"{fn}: local_blocks={local_blocks} forced blocks do not fit topk_blocks={topk_blocks}")
    _tensor(fn, "q", q, 4, "(B, Hi, Nq, D)")
    _tensor(fn, "k", k, 4, "(B, 1, Nk, D)")
    qp, kvp = _check_positions(fn, q.shape[0], q.shape[2], k.shape[2], q_positions, kv_positions)
    tok = dot_scores(q, k, scale=scale)  # (B, Hi, Nq, Nk)
    seen = (kvp.unsqueeze(1) >= 0) & (kvp.unsqueeze(1) <= qp.unsqueeze(2))
    blocks = pool_scores(tok.masked_fill(~seen.unsqueeze(1), float("-inf")), block, positions=kvp)
    T = blocks.shape[-1]
    ids = select_topk(blocks, topk_blocks, forced=local_entries(qp, T, block, local_blocks))
    return ids, blocks_to_tokens(ids, block, kvp, q_positions=qp)


def moba_select(q: torch.Tensor, k: torch.Tensor, *, block: int, topk: int, causal: bool = True) -> torch.Tensor:
    """MoBA: per query head, the ``topk`` blocks by affinity with each block's mean key, the own block forced;
    under ``causal`` only blocks starting at or before the query. Queries are the last Nq of the Nk keys.

    Args:
        q: (B, Hq, Nq, D). k: (B, Hkv, Nk, D), ``Hq % Hkv == 0``. block, topk: MoBA's. causal: as in MoBA.

    Returns:
        (B, Hq, Nq, min(topk, ceil(Nk / block))) int64 block ids, ``-1`` for none.
    """
    B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
    means = pool_keys(k, block)  # (B, Hkv, nb, D)
    aff = dot_scores(q.to(means.dtype) if q.dtype != means.dtype else q, means)
    T = means.shape[2]
    qp = (torch.arange(Nq, device=q.device) + (Nk - Nq)).expand(B, Nq)
    visible = entry_visible(qp, T, block, complete=False) if causal else None
    return select_topk(aff, topk, visible=visible, forced=local_entries(qp, T, block, 1))
