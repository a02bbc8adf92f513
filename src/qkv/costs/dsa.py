"""FLOPs and bytes of sparse attention by selection: top-k key lists, DeepSeek Sparse Attention's lightning
indexer (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp", Section 2.1) and MLA over the selected latent entries.

Conventions are :mod:`qkv.costs.flops`' (2 FLOPs per multiply-add, forward only, bottom-right causal: query
``i`` sits at position ``i + Nk - Nq``). With top-k lists a causal query at position ``p`` reads
``min(K, p + 1)`` keys: :func:`topk_pairs`. The indexer scores every visible (query, key) pair (it is the
dense part of DSA, but ``Hi * Di`` wide instead of ``H * (2 r + dr)``), so DSA beats dense MLA once
``K`` is small against the context: :func:`dsa_layer_flops` gives both counts for one layer,
:func:`dsa_model_flops` for every layer of a preset, with :func:`dsa_crossover_context`, the shortest context at
which DSA needs fewer FLOPs than dense MLA.

Bytes count what a step must read at least: the selected entries (each read once per query: a gather does
not share reads between queries whose lists differ), the indexer keys of the whole context, and the float32
index scores written and read back for the top-k.

Example:
    >>> topk_pairs(4, 4, 2)  # rows see 1, 2, 2, 2 keys
    7
    >>> f = dsa_layer_flops(1, 32768, hidden_size=7168, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
    ...                     q_lora_rank=1536, index_n_heads=64, index_head_dim=128, index_topk=2048)
    >>> f.sparse < f.dense
    True
"""

from __future__ import annotations

from typing import NamedTuple

from .flops import attention_flops, mla_absorbed_flops

__all__ = ["topk_pairs", "topk_attention_flops", "topk_attention_bytes", "dsa_indexer_flops", "dsa_indexer_bytes",
           "DSALayerFlops", "dsa_layer_flops", "DSAModelFlops", "dsa_model_flops", "dsa_crossover_context"]


