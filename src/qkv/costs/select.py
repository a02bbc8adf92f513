"""FLOPs of selection (:mod:`qkv.sparse.select`) as functions of the context: the keys each query attends and
the scorer's work, for every point of the selection space (:class:`qkv.config.select.SelectSpec`: DSA, QSA,
MSA, MoBA). Papers as there: DeepSeek-AI 2025 (DSA), Lu et al. 2025 (MoBA, arXiv:2502.13189), the GLM-5,
MiniMax-M3 and Qwen4-exp reports (2026).

Conventions are :mod:`qkv.costs.flops`' (2 FLOPs per multiply-add, forward only). A causal prefill of ``n``
tokens has queries at positions ``0 .. n - 1``; a decode step one query at position ``n - 1``. What a query at
position ``p`` attends:

- token granularity (DSA): ``min(K, p + 1)`` keys;
- micro-blocks with a tail (QSA, blocks of ``r``): ``min(K, c) * r`` keys of the ``c = (p + 1) // r`` complete
  blocks, plus the ``p + 1 - c * r`` tail tokens;
- blocks with the own block forced (MSA with ``local >= 1``, MoBA): ``(min(K, v) - 1) * bs + p % bs + 1`` with
  ``v = p // bs + 1`` visible blocks (the own block is causal inside).

The scorer (projections not counted: they are the model's weights) multiplies each query's ``Hi`` heads of
``Di`` with every visible key (DSA, MSA: ``p + 1`` tokens), complete micro-block (QSA) or block mean (MoBA); DSA
adds its per-head weights (a multiply and an add per head and key).

Example:
    >>> from qkv.config.select import SelectSpec
    >>> select_pairs(SelectSpec.dsa(topk=2), 4)  # rows attend 1, 2, 2, 2 keys
    7
    >>> select_pairs(SelectSpec.qsa(budget=2, ratio=2), 5)  # one block of 2 plus the tail: 1, 2, 3, 2, 3
    11
"""

from __future__ import annotations

from typing import NamedTuple

from ..config.select import SelectSpec

__all__ = ["keys_at", "select_pairs", "scorer_flops", "SelectFlops", "select_flops"]


def _check(fn: str, spec, **values: int) -> None:
    if not isinstance(spec, SelectSpec):
        raise TypeError(f"{fn}: spec must be a qkv.config.select.SelectSpec (e.g. SelectSpec.dsa(topk=2048)), got "
                        f"{type(spec).__name__}")
    if spec.granularity == "compressed":
        raise ValueError(f"{fn}: compressed entries are counted by qkv.costs.compressed (their visibility depends "
                         "on the compression rate and the sliding branch)")
    if spec.granularity == "block" and spec.local < 1:
        raise ValueError(f"{fn}: blocks without a forced own block (local=0) attend a query-dependent count; "
                         "give local >= 1 (MSA, MoBA)")
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{fn}: {name} must be an int >= 0, got {v!r}")


def keys_at(spec: SelectSpec, p: int) -> int:
    """Keys a causal query at position ``p`` attends under ``spec`` (see the module).

    Example:
        >>> keys_at(SelectSpec.msa(block=4, topk_blocks=2, local_blocks=1), 9)  # blocks 2 (own, 2 keys) and 1 more
        6
    """
    _check("keys_at", spec, p=p)
    K, b = spec.budget, spec.block
    if spec.granularity == "token":
        return min(K, p + 1)
    if spec.tail:
        c = (p + 1) // b
        return min(K, c) * b + (p + 1 - c * b)
    v = p // b + 1
    return (min(K, v) - 1) * b + p % b + 1


def _scored_entries(spec: SelectSpec, p: int) -> int:
    """Entries the scorer multiplies a query at ``p`` with: tokens (DSA, MSA), complete micro-blocks (QSA), blocks
    (MoBA's means)."""
    if spec.scorer in ("weighted_relu", "max_dot"):
        return p + 1
    if spec.tail:
        return (p + 1) // spec.block
    return p // spec.block + 1


def select_pairs(spec: SelectSpec, n: int, *, decode: bool = False) -> int:
    """Attended (query, key) pairs of a causal prefill of ``n`` tokens (``decode``: one query at position
    ``n - 1``), summed over the positions (O(n) integer work)."""
    _check("select_pairs", spec, n=n)
    if n == 0:
        return 0
    if decode:
        return keys_at(spec, n - 1)
    return sum(keys_at(spec, p) for p in range(n))


def scorer_flops(spec: SelectSpec, n: int, *, decode: bool = False) -> int:
    """The scorer's FLOPs over a causal prefill of ``n`` tokens (``decode``: the last query only): ``2 * Hi * Di``
    per (query, scored entry), plus DSA's head weights (``2 * Hi`` per pair)."""
    _check("scorer_flops", spec, n=n)
    per = 2 * spec.heads * spec.head_dim + (2 * spec.heads if spec.scorer == "weighted_relu" else 0)
    positions = [n - 1] if decode and n else range(n)
    return per * sum(_scored_entries(spec, p) for p in positions)


class SelectFlops(NamedTuple):
    """Forward FLOPs of one layer: ``scorer`` (selection), ``attention`` (over the selected keys), ``dense``
    (causal attention over every key, for comparison); ``pairs`` the attended pairs."""

    scorer: int
    attention: int
    dense: int
    pairs: int


def select_flops(spec: SelectSpec, n: int, *, num_heads: int, head_dim: int, v_head_dim: int | None = None,
                 decode: bool = False, batch: int = 1) -> SelectFlops:
    """One layer's FLOPs under ``spec`` against dense causal attention: ``2 * H * (Dqk + Dv)`` per attended pair.

    Example:
        >>> f = select_flops(SelectSpec.msa(block=128, topk_blocks=16, local_blocks=1, heads=4, head_dim=128),
        ...                  32768, num_heads=64, head_dim=128)
        >>> f.scorer + f.attention < f.dense
        True
    """
    _check("select_flops", spec, n=n, batch=batch)
    for name, v in (("num_heads", num_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"select_flops: {name} must be an int >= 1, got {v!r}")
    dv = head_dim if v_head_dim is None else v_head_dim
    per_pair = 2 * num_heads * (head_dim + dv)
    pairs = select_pairs(spec, n, decode=decode)
    dense_pairs = (n if decode else n * (n + 1) // 2) if n else 0
    return SelectFlops(batch * scorer_flops(spec, n, decode=decode), batch * per_pair * pairs,
                       batch * per_pair * dense_pairs, batch * pairs)
