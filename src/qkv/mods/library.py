"""The built-in score modifiers: ALiBi, softcap, relative-position bias, tensor bias, user functions.

- ALiBi: Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases". The score of
  query position ``p`` and key ``j`` gets ``-slope[h] * (p - j)`` (``-slope[h] * |p - j|`` when
  ``bidirectional=True``). Slopes for any head count come from ``qkv.pos.alibi_slopes``.
- Softcap: ``cap * tanh(s / cap)`` (Gemma 2's attention logit soft-capping).
- Relative bias: a learnable table indexed by a bucket of the relative distance ``j - p`` (T5:
  Raffel et al. 2020; Shaw et al. 2018 clipping). The bucketing function comes from ``qkv.pos``.
- Tensor bias: any additive tensor broadcastable to (B, H, Nq, Nk), learnable.

Example:
    >>> import torch, qkv
    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> out = qkv.attention(q, k, v, score_mod=[qkv.mods.alibi(torch.tensor([0.5, 0.25])), qkv.mods.softcap(30.0)])
    >>> out.shape
    torch.Size([1, 2, 4, 8])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .base import ScoreMod

__all__ = ["alibi", "softcap", "relative_bias", "bias", "from_fn", "ALiBi", "Softcap", "RelativeBias", "Bias",
           "FromFn"]


def _head_index(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return h if t.shape[0] > 1 else torch.zeros_like(h)


class ALiBi(ScoreMod):
    additive = True

    def __init__(self, slopes: torch.Tensor, bidirectional: bool = False) -> None:
        if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1 or not slopes.dtype.is_floating_point:
            raise TypeError(f"alibi: slopes must be a 1-D float tensor of shape (H,), got {slopes!r}; "
                            "see qkv.pos.alibi_slopes(H)")
        self.slopes, self.bidirectional = slopes, bidirectional

    def check(self, B, H, nq, nk):
        if self.slopes.shape[0] not in (1, H):
            raise ValueError(f"alibi: {self.slopes.shape[0]} slopes for {H} query heads; pass one slope per head")

    def bias(self, b, h, q_idx, kv_idx, nq, nk):
        s = self.slopes.to(kv_idx.device)
        dist = (q_idx + (nk - nq) - kv_idx).to(s.dtype)
        if self.bidirectional:
            dist = dist.abs()
        return -s[_head_index(s, h)] * dist

    def tensors(self):
        return (self.slopes,)

    def __repr__(self):
        return f"alibi(H={self.slopes.shape[0]}{', bidirectional' if self.bidirectional else ''})"


class Softcap(ScoreMod):
    def __init__(self, cap: float) -> None:
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"softcap: cap must be a finite number > 0, got {cap!r}")
        self.cap = float(cap)

    def apply(self, score, b, h, q_idx, kv_idx, nq, nk):
        return self.cap * torch.tanh(score / self.cap)

    def __repr__(self):
        return f"softcap({self.cap:g})"


class RelativeBias(ScoreMod):
    """``table[bucket(j - p), h]``: ``table`` (num_buckets, H), ``buckets`` maps relative distances
    (a LongTensor of any shape) to bucket ids, or is a precomputed (Nq, Nk) LongTensor."""

    additive = True

    def __init__(self, table: torch.Tensor, buckets) -> None:
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            raise TypeError(f"relative_bias: table must be a (num_buckets, H) tensor, got {table!r}")
        if not (callable(buckets) or (isinstance(buckets, torch.Tensor) and buckets.dim() == 2)):
            raise TypeError("relative_bias: buckets must be a function of the relative distance (j - p) "
                            "returning bucket ids, or a precomputed (Nq, Nk) LongTensor")
        if not table.dtype.is_floating_point:
            raise TypeError(f"relative_bias: table must be a float tensor, got {table.dtype}")
        if isinstance(buckets, torch.Tensor):
            _check_bucket_ids(buckets, table.shape[0], "precomputed buckets")
        self.table, self.buckets = table, buckets
        self._checked: set[tuple[int, int]] = set()  # (nq, nk) whose bucket ids were range-checked

    def check(self, B, H, nq, nk):
        if callable(self.buckets) and (nq, nk) not in self._checked:
            # Every relative distance j - p of an (nq, nk) problem, checked once per size.
            _check_bucket_ids(self.buckets(torch.arange(-(nk - 1), max(nq, 1), device=self.table.device)),
                              self.table.shape[0], "buckets(j - p)")
            self._checked.add((nq, nk))
        if self.table.shape[1] not in (1, H):
            raise ValueError(f"relative_bias: table has {self.table.shape[1]} heads but q has {H}")
        if isinstance(self.buckets, torch.Tensor) and tuple(self.buckets.shape) != (nq, nk):
            raise ValueError(f"relative_bias: precomputed buckets have shape {tuple(self.buckets.shape)}, "
                             f"expected (Nq, Nk) = ({nq}, {nk})")

    def bias(self, b, h, q_idx, kv_idx, nq, nk):
        if isinstance(self.buckets, torch.Tensor):
            idx = self.buckets.to(kv_idx.device)[q_idx, kv_idx]
        else:
            idx = self.buckets(kv_idx - (q_idx + (nk - nq)))
        t = self.table.to(kv_idx.device) if self.table.device != kv_idx.device else self.table
        return t[idx, h if t.shape[1] > 1 else torch.zeros_like(h)]

    def tensors(self):
        return (self.table,)

    def __repr__(self):
        return f"relative_bias(buckets={self.table.shape[0]}, H={self.table.shape[1]})"


def _check_bucket_ids(ids, num_buckets: int, what: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"relative_bias: {what} must be integer bucket ids, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_buckets):
        raise ValueError(f"relative_bias: {what} gives bucket ids in [{int(ids.min())}, {int(ids.max())}] but the "
                         f"table has {num_buckets} rows (0 .. {num_buckets - 1}); negative ids are not counted "
                         "from the end: shift or clamp the buckets")


class Bias(ScoreMod):
    additive = True

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
            is_t = isinstance(tensor, torch.Tensor)
            seen = f"{tensor.dtype} {tuple(tensor.shape)}" if is_t else type(tensor).__name__
            raise TypeError(f"bias: expected a float tensor broadcastable to (B, H, Nq, Nk), got {seen}; "
                            "a boolean tensor is a mask: use qkv.masks.dense")
        if tensor.dim() > 4:
            raise ValueError(f"bias: tensor must have at most 4 dims (B, H, Nq, Nk), got {tuple(tensor.shape)}")
        self.tensor = tensor
        self.t4 = tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))
        self.batch = self.t4.shape[0] if self.t4.shape[0] > 1 else None

    def check(self, B, H, nq, nk):
        try:
            torch.broadcast_shapes(tuple(self.t4.shape), (B, H, nq, nk))
            ok = torch.broadcast_shapes(tuple(self.t4.shape), (B, H, nq, nk)) == (B, H, nq, nk)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"bias: tensor of shape {tuple(self.tensor.shape)} does not broadcast to "
                             f"(B, H, Nq, Nk) = ({B}, {H}, {nq}, {nk})")

    def bias(self, b, h, q_idx, kv_idx, nq, nk):
        t = self.t4 if self.t4.device == kv_idx.device else self.t4.to(kv_idx.device)
        z = torch.zeros_like
        return t[b if t.shape[0] > 1 else z(b), h if t.shape[1] > 1 else z(h),
                 q_idx if t.shape[2] > 1 else z(q_idx), kv_idx if t.shape[3] > 1 else z(kv_idx)]

    def tensors(self):
        return (self.tensor,)

    def __repr__(self):
        return f"bias(shape={tuple(self.tensor.shape)})"


class FromFn(ScoreMod):
    def __init__(self, fn: Callable) -> None:
        if not callable(fn):
            raise TypeError(f"from_fn: expected fn(score, b, h, q_idx, kv_idx) -> score, got {type(fn).__name__}")
        self.fn = fn

    def apply(self, score, b, h, q_idx, kv_idx, nq, nk):
        out = self.fn(score, b, h, q_idx, kv_idx)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"mods.from_fn: fn must return a tensor of scores, got {type(out).__name__}")
        if out.shape != score.shape:
            raise ValueError(f"mods.from_fn: fn returned shape {tuple(out.shape)} for scores of shape "
                             f"{tuple(score.shape)}; it must return one score per input score (e.g. score + term), "
                             "not a reduction or a broadcastable part")
        return out

    def __repr__(self):
        return f"from_fn({getattr(self.fn, '__name__', 'fn')})"


def alibi(slopes: torch.Tensor, *, bidirectional: bool = False) -> ALiBi:
    """ALiBi linear distance penalty with per-head ``slopes`` (H,)."""
    return ALiBi(slopes, bidirectional)


def softcap(cap: float) -> Softcap:
    """Soft-capping ``cap * tanh(score / cap)``."""
    return Softcap(cap)


def relative_bias(table: torch.Tensor, buckets) -> RelativeBias:
    """Learnable bias ``table[bucket(j - p), h]``; ``table`` (num_buckets, H)."""
    return RelativeBias(table, buckets)


def bias(tensor: torch.Tensor) -> Bias:
    """Additive bias broadcastable to (B, H, Nq, Nk); gradients flow to it."""
    return Bias(tensor)


def from_fn(fn: Callable) -> FromFn:
    """A user modifier ``fn(score, b, h, q_idx, kv_idx) -> score`` on raw row/column indices."""
    return FromFn(fn)
