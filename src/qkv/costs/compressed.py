"""FLOPs and KV bytes of compressed attention (DeepSeek-AI 2026, "DeepSeek-V4", Section 2.3) beside sliding-window,
DeepSeek Sparse Attention and dense attention, as functions of the context length.

Conventions are :mod:`qkv.costs.flops`' (2 FLOPs per multiply-add, forward only, causal). A query at position ``p``
(0-based) reads, per layer kind:

- **sliding** (window ``W``): ``min(W, p + 1)`` keys;
- **HCA** (rate ``m'``): the window plus every complete entry, ``floor((p + 1) / m')``;
- **CSA** (rate ``m``, budget ``k``): the window plus ``min(k, floor((p + 1) / m))`` selected entries, and its
  lightning indexer scores every complete entry with ``Hi`` heads of width ``Di``;
- **dense**: ``p + 1`` keys.

Sums over ``p`` are closed forms (exact integers, O(1) at any length). One KV head of width ``D`` serves K and V
(V4's shared-KV MQA), so attention FLOPs per (query, key) pair are ``2 * H * 2D``. Bytes per cached token follow
the ``*_dtype_bytes`` arguments: V4 keeps its KV entries in mixed precision, so pass the average bytes per
element of the format you store.

Example:
    >>> compressed_pairs(9, rate=4)                    # positions 3..6 see 1 entry, 7 and 8 see 2
    8
    >>> compressed_pairs(9, rate=4, topk=1)
    6
    >>> c = csa_cost(32768, num_heads=16, head_dim=512, window=128, rate=4, topk=512, index_n_heads=64,
    ...              index_head_dim=128)
    >>> round(c.prefill_flops / dense_cost(32768, num_heads=16, head_dim=512).prefill_flops, 3)
    0.164
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["compressed_pairs", "sliding_pairs", "SchemeCost", "sliding_cost", "hca_cost", "csa_cost", "dense_cost",
           "dsa_cost"]


def _int(fn: str, minimum: int = 1, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise ValueError(f"{fn}: {name} must be an int >= {minimum}, got {v!r}")


def _floor_sum(n: int, rate: int) -> int:
    """sum over v = 1 .. n of floor(v / rate) (0 for n <= 0)."""
    if n <= 0:
        return 0
    q, r = divmod(n, rate)
    return rate * q * (q - 1) // 2 + q * (r + 1)


def _min_sum(n: int, cap: int) -> int:
    """sum over v = 1 .. n of min(v, cap)."""
    if n <= 0:
        return 0
    low = min(n, cap)
    return low * (low + 1) // 2 + cap * max(n - cap, 0)


def _positions(fn: str, context: int, q_len: int | None) -> tuple[int, int]:
    """(first, last) ``p + 1`` of the queries: the last ``q_len`` of ``context`` tokens."""
    _int(fn, context=context)
    nq = context if q_len is None else q_len
    _int(fn, q_len=nq)
    if nq > context:
        raise ValueError(f"{fn}: q_len={nq} new tokens cannot exceed the context of {context} tokens")
    return context - nq + 1, context


def compressed_pairs(context: int, *, rate: int, topk: int | None = None, q_len: int | None = None) -> int:
    """(query, compressed entry) pairs read by the last ``q_len`` (default all) of ``context`` causal queries:
    every complete entry (``topk=None``, HCA) or at most ``topk`` of them (CSA)."""
    _int("compressed_pairs", rate=rate)
    lo, hi = _positions("compressed_pairs", context, q_len)
    if topk is None:
        return _floor_sum(hi, rate) - _floor_sum(lo - 1, rate)
    _int("compressed_pairs", topk=topk)
    full = topk * rate  # from p + 1 = topk * rate on, a query sees topk entries or more
    below = _floor_sum(min(hi, full - 1), rate) - _floor_sum(min(lo - 1, full - 1), rate)
    return below + topk * max(hi - max(lo, full) + 1, 0)


def sliding_pairs(context: int, *, window: int, q_len: int | None = None) -> int:
    """(query, key) pairs of a sliding window of ``window`` keys (the query's own included, HF's
    ``sliding_window``) over the last ``q_len`` of ``context`` causal queries."""
    _int("sliding_pairs", window=window)
    lo, hi = _positions("sliding_pairs", context, q_len)
    return _min_sum(hi, window) - _min_sum(lo - 1, window)


class SchemeCost(NamedTuple):
    """One attention layer at a context of N tokens (batch 1): ``prefill_flops`` for a causal prompt of N tokens,
    ``decode_flops`` for one new token over N cached ones (both: attention, plus the indexer where the scheme has
    one, which ``indexer_*`` also give alone), ``kv_bytes`` cached for the N tokens."""

    prefill_flops: int
    decode_flops: int
    indexer_prefill_flops: int
    indexer_decode_flops: int
    kv_bytes: float


def _cost(context, pair_flops, pairs, index_pair_flops, index_pairs, kv_bytes) -> SchemeCost:
    prefill_idx = index_pair_flops * index_pairs(None)
    decode_idx = index_pair_flops * index_pairs(1)
    return SchemeCost(pair_flops * pairs(None) + prefill_idx, pair_flops * pairs(1) + decode_idx, prefill_idx,
                      decode_idx, kv_bytes)


def sliding_cost(context: int, *, num_heads: int, head_dim: int, window: int, num_kv_heads: int = 1,
                 shared_kv: bool = True, dtype_bytes: float = 2) -> SchemeCost:
    """Sliding-window attention: ``window`` keys per query; the cache keeps the last ``window`` tokens (K and V
    one tensor with ``shared_kv``, as V4)."""
    _int("sliding_cost", num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads)
    kv = min(window, context) * num_kv_heads * head_dim * (1 if shared_kv else 2) * dtype_bytes
    return _cost(context, 4 * num_heads * head_dim, lambda q: sliding_pairs(context, window=window, q_len=q), 0,
                 lambda q: 0, kv)


def hca_cost(context: int, *, num_heads: int, head_dim: int, window: int, rate: int, dtype_bytes: float = 2
             ) -> SchemeCost:
    """V4's heavily compressed attention: the window plus every complete entry of ``rate`` tokens; the cache keeps
    the window and one shared-KV entry per ``rate`` tokens."""
    _int("hca_cost", num_heads=num_heads, head_dim=head_dim)
    kv = (min(window, context) + context // rate) * head_dim * dtype_bytes
    return _cost(context, 4 * num_heads * head_dim,
                 lambda q: sliding_pairs(context, window=window, q_len=q) + compressed_pairs(context, rate=rate,
                                                                                            q_len=q),
                 0, lambda q: 0, kv)


def csa_cost(context: int, *, num_heads: int, head_dim: int, window: int, rate: int, topk: int, index_n_heads: int,
             index_head_dim: int, dtype_bytes: float = 2, index_dtype_bytes: float = 2) -> SchemeCost:
    """V4's compressed sparse attention: the window plus ``topk`` selected entries of ``rate`` tokens, chosen by a
    lightning indexer that scores every complete entry (``2 * Hi * Di`` FLOPs for the products, ``2 * Hi`` for the
    head weights, per pair). The cache keeps the window, the entries and the indexer's compressed keys."""
    _int("csa_cost", num_heads=num_heads, head_dim=head_dim, index_n_heads=index_n_heads,
         index_head_dim=index_head_dim)
    entries = context // rate
    kv = (min(window, context) + entries) * head_dim * dtype_bytes + entries * index_head_dim * index_dtype_bytes
    return _cost(context, 4 * num_heads * head_dim,
                 lambda q: sliding_pairs(context, window=window, q_len=q) + compressed_pairs(context, rate=rate,
                                                                                            topk=topk, q_len=q),
                 2 * index_n_heads * (index_head_dim + 1), lambda q: compressed_pairs(context, rate=rate, q_len=q),
                 kv)