def _int(fn: str, **values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{fn}: {name} must be an int >= 1, got {v!r}")


def topk_pairs(q_len: int, kv_len: int, topk: int, *, causal: bool = True) -> int:
    """(query, key) pairs read when each query reads its ``topk`` listed keys; causal queries see at most
    ``p + 1`` keys (position ``p = i + kv_len - q_len``), so early ones read fewer."""
    _int("topk_pairs", q_len=q_len, kv_len=kv_len, topk=topk)
    k = min(topk, kv_len)
    if not causal:
        return q_len * k
    # Query i sees p + 1 = i + kv_len - q_len + 1 keys (none when that is <= 0) and reads at most k of them:
    # the sum of min(v, k) over v = lo .. kv_len, in closed form (exact integers, O(1) at any length).
    lo = max(kv_len - q_len + 1, 1)
    top = min(kv_len, k)
    below = (lo + top) * (top - lo + 1) // 2 if top >= lo else 0  # v <= k: v keys each
    return below + k * max(kv_len - max(lo, k + 1) + 1, 0)  # v > k: k keys each


def topk_attention_flops(batch: int, num_heads: int, q_len: int, kv_len: int, topk: int, head_dim: int, *,
                         v_head_dim: int | None = None, causal: bool = True) -> int:
    """Forward FLOPs of attention over top-k lists: ``2 * B * Hq * pairs * (Dqk + Dv)`` with
    :func:`topk_pairs` (the floor ``4 * B * Hq * Nq * K * D`` once every query sees K keys).

    Example:
        >>> topk_attention_flops(1, 1, 4096, 4096, 2048, 64) < attention_flops(1, 1, 4096, 4096, 64, causal=True)
        True
    """
    _int("topk_attention_flops", batch=batch, num_heads=num_heads, head_dim=head_dim)
    return 2 * batch * num_heads * topk_pairs(q_len, kv_len, topk, causal=causal) * (head_dim + (v_head_dim or
                                                                                                  head_dim))


def topk_attention_bytes(batch: int, num_kv_heads: int, q_len: int, kv_len: int, topk: int, head_dim: int, *,
                         v_head_dim: int | None = None, dtype_bytes: float = 2, causal: bool = True,
                         index_bytes: int = 8) -> float:
    """Bytes a gather over top-k lists reads and writes at least: each query's selected keys and values (per
    kv head, lists shared by its query heads), the lists themselves, the queries and the outputs."""
    _int("topk_attention_bytes", batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim)
    dv = v_head_dim or head_dim
    pairs = topk_pairs(q_len, kv_len, topk, causal=causal)
    gathered = batch * num_kv_heads * pairs * (head_dim + dv) * dtype_bytes
    lists = batch * q_len * min(topk, kv_len) * index_bytes
    return gathered + lists + batch * num_kv_heads * q_len * (head_dim + dv) * dtype_bytes


def dsa_indexer_flops(batch: int, q_len: int, kv_len: int, *, hidden_size: int, q_lora_rank: int,
                      index_n_heads: int, index_head_dim: int, causal: bool = True) -> int:
    """Forward FLOPs of the lightning indexer for ``q_len`` new tokens over ``kv_len`` cached ones: its
    projections (``wq_b``: q_lora_rank -> Hi * Di, ``wk``: d -> Di, ``weights_proj``: d -> Hi) and, per visible
    pair, ``Hi`` dot products of ``Di`` plus the weighted sum over heads (the top-k itself is not counted)."""
    _int("dsa_indexer_flops", batch=batch, q_len=q_len, kv_len=kv_len, hidden_size=hidden_size,
         q_lora_rank=q_lora_rank, index_n_heads=index_n_heads, index_head_dim=index_head_dim)
    Hi, Di = index_n_heads, index_head_dim
    proj = 2 * q_len * (q_lora_rank * Hi * Di + hidden_size * Di + hidden_size * Hi)
    pairs_x2 = attention_flops(1, 1, q_len, kv_len, 1, v_head_dim=1, causal=causal) // 2  # 2 * pairs
    return batch * (proj + pairs_x2 * Hi * (Di + 1))


def dsa_indexer_bytes(batch: int, q_len: int, kv_len: int, *, index_head_dim: int, dtype_bytes: float = 2) -> float:
    """Bytes the indexer moves at least: the cached indexer keys (read once per step) and the float32 index
    scores of every (query, key) slot, written and read back by the top-k."""
    _int("dsa_indexer_bytes", batch=batch, q_len=q_len, kv_len=kv_len, index_head_dim=index_head_dim)
    return batch * (kv_len * index_head_dim * dtype_bytes + 2 * 4 * q_len * kv_len)


class DSALayerFlops(NamedTuple):
    """One MLA layer's attention FLOPs (latent space, absorbed) with and without DSA: ``sparse = indexer +
    selected``; ``dense`` attends every causal pair."""

    indexer: int
    selected: int
    sparse: int
    dense: int


def dsa_layer_flops(batch: int, context: int, *, hidden_size: int, num_heads: int, kv_lora_rank: int,
                    qk_rope_head_dim: int, q_lora_rank: int, index_n_heads: int, index_head_dim: int,
                    index_topk: int, q_len: int | None = None) -> DSALayerFlops:
    """A prefill of ``context`` tokens (or ``q_len`` new ones over a ``context``-token cache, e.g. ``q_len=1``
    for a decode step): the indexer, MLA over the ``index_topk`` selected latents, and dense MLA, all in the
    latent space (``2 * H * pairs * (2 r + dr)``)."""
    nq = context if q_len is None else q_len
    idx = dsa_indexer_flops(batch, nq, context, hidden_size=hidden_size, q_lora_rank=q_lora_rank,
                            index_n_heads=index_n_heads, index_head_dim=index_head_dim)
    sel = 2 * batch * num_heads * topk_pairs(nq, context, index_topk) * (2 * kv_lora_rank + qk_rope_head_dim)
    dense = mla_absorbed_flops(batch, num_heads, nq, context, kv_lora_rank=kv_lora_rank,
                               qk_rope_head_dim=qk_rope_head_dim, causal=True)
    return DSALayerFlops(idx, sel, idx + sel, dense)


class DSAModelFlops(NamedTuple):
    """DSA against dense MLA over every layer of a model (latent space, as :func:`dsa_layer_flops`):
    ``prefill`` over a causal prompt of ``context`` tokens, ``decode`` one new token over ``context`` cached ones;
    ``crossover_prefill`` / ``crossover_decode`` the shortest context from which DSA needs fewer FLOPs (None:
    never)."""

    preset: str
    context: int
    batch: int
    index_topk: int
    prefill: DSALayerFlops
    decode: DSALayerFlops
    crossover_prefill: int | None
    crossover_decode: int | None


def _layer_shape(preset) -> dict[str, int]:
    c = preset.config
    lat, idx = c.latent, c.indexer
    if idx is None or lat is None or lat.q_lora_rank is None:
        raise ValueError(f"dsa_model_flops: preset {preset.name!r} has no lightning indexer (index_n_heads, "
                         "index_head_dim, index_topk with MLA and a q_lora_rank); DeepSeek Sparse Attention presets: "
                         "deepseek-v3.2")
    return dict(hidden_size=c.hidden_size, num_heads=c.num_attention_heads, kv_lora_rank=lat.kv_lora_rank,
                qk_rope_head_dim=lat.qk_rope_head_dim, q_lora_rank=lat.q_lora_rank, index_n_heads=idx.index_n_heads,
                index_head_dim=idx.index_head_dim, index_topk=idx.index_topk)


def dsa_crossover_context(*, hidden_size: int, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int,
                          q_lora_rank: int, index_n_heads: int, index_head_dim: int, index_topk: int,
                          decode: bool = False, limit: int = 1 << 40) -> int | None:
    """The shortest context at which one layer's DSA (indexer + MLA over ``index_topk`` latents) needs fewer
    FLOPs than dense MLA: for a prefill of that many tokens, or (``decode``) one token over that many cached.
    None when DSA never wins below ``limit`` (an indexer as wide per pair as MLA itself).

    Up to ``index_topk`` tokens DSA reads every key and pays the indexer on top; past it the dense count minus
    DSA's grows linearly (decode) or as a convex quadratic (prefill), so it changes sign once, found by bisection.

    Example:
        >>> dsa_crossover_context(hidden_size=7168, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
        ...                       q_lora_rank=1536, index_n_heads=64, index_head_dim=128, index_topk=2048, decode=True)
        2284
    """
    shape = dict(hidden_size=hidden_size, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                 qk_rope_head_dim=qk_rope_head_dim, q_lora_rank=q_lora_rank, index_n_heads=index_n_heads,
                 index_head_dim=index_head_dim, index_topk=index_topk)

    def wins(n: int) -> bool:
        f = dsa_layer_flops(1, n, q_len=1 if decode else None, **shape)
        return f.sparse < f.dense

    _int("dsa_crossover_context", limit=limit)
    lo, hi = index_topk, limit  # DSA cannot win at or below index_topk: it reads every key there
    if not wins(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


def dsa_model_flops(preset, *, context: int, batch: int = 1) -> DSAModelFlops:
    """DSA and dense MLA FLOPs of every layer of ``preset`` (a :class:`qkv.config.ModelPreset` with an indexer, e.g.
    ``PRESETS["deepseek-v3.2"]``) at ``context`` tokens, and the crossovers (:func:`dsa_crossover_context`).

    Example:
        >>> from qkv.config import PRESETS
        >>> f = dsa_model_flops(PRESETS["deepseek-v3.2"], context=131072)
        >>> f.decode.sparse < f.decode.dense, f.crossover_decode
        (True, 2284)
    """
    shape = _layer_shape(preset)
    _int("dsa_model_flops", context=context, batch=batch)
    n = preset.config.num_hidden_layers

    def total(q_len):
        f = dsa_layer_flops(batch, context, q_len=q_len, **shape)
        return DSALayerFlops(*(n * v for v in f))

    return DSAModelFlops(preset.name, context, batch, shape["index_topk"], total(None), total(1),
                         dsa_crossover_context(**shape), dsa_crossover_context(**shape, decode=True))
