"""Sparse attention patterns: Longformer global tokens, Sparse Transformer strided/fixed, BigBird.

- Beltagy et al. 2020, "Longformer": a sliding window plus global tokens that attend to, and are
  attended by, every position. ``global_tokens(idx)`` is the global part; Longformer attention is
  ``sliding_window(w) | global_tokens(idx)``.
- Child et al. 2019, "Generating Long Sequences with Sparse Transformers": the *strided* pattern
  (the previous ``stride`` positions, plus every position a multiple of ``stride`` back) and the
  *fixed* pattern (the current block of ``block`` positions, plus the last ``summary`` positions of
  every block). Both are causal by default, as in the paper's autoregressive models.
- Zaheer et al. 2020, "Big Bird": block-level window, global and random blocks. The random blocks are
  drawn from a seeded ``torch.Generator``: the same seed gives the same mask everywhere.

All are built analytically: their block maps never evaluate every element.

Example:
    >>> from qkv import masks
    >>> print(masks.strided(3).draw(6))
    x.....
    xx....
    xxx...
    xxxx..
    .xxxx.
    ..xxxx
"""

from __future__ import annotations

import torch

from .base import Mask, _tile_bounds, classify, coarse_block_map, tile_grid
from .causal import causal as _causal_mask
from .causal import sliding_window

__all__ = ["global_tokens", "strided", "fixed", "bigbird", "GlobalTokens", "BigBird"]


