"""MoBA, mixture of block attention: Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context
LLMs" (arXiv:2502.13189), Section 2.2.

The keys are cut into blocks of ``block_size``. Query ``q`` (at position ``p``) scores each block by its
affinity with the block's mean key, ``s_j = q · mean(K[block j])``, and attends to the keys of the ``topk``
blocks with the largest affinity. Under causality a query may only pick blocks that start at or before
``p``, its own block (the one holding ``p``) is always picked, and inside its own block it sees keys up to
``p`` only; without causality every block may be picked and the own block is still always included.
Selection is per query head (each head has its own affinities); GQA heads read their shared kv head.

The selection is not differentiable (a top-k); gradients flow through the attention over the selected
keys, as in MoBA. Here the picked blocks become a :func:`qkv.masks.topk` list of ``topk * block_size``
keys per row (``-1`` past the last key), so :func:`qkv.attention` runs it on the gather backend, reading
only the selected keys: O(Nq · topk · block_size · D) time and memory.

Positions are bottom-right aligned (the KV-cache convention): query row ``i`` sits at ``i + Nk - Nq``.

Shape legend: B batch, Hq query heads, Hkv kv heads, Nq queries, Nk keys, nb = ceil(Nk / block_size)
blocks, D head dim.

Example:
    >>> import torch
    >>> from qkv.sparse import moba
    >>> q, k, v = torch.randn(3, 1, 2, 64, 16).unbind(0)
    >>> moba(q, k, v, block_size=8, topk=3).shape
    torch.Size([1, 2, 64, 16])
"""

from __future__ import annotations

import math

import torch

from .. import masks
from .._attention import attention
from .._request import AttentionOutput
from .select import moba_select

__all__ = ["moba", "moba_reference", "moba_blocks"]


def _check(fn: str, q, k, v, block_size, topk) -> tuple[int, int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            seen = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: {name} must be a (B, H, N, D) tensor, got {seen}")
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[-1] != D or Hq % Hkv:
        raise ValueError(f"{fn}: expected q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) with Hq a "
                         f"multiple of Hkv; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Nq > Nk:
        raise ValueError(f"{fn}: Nq={Nq} queries but only Nk={Nk} keys; the queries are the last Nq positions of "
                         f"the keys (bottom-right), so Nq <= Nk")
    for name, x in (("block_size", block_size), ("topk", topk)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{fn}: {name} must be an int >= 1, got {x!r}")
    return B, Hq, Hkv, Nq, Nk


def moba_blocks(q: torch.Tensor, k: torch.Tensor, *, block_size: int, topk: int, causal: bool = True
                ) -> torch.Tensor:
    """The blocks each query picks: (B, Hq, Nq, min(topk, nb)) int64 block ids, ``-1`` where fewer blocks may
    be picked (early queries under causality). Computed without gradients, by :func:`qkv.sparse.select.moba_select`
    (MoBA as a point of the selection space: mean-key scorer, block granularity, per head, own block forced).

    Args:
        q: (B, Hq, Nq, D) queries. k: (B, Hkv, Nk, D) keys.
        block_size, topk, causal: as in :func:`moba`.
    """
    _check("moba_blocks", q, k, k, block_size, topk)
    return moba_select(q, k, block=block_size, topk=topk, causal=causal)


def moba(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int, topk: int, causal: bool = True,
         scale: float | None = None, return_lse: bool = False, backend: str = "auto"
         ) -> torch.Tensor | AttentionOutput:
    """MoBA attention (see the module): each query attends to the keys of its ``topk`` blocks.

    Args:
        q: (B, Hq, Nq, D). k: (B, Hkv, Nk, D). v: (B, Hkv, Nk, Dv). ``Nq <= Nk`` (bottom-right).
        block_size: keys per block.
        topk: blocks per query, the own block included.
        causal: pick only blocks starting at or before the query, causal inside the own block.
        scale: softmax scale, default ``D ** -0.5``.
        return_lse: also return the log-sum-exp, as :func:`qkv.attention` does.
        backend: the :func:`qkv.attention` backend (``auto`` takes the gather path for short lists).

    Returns:
        out (B, Hq, Nq, Dv), or :class:`qkv.AttentionOutput` ``(out, lse)`` with ``return_lse``.

    Example:
        >>> import torch
        >>> from qkv.sparse import moba
        >>> q, k, v = torch.randn(3, 1, 1, 16, 8).unbind(0)
        >>> moba(q, k, v, block_size=4, topk=1, return_lse=True).lse.shape
        torch.Size([1, 1, 16])
    """
    B, Hq, Hkv, Nq, Nk = _check("moba", q, k, v, block_size, topk)
    ids = moba_blocks(q, k, block_size=block_size, topk=topk, causal=causal)  # (B, Hq, Nq, T)
    keys = ids.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)  # (B, Hq, Nq, T, bs)
    keys = torch.where((ids.unsqueeze(-1) < 0) | (keys >= Nk), torch.full_like(keys, -1), keys)
    mask = masks.topk(keys.flatten(-2))
    if causal:
        mask = mask & masks.causal()
    return attention(q, k, v, mask=mask, scale=scale, return_lse=return_lse, backend=backend)


def moba_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int, topk: int,
                   causal: bool = True, scale: float | None = None) -> AttentionOutput:
    """MoBA by its definition, dense and in float64: every block affinity, the picked blocks by rank (a block
    is picked when it is the own block, or fewer than ``topk - 1`` other candidate blocks beat it), the dense
    (Nq, Nk) mask of their keys, softmax attention. O(Nq · Nk) memory: a test oracle, not a kernel.

    Returns:
        :class:`qkv.AttentionOutput` ``(out (B, Hq, Nq, Dv) float64, lse (B, Hq, Nq) float64)``.
    """
    B, Hq, Hkv, Nq, Nk = _check("moba_reference", q, k, v, block_size, topk)
    G = Hq // Hkv
    q, k, v = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    nb = math.ceil(Nk / block_size)
    block_of_key = torch.arange(Nk) // block_size  # (Nk,)
    onehot = (block_of_key.view(1, Nk) == torch.arange(nb).view(nb, 1)).double()  # (nb, Nk)
    means = (onehot @ k) / onehot.sum(1, keepdim=True)  # (B, Hq, nb, D)
    aff = q @ means.transpose(-1, -2)  # (B, Hq, Nq, nb)
    pos = torch.arange(Nq) + (Nk - Nq)
    own = (pos // block_size).view(Nq, 1)  # (Nq, 1)
    blocks = torch.arange(nb).view(1, nb)
    candidate = (blocks <= own) if causal else torch.ones(Nq, nb, dtype=torch.bool)
    other = candidate & (blocks != own)  # (Nq, nb)
    beats = (aff.unsqueeze(-2) > aff.unsqueeze(-1)) & other.view(1, 1, Nq, 1, nb)  # [.., j, m]: m beats j
    picked = (blocks == own) | (other & (beats.sum(-1) < topk - 1))  # (B, Hq, Nq, nb)
    allowed = picked[..., block_of_key]  # (B, Hq, Nq, Nk)
    if causal:
        allowed = allowed & (torch.arange(Nk).view(1, Nk) <= pos.view(Nq, 1))
    s = (q.shape[-1] ** -0.5 if scale is None else scale) * (q @ k.transpose(-1, -2))
    s = s.masked_fill(~allowed, float("-inf"))
    return AttentionOutput(torch.softmax(s, -1) @ v, torch.logsumexp(s, -1))  # every row sees its own key
