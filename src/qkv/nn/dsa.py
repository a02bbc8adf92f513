"""DeepSeek Sparse Attention (DSA): DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with
DeepSeek Sparse Attention" (Section 2.1).

A "lightning indexer" scores every past token for each query with a few cheap heads, and MLA then attends to
the ``index_topk`` best tokens only::

    q_I = wq_b(q_resid)                      (B, N, Hi, Di)   q_resid = q_a_layernorm(q_a_proj(x)), MLA's
    k_I = k_norm(wk(x))                      (B, N, Di)       one key per token, shared by the indexer heads
    RoPE (half-split pairs) on the first dr channels of both, at the tokens' positions
    w   = weights_proj(x) * Hi ** -0.5       (B, N, Hi)       per-token head weights
    I[t, s] = sum_h w[t, h] * ReLU(Di ** -0.5 * q_I[t, h] . k_I[s])      in float32 (float64 for float64)
    keys of t = the index_topk largest I[t, s] over the s that t may see (causal, not padding); on equal
                scores the earlier slot wins

The selection has no gradient (a top-k), as in the paper. The selected latent entries become a
:func:`qkv.masks.topk` mask shared by all heads over MLA's latent cache, so :func:`qkv.attention` reads only
those ``index_topk`` entries per query (the gather backend): a decode step reads K latents per layer, not the
whole cache. The indexer's keys are cached with the latents (:class:`qkv.cache.IndexedLatentSpec`: one row of
``kv_lora_rank + qk_rope_head_dim + index_head_dim`` per token), so KVCache, ``plan_memory`` and
``qkv memory`` count them.

Parameter names are HF transformers' ``DeepseekV32Attention`` / ``DeepseekV32Indexer`` ones (``indexer.wq_b``,
``indexer.wk``, ``indexer.k_norm``, ``indexer.weights_proj``), so ``load_state_dict`` takes a checkpoint's
layer unchanged. HF skips DeepSeek's Hadamard rotation and FP8 scoring (the rotation preserves dot products);
so do we.

Shape legend: B batch, N new tokens, S cached tokens (= N without a cache), Hi indexer heads, Di indexer head
dim, dr RoPE channels, K ``index_topk``.

Example:
    >>> import torch
    >>> from qkv.cache import KVCache
    >>> from qkv.nn import LatentConfig, SparseLatentAttention
    >>> cfg = LatentConfig(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=24,
    ...                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    >>> attn = SparseLatentAttention(cfg, index_n_heads=2, index_head_dim=16, index_topk=4)
    >>> cache = KVCache([attn.cache_spec()])
    >>> x = torch.randn(1, 10, 64)
    >>> prefill = attn(x[:, :9], positions=torch.arange(9), cache=cache)
    >>> step = attn(x[:, 9:], positions=torch.tensor([9]), cache=cache)
    >>> step.out.shape, step.path
    (torch.Size([1, 1, 64]), 'absorbed')
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from .. import masks
from ..cache.protocol import LatentCache
from ..config.latent import LatentConfig
from ..pos.rope import RotaryEmbedding
from ..sparse.select import select_topk, weighted_relu_scores
from .latent import (
    PATHS,
    LatentAttention,
    LatentAttentionOutput,
    PathChoice,
    _as_2d,
    crossover_queries,
    mla_absorbed,
    mla_expanded,
)

if TYPE_CHECKING:
    from ..config.decoder import DecoderConfig

__all__ = ["LightningIndexer", "IndexerOutput", "SparseLatentAttention", "sparse_path_flops"]


class IndexerOutput(NamedTuple):
    """``indices`` (B, N, K) int64 key slots (``-1``: fewer than K visible keys); ``scores`` (B, N, S) float32
    (float64 for float64 inputs) index scores, ``-inf`` where the query may not look."""

    indices: torch.Tensor
    scores: torch.Tensor


class LightningIndexer(nn.Module):
    """DSA's lightning indexer (see the module): picks, per query, the ``index_topk`` keys with the largest
    index score among those it may see.

    Args:
        hidden_size: model width ``d``.
        q_lora_rank: width of MLA's query latent ``q_resid`` (the indexer's queries are read from it).
        index_n_heads: ``Hi``. index_head_dim: ``Di``. index_topk: ``K``.
        qk_rope_head_dim: ``dr``, the RoPE channels at the front of each indexer query/key.
        rope: ``rope(x, positions)`` for those channels; default a half-split (non-interleaved)
            :class:`qkv.pos.RotaryEmbedding` of ``dr`` channels, as HF's DeepSeek-V3.2 indexer uses.
        device, dtype: of the parameters.
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, *, index_n_heads: int, index_head_dim: int,
                 index_topk: int, qk_rope_head_dim: int, rope=None, device=None, dtype=None) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("q_lora_rank", q_lora_rank),
                            ("index_n_heads", index_n_heads), ("index_head_dim", index_head_dim),
                            ("index_topk", index_topk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LightningIndexer: {name} must be an int >= 1, got {value!r}")
        if not 0 <= qk_rope_head_dim <= index_head_dim:
            raise ValueError(f"LightningIndexer: qk_rope_head_dim must be in 0 .. index_head_dim={index_head_dim}, "
                             f"got {qk_rope_head_dim!r}")
        kw = {"device": device, "dtype": dtype}
        self.n_heads, self.head_dim, self.index_topk, self.rope_dim = index_n_heads, index_head_dim, index_topk, \
            qk_rope_head_dim
        self.wq_b = nn.Linear(q_lora_rank, index_n_heads * index_head_dim, bias=False, **kw)
        self.wk = nn.Linear(hidden_size, index_head_dim, bias=False, **kw)
        self.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6, **kw)
        self.weights_proj = nn.Linear(hidden_size, index_n_heads, bias=False, **kw)
        self.rope = rope if rope is not None else RotaryEmbedding(qk_rope_head_dim, interleaved=False)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``dr`` channels of x (B, H, N, Di)."""
        dr = self.rope_dim
        return torch.cat((self.rope(x[..., :dr], positions), x[..., dr:]), dim=-1)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The indexer keys of the new tokens, rotated at ``positions`` (B, N): (B, N, Di), what the cache holds."""
        k = self.k_norm(self.wk(x))  # (B, N, Di)
        return self._rotate(k.unsqueeze(1), positions.clamp_min(0)).squeeze(1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, *, q_positions: torch.Tensor,
                kv_positions: torch.Tensor) -> IndexerOutput:
        """Score and select.

        Args:
            x: (B, N, d) the new tokens' hidden states. q_resid: (B, N, q_lora_rank).
            keys: (B, S, Di) the indexer keys of every visible slot (from :meth:`keys`, or the cache).
            q_positions: (B, N) int64 positions of the queries; kv_positions: (B, S) of the slots (``-1``:
                padding or empty, never selected). A query sees slots at positions ``<=`` its own.

        Returns:
            :class:`IndexerOutput` ``(indices (B, N, min(K, S)), scores (B, N, S))``.
        """
        B, N, _ = x.shape
        with torch.no_grad():
            q = self.wq_b(q_resid).view(B, N, self.n_heads, self.head_dim).transpose(1, 2)  # (B, Hi, N, Di)
            q = self._rotate(q, q_positions.clamp_min(0))
            w = self.weights_proj(x)
            w = w.to(torch.promote_types(w.dtype, torch.float32)) * self.n_heads ** -0.5  # (B, N, Hi)
            # DSA as a point of qkv.sparse.select: weighted ReLU heads, tokens, shared by all heads, no forced
            # entries; on equal scores (ReLU zeros) the earlier slot wins, so a cached decode picks what the full
            # recompute picks.
            scores = weighted_relu_scores(q, keys.unsqueeze(1), w).squeeze(1)  # (B, N, S)
            seen = ((kv_positions.unsqueeze(1) >= 0) & (kv_positions.unsqueeze(1) <= q_positions.unsqueeze(2))
                    & (q_positions.unsqueeze(2) >= 0))
            scores = scores.masked_fill(~seen, float("-inf"))
            idx = select_topk(scores.unsqueeze(1), self.index_topk).squeeze(1)
        return IndexerOutput(idx, scores)

    def extra_repr(self) -> str:
        return f"heads={self.n_heads}, head_dim={self.head_dim}, topk={self.index_topk}, rope_dim={self.rope_dim}"


