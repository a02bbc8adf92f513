"""QSA, Qwen4-Exp's indexed attention: Qwen Team 2026, "Qwen4-Exp" model card.

Gated grouped-query attention (Qwen3-Next's: output gate, per-head QK RMSNorm, partial RoPE) in which each query
reads only the tokens a cheap indexer keeps. The indexer has ``Hi`` query heads and one key head; it scores
*blocks* of ``r`` consecutive keys (micro-blocks, HF ``indexer_compress_ratio``) by their average key::

    q_I, k_I = split(index_qk_proj(x))              (B, N, Hi, Di), (B, N, Di)
    q_I      = RoPE(q_layernorm(q_I), p)            at the query's position
    k̄_t      = RoPE(k_layernorm(mean(k_I[t r .. t r + r - 1])), t r)     block t, at its first position
    s[p, t]  = sum_h ReLU(q_I[p, h] . k̄_t) / sqrt(Di)                   no head weights
    keep     = the budget / r best complete blocks (a block is complete for p when t r + r - 1 <= p),
               plus the tail: the p + 1 - r floor((p + 1) / r) tokens of p's incomplete block (forced)

One token list per query, shared by every attention head (one indexer key head), ``budget + r - 1`` entries
(``-1`` for the entries a shorter list leaves empty; in the example, query 3's own block is complete and loses to
block 0, so query 3 does not read itself). The list becomes a :func:`qkv.masks.topk` mask over the layer's keys, so
:func:`qkv.attention` reads only the kept tokens (the gather backend). When a query's own block is complete and
not among the best, the query does not read itself: that is the model's rule, kept. On equal scores (ReLU
zeros) the earlier block wins.

Parameter names are HF's (``q_proj`` / ``k_proj`` / ``v_proj`` fused into ``qkv_proj`` by the loader;
``indexer.index_qk_proj``, ``indexer.q_layernorm``, ``indexer.k_layernorm``).

Shape legend: B batch, N tokens, S key slots, Hi indexer heads, Di indexer head dim, r block, T blocks, K list
length.

Example:
    >>> import torch
    >>> from qkv.sparse.select import qsa_select
    >>> scores = torch.tensor([[0.0, 0.0], [0.0, 0.0], [5.0, 0.0], [5.0, 0.0], [1.0, 9.0]])  # (N=5, T=2)
    >>> pos = torch.arange(5)[None]  # one-hot block keys: q . k_t is the score of block t
    >>> qsa_select(scores[None, None], torch.eye(2)[None, None], budget=2, block=2, q_positions=pos,
    ...            kv_positions=pos, scale=1.0)[0, 0].tolist()
    [[-1, -1, 0], [0, 1, -1], [0, 1, 2], [0, 1, -1], [2, 3, 4]]
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import masks
from ..config.decoder import DecoderConfig
from ..pos.rope import apply_rotary
from ..sparse.select import qsa_select
from .norm import RMSNorm
from .selecting import SelectingAttention

if TYPE_CHECKING:
    from .decoder import RopeTable
    from .mixer import MixerStep

__all__ = ["IndexedAttention", "QSAIndexer", "qsa_block_keys"]


def qsa_block_keys(keys: torch.Tensor, kv_positions: torch.Tensor, *, block: int, blocks: int) -> torch.Tensor:
    """The mean key (B, T, Di) of each block ``t < blocks`` of positions ``t r .. t r + r - 1``, from the keys (B, S,
    Di) of slots at ``kv_positions`` (B, S) (``-1``: padding or empty); a block some of whose positions a row lacks
    is averaged over those it has (no query of that row can see it). Sums run in float32 (float64 for float64)."""
    B, S, Di = keys.shape
    work = torch.float64 if keys.dtype == torch.float64 else torch.float32
    inside = (kv_positions >= 0) & (kv_positions < blocks * block)
    t = torch.where(inside, kv_positions // block, blocks)  # (B, S), `blocks` collects the rest
    sums = torch.zeros(B, blocks + 1, Di, dtype=work, device=keys.device)
    sums.scatter_add_(1, t.unsqueeze(-1).expand(B, S, Di), keys.to(work))
    return (sums[:, :blocks] / block).to(keys.dtype)


class QSAIndexer(nn.Module):
    """QSA's indexer (module notes): its projection and norms; :meth:`select` scores and keeps.

    Args:
        hidden_size: ``d``.
        index_n_heads: ``Hi``.
        index_head_dim: ``Di``.
        budget: tokens kept from complete blocks.
        block: ``r``.
        eps: the norms' epsilon.
    """

    def __init__(self, hidden_size: int, *, index_n_heads: int, index_head_dim: int, budget: int, block: int,
                 eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.n_heads, self.head_dim, self.block, self.block_topk = index_n_heads, index_head_dim, block, budget // block
        self.index_qk_proj = nn.Linear(hidden_size, (index_n_heads + 1) * index_head_dim, bias=False, **kw)
        self.q_layernorm = RMSNorm(index_head_dim, eps=eps, offset=1.0)
        self.k_layernorm = RMSNorm(index_head_dim, eps=eps, offset=1.0)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N, d) -> the normed indexer queries (B, Hi, N, Di), not rotated, and the raw keys (B, N, Di)."""
        B, N, _ = x.shape
        q, k = self.index_qk_proj(x).split((self.n_heads * self.head_dim, self.head_dim), dim=-1)
        return self.q_layernorm(q.view(B, N, self.n_heads, self.head_dim)).transpose(1, 2), k

    @torch.no_grad()
    def select(self, q: torch.Tensor, keys: torch.Tensor, *, q_positions: torch.Tensor, kv_positions: torch.Tensor,
               rope: RopeTable | None) -> torch.Tensor:
        """Token lists (B, 1, N, K) (:func:`qkv.sparse.select.qsa_select`, the selection space's QSA point) of the
        rotated indexer queries ``q`` (B, Hi, N, Di) over the raw keys (B, S, Di) of slots at ``kv_positions``."""
        r = self.block
        longest = int(kv_positions.max()) + 1 if kv_positions.numel() else 0
        T = longest // r
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        kb = self.k_layernorm(qsa_block_keys(keys, kv_positions, block=r, blocks=T)).unsqueeze(1)  # (B, 1, T, Di)
        if rope is not None:
            starts = torch.arange(T, device=q.device) * r
            cos, sin = rope.cos_sin(starts, work)
            kb = apply_rotary(kb, cos, sin, interleaved=rope.emb.interleaved)
        return qsa_select(q.to(work), kb.to(work), budget=self.block_topk * r, block=r, q_positions=q_positions,
                          kv_positions=kv_positions, scale=1.0 / math.sqrt(self.head_dim))

    def extra_repr(self) -> str:
        return f"heads={self.n_heads}, head_dim={self.head_dim}, block={self.block}, block_topk={self.block_topk}"


