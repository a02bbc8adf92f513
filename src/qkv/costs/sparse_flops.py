"""Attention FLOPs of sparse patterns and of linear attention: exact (query, key) pair counts and the
matmul FLOPs of the kernelized forms.

Pair counts follow :mod:`qkv.masks` exactly (the tests compare them with ``mask.materialize(...).sum()``):

- sliding window (Beltagy et al. 2020, "Longformer", arXiv:2004.05150; Mistral): query ``p`` sees keys
  ``p - left .. p + right`` inside the sequence;
- Longformer: the window plus ``num_global`` global tokens at positions ``0 .. num_global - 1`` that see
  every key and are seen by every query;
- BigBird (Zaheer et al. 2020, arXiv:2007.14062): blocks of ``block`` positions; a query block sees
  ``window_blocks`` centred blocks, the first ``global_blocks`` blocks (which see everything) and
  ``random_blocks`` blocks drawn among those it does not see yet;
- strided and fixed (Child et al. 2019, "Sparse Transformers", arXiv:1904.10509), causal: the previous
  ``stride`` positions plus every ``stride``-th one before; or the query's block so far plus the last
  ``summary`` positions of each earlier block.

A pair costs ``2 * (Dqk + Dv)`` FLOPs per head (score and weighted value): :func:`pairs_flops`.

Linear attention (Katharopoulos et al. 2020, arXiv:2006.16236) with ``F`` features per head replaces the
``N x N`` products by ``phi(K)^T V`` (``2 N F Dv``), its readout ``phi(Q) S`` (``2 N F Dv``) and the
normalizer ``phi(Q) . z`` (``2 N F``): ``2 N F (2 Dv + 1)`` per head, causal or not (a running state).
Performer (Choromanski et al. 2021, FAVOR+, arXiv:2009.14794) first projects queries and keys on ``m``
random features, ``2 N D m`` each, then is linear attention with ``F = m``. Elementwise feature maps and
exponentials are not counted.

Example:
    >>> window_pairs(8, 2), strided_pairs(6, 3)
    (21, 18)
    >>> pairs_flops(window_pairs(4096, 511), num_heads=8, head_dim=64) < pairs_flops(4096 * 4097 // 2, num_heads=8,
    ...                                                                              head_dim=64)
    True
"""

from __future__ import annotations

__all__ = [
    "bigbird_pairs",
    "fixed_pairs",
    "linear_attention_flops",
    "longformer_pairs",
    "pairs_flops",
    "performer_flops",
    "strided_pairs",
    "window_pairs",
]