def dense_cost(context: int, *, num_heads: int, head_dim: int, num_kv_heads: int = 1, shared_kv: bool = True,
               dtype_bytes: float = 2) -> SchemeCost:
    """Dense causal attention over every token (the comparison point: the same head shape, no compression)."""
    _int("dense_cost", num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads)
    kv = context * num_kv_heads * head_dim * (1 if shared_kv else 2) * dtype_bytes
    return _cost(context, 4 * num_heads * head_dim, lambda q: sliding_pairs(context, window=context, q_len=q), 0,
                 lambda q: 0, kv)


def dsa_cost(context: int, *, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, topk: int,
             index_n_heads: int, index_head_dim: int, dtype_bytes: float = 2, index_dtype_bytes: float = 2
             ) -> SchemeCost:
    """DeepSeek-V3.2's DSA (MLA in the latent space, absorbed): ``topk`` latents per query, ``2 * H * (2 r + dr)``
    FLOPs per pair; its indexer scores every token. The cache keeps one latent of ``r + dr`` and one indexer key per
    token."""
    _int("dsa_cost", num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
         index_n_heads=index_n_heads, index_head_dim=index_head_dim)
    kv = context * ((kv_lora_rank + qk_rope_head_dim) * dtype_bytes + index_head_dim * index_dtype_bytes)
    return _cost(context, 2 * num_heads * (2 * kv_lora_rank + qk_rope_head_dim),
                 lambda q: compressed_pairs(context, rate=1, topk=topk, q_len=q),
                 2 * index_n_heads * (index_head_dim + 1), lambda q: compressed_pairs(context, rate=1, q_len=q), kv)