def _positive_int(v, fn: str, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{fn}: {name} must be > 0, got {v}")
    return v


class GlobalTokens(Mask):
    """Pairs where the query position or the key is one of the global indices."""

    def __init__(self, indices) -> None:
        raw = torch.as_tensor(indices.detach().cpu() if isinstance(indices, torch.Tensor) else indices)
        if raw.dtype.is_floating_point or raw.dtype.is_complex or raw.dtype == torch.bool:
            raise TypeError(f"global_tokens: indices must be integer positions, got dtype {raw.dtype} "
                            f"({raw.flatten()[:4].tolist()}...); pass ints")
        idx = raw.to(torch.int64).flatten()
        if idx.numel() and int(idx.min()) < 0:
            raise ValueError(f"global_tokens: indices must be >= 0, got min {int(idx.min())}")
        self.indices = torch.unique(idx)
        n = int(self.indices.max()) + 1 if idx.numel() else 1
        self.table = torch.zeros(n + 1, dtype=torch.bool)  # last slot: "past the table", never global
        self.table[self.indices] = True

    def _is_global(self, x):
        # Negative positions (query rows before the first key when Nq > Nk) are never global.
        t = self.table.to(x.device)
        return t[x.clamp(0, t.numel() - 1)] & (x >= 0)

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return self._is_global(q_idx + (nk - nq)) | self._is_global(kv_idx)

    def _counts(self, n, block, offset, device):
        lo, hi = _tile_bounds(n, block, device)
        pos = torch.arange(n, device=device) + offset
        cs = torch.nn.functional.pad(self._is_global(pos).to(torch.int64).cumsum(0), (1, 0))
        return cs[hi + 1] - cs[lo], hi - lo + 1

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        gq, sq = self._counts(nq, bq, nk - nq, device)
        gk, sk = self._counts(nk, bk, 0, device)
        full = (gq == sq).view(-1, 1) | (gk == sk).view(1, -1)
        some = (gq > 0).view(-1, 1) | (gk > 0).view(1, -1)
        return classify(full, some)

    def __repr__(self):
        return f"global_tokens({self.indices.tolist()})"


class _Residue(Mask):
    """Pairs whose distance ``p - j`` is a multiple of ``stride`` (the strided head of Child et al.)."""

    def __init__(self, stride: int) -> None:
        self.stride = stride

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return torch.remainder(q_idx + (nk - nq) - kv_idx, self.stride) == 0

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        p_lo, p_hi, k_lo, k_hi = tile_grid(nq, nk, bq, bk, device)
        d_lo, d_hi = p_lo - k_hi, p_hi - k_lo
        some = torch.div(d_hi, self.stride, rounding_mode="floor") * self.stride >= d_lo
        return classify(some & (self.stride == 1), some)

    def __repr__(self):
        return f"residue({self.stride})"


class _SameBlock(Mask):
    """Pairs whose query position and key fall in the same block of ``block`` positions."""

    def __init__(self, block: int) -> None:
        self.block = block

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return torch.div(q_idx + (nk - nq), self.block, rounding_mode="floor") == torch.div(
            kv_idx, self.block, rounding_mode="floor")

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        p_lo, p_hi, k_lo, k_hi = (t // self.block for t in tile_grid(nq, nk, bq, bk, device))
        return classify((p_lo == p_hi) & (k_lo == k_hi) & (p_lo == k_lo), (p_lo <= k_hi) & (k_lo <= p_hi))

    def __repr__(self):
        return f"same_block({self.block})"


class _SummaryColumns(Mask):
    """Keys in the last ``summary`` positions of each block of ``block`` (the fixed pattern's columns)."""

    def __init__(self, block: int, summary: int) -> None:
        self.block, self.summary = block, summary

    def _col(self, kv_idx):
        return torch.remainder(kv_idx, self.block) >= self.block - self.summary

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return self._col(kv_idx) & (q_idx >= 0)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        lo, hi = _tile_bounds(nk, bk, device)
        cs = torch.nn.functional.pad(self._col(torch.arange(nk, device=device)).to(torch.int64).cumsum(0), (1, 0))
        cnt = (cs[hi + 1] - cs[lo]).view(1, -1)
        tq = (nq + bq - 1) // bq
        return classify(cnt == (hi - lo + 1).view(1, -1), cnt > 0).expand(tq, -1)

    def __repr__(self):
        return f"summary_columns({self.block}, {self.summary})"


class BigBird(Mask):
    """Block-level BigBird pattern over positions; see :func:`bigbird`."""

    def __init__(self, block: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int) -> None:
        self.block = _positive_int(block, "bigbird", "block")
        for name, v in (("window_blocks", window_blocks), ("global_blocks", global_blocks),
                        ("random_blocks", random_blocks), ("seed", seed)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"bigbird: {name} must be an int (a count of blocks), got {type(v).__name__} {v!r}")
        if window_blocks < 1 or window_blocks % 2 == 0:
            raise ValueError(f"bigbird: window_blocks must be a positive odd number (centred window), got "
                             f"{window_blocks}")
        if global_blocks < 0 or random_blocks < 0:
            raise ValueError(f"bigbird: global_blocks and random_blocks must be >= 0, got {global_blocks}, "
                             f"{random_blocks}")
        self.window_blocks, self.global_blocks, self.random_blocks = window_blocks, global_blocks, random_blocks
        self.seed = int(seed)
        self._cache: dict[int, torch.Tensor] = {}  # block count -> pattern, the most recent HELD_PATTERNS

    #: Patterns a mask keeps (one per block count, most recently used): a decode loop reuses the current one for
    #: ``block`` steps in every layer, and a long generation does not hold one per length it passed.
    HELD_PATTERNS = 4

    def coarse(self, nk: int) -> torch.Tensor:
        """Block-level boolean pattern (NB, NB) for ``nk`` positions (``NB = ceil(nk / block)``); the last
        :attr:`HELD_PATTERNS` block counts are cached."""
        nb = (nk + self.block - 1) // self.block
        c = self._cache.pop(nb, None)
        if c is None:
            r = torch.arange(nb)
            c = (r.view(-1, 1) - r.view(1, -1)).abs() <= self.window_blocks // 2
            c |= (r.view(-1, 1) < self.global_blocks) | (r.view(1, -1) < self.global_blocks)
            g = torch.Generator().manual_seed(self.seed)
            for qb in range(self.global_blocks, nb):
                free = (~c[qb]).nonzero().flatten()
                if free.numel():
                    pick = free[torch.randperm(free.numel(), generator=g)[: self.random_blocks]]
                    c[qb, pick] = True
            while len(self._cache) >= self.HELD_PATTERNS:
                self._cache.pop(next(iter(self._cache)))  # the least recently used
        self._cache[nb] = c  # most recently used last
        return c

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        # A query row at a negative position (Nq > Nk) is in no block: it sees nothing.
        c = self.coarse(nk).to(kv_idx.device)
        qb = torch.div(q_idx + (nk - nq), self.block, rounding_mode="floor")
        return c[qb.clamp(min=0), torch.div(kv_idx, self.block, rounding_mode="floor")] & (qb >= 0)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        c = self.coarse(nk).to(device).unsqueeze(0)
        return coarse_block_map(c, self.block, self.block, nq, nk, bq, bk, q_offset=nk - nq)[0]

    def __repr__(self):
        return (f"bigbird(block={self.block}, window_blocks={self.window_blocks}, global_blocks="
                f"{self.global_blocks}, random_blocks={self.random_blocks}, seed={self.seed})")


def global_tokens(indices) -> GlobalTokens:
    """Longformer's global attention: positions in ``indices`` see everything and are seen by all."""
    return GlobalTokens(indices)


def strided(stride: int, *, causal: bool = True) -> Mask:
    """Sparse Transformer strided pattern: ``p - j < stride`` or ``(p - j) % stride == 0``."""
    _positive_int(stride, "strided", "stride")
    local = sliding_window(stride - 1, 0 if causal else stride - 1)
    pattern = local | _Residue(stride)
    return pattern & _causal_mask() if causal else pattern


def fixed(block: int, summary: int, *, causal: bool = True) -> Mask:
    """Sparse Transformer fixed pattern: the query's own block, plus the last ``summary`` keys of every block."""
    _positive_int(block, "fixed", "block")
    _positive_int(summary, "fixed", "summary")
    if summary > block:
        raise ValueError(f"fixed: summary ({summary}) must be <= block ({block})")
    pattern = _SameBlock(block) | _SummaryColumns(block, summary)
    return pattern & _causal_mask() if causal else pattern


def bigbird(block: int, window_blocks: int = 3, global_blocks: int = 1, random_blocks: int = 1, *,
            seed: int = 0) -> BigBird:
    """BigBird: each query block sees ``window_blocks`` centred neighbouring blocks, the first
    ``global_blocks`` blocks (which also see everything), and ``random_blocks`` random blocks drawn
    with ``seed``."""
    return BigBird(block, window_blocks, global_blocks, random_blocks, seed)