def _int(fn: str, name: str, v, *, minimum: int = 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{fn}: {name} must be an int >= {minimum}, got {v!r}")
    return v


def _row_span(n: int, p: int, left: int, right: int) -> tuple[int, int]:
    return max(p - left, 0), min(p + right, n - 1)


def _sum_min(n: int, cap: int) -> int:
    """``sum(min(i + 1, cap) for i in range(n))`` in O(1)."""
    m = min(n, cap)
    return m * (m + 1) // 2 + (n - m) * cap


def window_pairs(n: int, left: int, right: int = 0) -> int:
    """Pairs of ``masks.sliding_window(left, right)`` over a square ``n x n`` score matrix.

    Query ``p`` sees ``min(p, left) + 1 + min(n - 1 - p, right)`` keys.

    Example:
        >>> window_pairs(4, 1), window_pairs(4, 1, 1), window_pairs(4, 10)
        (7, 10, 10)
    """
    _int("window_pairs", "n", n)
    _int("window_pairs", "left", left, minimum=0)
    _int("window_pairs", "right", right, minimum=0)
    # sum_p min(p, left) + n + sum_p min(n-1-p, right): both sums run over 0..n-1
    return (_sum_min(n, left + 1) - n) + n + (_sum_min(n, right + 1) - n)


def longformer_pairs(n: int, left: int, right: int = 0, *, num_global: int = 1) -> int:
    """Pairs of ``masks.sliding_window(left, right) | masks.global_tokens(range(num_global))`` (n x n).

    Example:
        >>> longformer_pairs(6, 1, num_global=1)  # the first row and column are full
        20
    """
    _int("longformer_pairs", "num_global", num_global, minimum=0)
    g = min(num_global, n)
    total = window_pairs(n, left, right)
    if g == 0:
        return total
    for p in range(n):  # O(n): add the global keys (or the whole row) a query's window leaves out
        lo, hi = _row_span(n, p, left, right)
        if p < g:
            total += n - (hi - lo + 1)
        else:
            total += g - max(0, min(hi, g - 1) - lo + 1)
    return total


def bigbird_pairs(n: int, block: int, window_blocks: int = 3, global_blocks: int = 1, random_blocks: int = 1) -> int:
    """Pairs of ``masks.bigbird(block, window_blocks, global_blocks, random_blocks)`` over ``n x n``.

    ``n`` must be a multiple of ``block`` (the random blocks of a partial last block would make the count
    depend on the seed).

    Example:
        >>> bigbird_pairs(64, 8)  # 8 blocks of 8: the global block row sees all 8 blocks, the others 4 or 5
        2624
    """
    fn = "bigbird_pairs"
    _int(fn, "n", n)
    _int(fn, "block", block)
    _int(fn, "window_blocks", window_blocks)
    _int(fn, "global_blocks", global_blocks, minimum=0)
    _int(fn, "random_blocks", random_blocks, minimum=0)
    if n % block:
        raise ValueError(f"{fn}: n ({n}) must be a multiple of block ({block}); pad the sequence")
    if window_blocks % 2 == 0:
        raise ValueError(f"{fn}: window_blocks must be odd (a centred window), got {window_blocks}")
    nb, w = n // block, window_blocks // 2
    blocks = 0
    for qb in range(nb):
        if qb < global_blocks:
            blocks += nb
            continue
        lo, hi = max(qb - w, 0), min(qb + w, nb - 1)
        seen = (hi - lo + 1) + sum(1 for b in range(min(global_blocks, nb)) if b < lo or b > hi)
        blocks += seen + min(random_blocks, nb - seen)
    return blocks * block * block


def strided_pairs(n: int, stride: int) -> int:
    """Pairs of the causal ``masks.strided(stride)`` over ``n x n``: query ``p`` sees
    ``min(p + 1, stride) + p // stride`` keys.

    Example:
        >>> strided_pairs(6, 3)
        18
    """
    _int("strided_pairs", "n", n)
    _int("strided_pairs", "stride", stride)
    multiples = sum(p // stride for p in range(n))
    return _sum_min(n, stride) + multiples


def fixed_pairs(n: int, block: int, summary: int) -> int:
    """Pairs of the causal ``masks.fixed(block, summary)`` over ``n x n``: query ``p`` sees its block up to
    itself plus the last ``summary`` positions of each earlier block.

    Example:
        >>> fixed_pairs(8, 4, 1)
        24
    """
    _int("fixed_pairs", "n", n)
    _int("fixed_pairs", "block", block)
    _int("fixed_pairs", "summary", summary)
    if summary > block:
        raise ValueError(f"fixed_pairs: summary ({summary}) must be <= block ({block})")
    return sum(p % block + 1 + (p // block) * summary for p in range(n))


def pairs_flops(pairs: int, *, num_heads: int = 1, head_dim: int, v_head_dim: int | None = None,
                batch: int = 1) -> int:
    """Forward FLOPs of attention over ``pairs`` allowed (query, key) pairs: ``2 B H pairs (Dqk + Dv)``.

    Example:
        >>> pairs_flops(10, head_dim=4)
        160
    """
    _int("pairs_flops", "pairs", pairs, minimum=0)
    for name, v in (("num_heads", num_heads), ("head_dim", head_dim), ("batch", batch)):
        _int("pairs_flops", name, v)
    return 2 * batch * num_heads * pairs * (head_dim + (v_head_dim or head_dim))


def linear_attention_flops(n: int, *, features: int, num_heads: int = 1, v_head_dim: int, batch: int = 1) -> int:
    """Matmul FLOPs of linear attention with ``features`` feature dimensions: ``2 B H n F (2 Dv + 1)``.

    Example:
        >>> linear_attention_flops(1024, features=64, v_head_dim=64)
        16908288
    """
    for name, v in (("n", n), ("features", features), ("num_heads", num_heads), ("v_head_dim", v_head_dim),
                    ("batch", batch)):
        _int("linear_attention_flops", name, v)
    return 2 * batch * num_heads * n * features * (2 * v_head_dim + 1)


def performer_flops(n: int, *, num_features: int, head_dim: int, num_heads: int = 1, v_head_dim: int | None = None,
                    batch: int = 1) -> int:
    """Performer (FAVOR+): random-feature projections of Q and K (``2 * 2 B H n D m``) plus linear attention
    with ``m = num_features`` features.

    Example:
        >>> performer_flops(1024, num_features=256, head_dim=64) == 4 * 1024 * 64 * 256 + 2 * 1024 * 256 * 129
        True
    """
    _int("performer_flops", "head_dim", head_dim)
    linear = linear_attention_flops(n, features=num_features, num_heads=num_heads, v_head_dim=v_head_dim or head_dim,
                                    batch=batch)
    return linear + 4 * batch * num_heads * n * head_dim * num_features