class IndexedAttention(SelectingAttention):
    """QSA (module notes): :class:`qkv.nn.SelfAttention` over the tokens its :class:`QSAIndexer` keeps, on the
    ``gather`` backend when the config's is ``"auto"``. A cache keeps each token's raw indexer key beside its keys
    and values (:class:`qkv.nn.selecting.SelectingAttention`, :class:`qkv.cache.IndexedSpec`).
    """

    def __init__(self, c: DecoderConfig, layer_idx: int, rope: RopeTable | None) -> None:
        super().__init__(c, layer_idx, rope)
        qsa = c.qsa
        rotary = 0 if rope is None else int(c.head_dim * c.rope_for("full_attention").partial_rotary_factor)
        if rotary > qsa.index_head_dim:
            raise ValueError(f"IndexedAttention: the attention's rotary dim {rotary} must fit the indexer head "
                             f"(index_head_dim={qsa.index_head_dim}); the indexer rotates its first channels")
        self.indexer = QSAIndexer(c.hidden_size, index_n_heads=qsa.index_n_heads, index_head_dim=qsa.index_head_dim,
                                  budget=qsa.budget, block=qsa.block, eps=c.rms_norm_eps)
        if c.backend == "auto":
            self.backend = self.decode_backend = "gather"

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int, rope: RopeTable | None = None) -> IndexedAttention:
        """The QSA mixer of layer ``layer_idx`` of ``config`` (:mod:`qkv.nn.mixer`)."""
        return cls(config, layer_idx, rope)

    kind_name = "QSA"

    def index_step(self, x: torch.Tensor, step: MixerStep,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw indexer keys of the new tokens (what a cache keeps: blocks are averaged, normed and rotated when
        scored) and the normed indexer queries rotated at their positions."""
        q, keys = self.indexer.project(x)
        if self.rope is not None:
            cos, sin = step.cos_sin(self.rope, x.device)
            q = apply_rotary(q, cos, sin, interleaved=self.rope.emb.interleaved)
        return keys, q

    def selection(self, x: torch.Tensor, context: torch.Tensor, keys: torch.Tensor, *, q_positions: torch.Tensor,
                  kv_positions: torch.Tensor) -> masks.Mask:
        """One token list per query, shared by every head."""
        return masks.topk(self.indexer.select(context, keys, q_positions=q_positions, kv_positions=kv_positions,
                                              rope=self.rope))