def sparse_path_flops(config: LatentConfig, nq: int, nk: int, topk: int, *, batch: int = 1) -> tuple[int, int]:
    """Forward FLOPs ``(expanded, absorbed)`` of MLA over ``min(topk, nk)`` selected entries per query (see
    :mod:`qkv.nn.latent` for the two paths; the indexer's cost is in :func:`qkv.costs.dsa_indexer_flops`)."""
    c = config
    H, r, dn, dr, dv = c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    pairs = nq * min(topk, nk)
    expanded = 2 * H * nk * r * (dn + dv) + 2 * H * pairs * (dn + dr + dv)
    absorbed = 2 * H * nq * r * (dn + dv) + 2 * H * pairs * (2 * r + dr)
    return batch * expanded, batch * absorbed


class SparseLatentAttention(LatentAttention):
    """MLA over the latent entries DSA's lightning indexer selects (DeepSeek-V3.2); see the module.

    Args:
        config: a :class:`LatentConfig` with a ``q_lora_rank`` (the indexer reads MLA's query latent).
        index_n_heads, index_head_dim, index_topk: the indexer's (HF config names).
        index_interleaved_rope: the indexer's RoPE pairs interleaved (GLM-5) instead of half-split (DeepSeek-V3.2).

    Other arguments as :class:`LatentAttention`. ``path="auto"`` compares the two paths' FLOPs over the
    selected pairs (:func:`sparse_path_flops`): decode and long prefills go absorbed.

    ``forward(x, *, positions=None, cache=None, mask=None, path=None, need_lse=False)`` as
    :class:`LatentAttention`; the cache is built from :meth:`cache_spec` (latents plus indexer keys).
    """

    def __init__(self, config: LatentConfig, *, index_n_heads: int, index_head_dim: int, index_topk: int,
                 index_interleaved_rope: bool = False, **kw) -> None:
        if not isinstance(config, LatentConfig) or config.q_lora_rank is None:
            raise ValueError(f"SparseLatentAttention: config must be a LatentConfig with q_lora_rank set (the "
                             f"indexer reads MLA's query latent), got {config!r}")
        super().__init__(config, **kw)
        c = config
        self.indexer = LightningIndexer(
            c.hidden_size, c.q_lora_rank, index_n_heads=index_n_heads, index_head_dim=index_head_dim,
            index_topk=index_topk, qk_rope_head_dim=c.qk_rope_head_dim,
            rope=RotaryEmbedding(c.qk_rope_head_dim, theta=c.rope_theta, scaling=c.rope_scaling,
                                 max_position_embeddings=c.max_position_embeddings,
                                 interleaved=bool(index_interleaved_rope)),
            device=kw.get("device"), dtype=kw.get("dtype"))

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int, rope=None) -> SparseLatentAttention:
        """The DSA mixer of layer ``layer_idx`` of ``config`` (:mod:`qkv.nn.mixer`): on the ``gather`` backend when
        the config's is ``"auto"`` (each query reads only its ``index_topk`` latents), else on the config's."""
        c, ix = config, config.indexer
        backend = "gather" if c.backend == "auto" and not c.latent.attention_dropout else c.backend
        return cls(c.latent, index_n_heads=ix.index_n_heads, index_head_dim=ix.index_head_dim,
                   index_topk=ix.index_topk, index_interleaved_rope=ix.interleaved_rope, rope=rope, backend=backend,
                   layer_idx=layer_idx)

    def cache_spec(self):
        """This layer's :class:`qkv.cache.IndexedLatentSpec`: ``r + dr + index_head_dim`` per token."""
        from ..cache.specs import IndexedLatentSpec

        return IndexedLatentSpec(self.config.kv_lora_rank, self.config.qk_rope_head_dim, self.indexer.head_dim)

    def explain_path(self, nq: int, nk: int, *, path: str | None = None) -> PathChoice:
        path = self.path if path is None else path
        if path not in PATHS:
            raise ValueError(f"SparseLatentAttention: path must be one of {PATHS}, got {path!r}")
        expanded, absorbed = sparse_path_flops(self.config, nq, nk, self.indexer.index_topk)
        if path == "auto":
            path = "absorbed" if absorbed < expanded else "expanded"
            why = f"Nq={nq}, Nk={nk}: fewer FLOPs over {min(self.indexer.index_topk, nk)} selected entries per query"
        else:
            why = f"forced by path={path!r}"
        return PathChoice(path, expanded, absorbed, crossover_queries(self.config), why)

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor | None = None, cache=None, mask=None,
                path: str | None = None, need_lse: bool = False) -> LatentAttentionOutput:
        c = self.config
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"SparseLatentAttention: x must be (B, N, hidden_size={c.hidden_size}), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        B, N, _ = x.shape
        H, r, dn, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
        q_resid = self.q_a_layernorm(self.q_a_proj(x))  # (B, N, q_lora_rank), shared with the indexer
        q_BHNk = self.q_b_proj(q_resid).view(B, N, H, dn + dr).transpose(1, 2)
        q_nope_BHNn, q_rope_BHNr = q_BHNk.split([dn, dr], dim=-1)
        c_kv_BNr, k_rope_BNr = self.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)
        c_kv_BNr = self.kv_a_layernorm(c_kv_BNr)
        pos = _as_2d(positions, B, N, "positions", x.device)
        if cache is not None:
            if not isinstance(cache, LatentCache):
                raise TypeError(f"SparseLatentAttention: the cache must follow qkv.cache.LatentCache; build it from "
                                f"this layer's spec, KVCache([attn.cache_spec()]), got {type(cache).__name__}")
            if pos is None:
                raise ValueError("SparseLatentAttention: a cache needs positions (B, N) of the new tokens")
            k_idx = self.indexer.keys(x, pos)  # rotated before caching, as HF does
            tail = torch.cat((k_rope_BNr, k_idx.to(k_rope_BNr.dtype)), dim=-1)  # one row: [k_rope | indexer key]
            view = cache.update_latent(self.layer_idx, c_kv_BNr, tail, positions=pos, rope=self._rope_tail)
            c_kv_BSr, (k_rope_BSr, k_idx_BSi) = view.c_kv, view.k_rope.split([dr, self.indexer.head_dim], dim=-1)
            kv_pos, q_pos = view.kv_positions, view.q_positions
        else:
            q_pos = torch.arange(N, device=x.device).expand(B, N) if pos is None else pos
            rot = q_pos.clamp_min(0)
            k_rope_BSr = self.rope(k_rope_BNr.unsqueeze(1), rot).squeeze(1)
            c_kv_BSr, kv_pos, k_idx_BSi = c_kv_BNr, q_pos, self.indexer.keys(x, q_pos)
        q_rope_BHNr = self.rope(q_rope_BHNr, q_pos.clamp_min(0))
        sel = self.indexer(x, q_resid, k_idx_BSi, q_positions=q_pos, kv_positions=kv_pos)
        picked = masks.topk(sel.indices.unsqueeze(1))  # (B, 1, N, K): one list shared by the heads
        choice = self.explain_path(N, c_kv_BSr.shape[1], path=path)
        fn = mla_absorbed if choice.path == "absorbed" else mla_expanded
        heads = fn(q_nope_BHNn, q_rope_BHNr, c_kv_BSr, k_rope_BSr, self.kv_b_proj.weight, q_positions=q_pos,
                   kv_positions=kv_pos, causal=self.causal, mask=picked if mask is None else picked & mask,
                   scale=c.softmax_scale, dropout_p=c.attention_dropout if self.training else 0.0,
                   return_lse=need_lse, backend=self.backend, attention_fn=self.attention_fn)
        out_BHNv = heads.out
        if self.head_gate is not None:
            out_BHNv = out_BHNv * self.head_gate.to(out_BHNv.dtype).view(1, H, 1, 1)
        out_BNv = out_BHNv.transpose(1, 2).reshape(B, N, H * c.v_head_dim)
        return LatentAttentionOutput(self.o_proj(out_BNv), heads.lse, choice.path)

    def _rope_tail(self, tail: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The cache's RoPE call on ``[k_rope | indexer key]`` (B, 1, N, dr + Di): rotates ``k_rope`` (MLA's
        interleaved pairs); the indexer key arrives rotated already."""
        dr = self.config.qk_rope_head_dim
        return torch.cat((self.rope(tail[..., :dr], positions), tail[..., dr:]), dim=-1)
