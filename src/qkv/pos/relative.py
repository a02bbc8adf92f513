"""Relative position schemes as learnable score modifiers.

- T5 bucketed bias: Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
  Text-to-Text Transformer" (the bucketing of Mesh TensorFlow). Relative distance ``j - p`` maps to one
  of ``num_buckets`` buckets (half exact, half log-spaced up to ``max_distance``; bidirectional models
  split the buckets between the two signs), and each (bucket, head) has a learned scalar.
- Clipped relative representations: Shaw et al. 2018, "Self-Attention with Relative Position
  Representations". Learned vectors ``a^K_r``, ``a^V_r`` for ``r = clip(j - p, -k, k)``, shared across
  heads::

      score_ij += scale * q_i . a^K_{clip(j - i)}           (keys)
      out_i    += sum_j P_ij a^V_{clip(j - i)}               (values)

  The key term needs ``q``: :class:`ShawKeyBias` precomputes ``q . a^K`` for the ``2k + 1`` distances,
  a (B, H, Nq, 2k+1) table (O(N k) memory, never (Nq, Nk)), and gathers it by clipped distance inside the
  operator, so every backend that takes additive modifiers honours it. The value term needs the
  attention probabilities; :func:`shaw_attention` obtains them from the same operator call by appending
  an identity block to ``v`` (same masks, modifiers and dropout pattern as the output, differentiable on
  every backend), which costs O(Nq * Nk) memory. (:func:`qkv.attention_probs` recomputes rows for
  inspection without gradients or dropout, so it cannot train ``a^V``.)

Distances follow the operator contract (query row ``i`` at position ``i + Nk - Nq``, key ``j`` at ``j``)
unless explicit ``q_positions`` / ``kv_positions`` are given (KV caches whose slots are not in order).

Shape legend: B batch, H query heads, Nq queries, Nk keys, D head dim, k clipping distance, R = 2k + 1.

Example:
    >>> import torch, qkv
    >>> from qkv.pos import T5RelativeBias
    >>> rel = T5RelativeBias(n_heads=2, num_buckets=8, max_distance=16)
    >>> q = k = v = torch.randn(1, 2, 6, 8)
    >>> qkv.attention(q, k, v, score_mod=rel()).shape
    torch.Size([1, 2, 6, 8])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from .._attention import attention
from ..masks.base import row_index
from ..mods import relative_bias
from ..mods.base import ScoreMod, as_score_mod

__all__ = [
    "PositionalBias", "RelativePositionMod", "t5_bucket", "T5RelativeBias", "shaw_index", "ShawKeyBias",
    "shaw_key_bias", "shaw_attention", "ShawRelativePosition",
]

#: ``term(dist, b, h, q_idx) -> additive score term``; ``dist = kv_position - q_position``.
RelativeTerm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _as_positions(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor of shape (N,) or (B, N), got {x!r}")
    x = x.unsqueeze(0) if x.dim() == 1 else x
    if x.dim() != 2:
        raise ValueError(f"{name}: expected shape (N,) or (B, N), got {tuple(x.shape)}")
    return x.to(torch.int64)


class RelativePositionMod(ScoreMod):
    """An additive term that depends on the relative distance ``j - p`` (and the head, batch and query row).

    Args:
        term: ``term(dist, b, h, q_idx) -> tensor`` on broadcastable index tensors.
        q_positions, kv_positions: optional (B, Nq) / (B, Nk) integer positions (both or neither). Without
            them ``p = q_idx + Nk - Nq`` and ``j = kv_idx``.
        tensors: tensors ``term`` reads (so the operator knows gradients flow to them).
    """

    additive = True

    def __init__(self, term: RelativeTerm, *, q_positions: torch.Tensor | None = None,
                 kv_positions: torch.Tensor | None = None, tensors: tuple[torch.Tensor, ...] = (),
                 name: str = "relative") -> None:
        if (q_positions is None) != (kv_positions is None):
            raise ValueError("relative position modifier: pass both q_positions and kv_positions, or neither")
        self.term, self._tensors, self.name = term, tuple(tensors), name
        self.qp = None if q_positions is None else _as_positions(q_positions, "q_positions")
        self.kp = None if kv_positions is None else _as_positions(kv_positions, "kv_positions")
        rows = set() if self.qp is None else {self.qp.shape[0], self.kp.shape[0]} - {1}
        if len(rows) > 1:
            raise ValueError(f"relative position modifier: q_positions and kv_positions have batch sizes "
                             f"{self.qp.shape[0]} and {self.kp.shape[0]}")
        self.batch = rows.pop() if rows else None

    def check(self, B, H, nq, nk):
        if self.batch is not None and self.batch != B:
            raise ValueError(f"{self.name}: positions carry batch {self.batch} but q has batch {B}")
        if self.qp is not None and (self.qp.shape[1] != nq or self.kp.shape[1] != nk):
            raise ValueError(f"{self.name}: got {self.qp.shape[1]} query and {self.kp.shape[1]} key positions for "
                             f"Nq={nq}, Nk={nk}")

    def distance(self, b, q_idx, kv_idx, nq: int, nk: int) -> torch.Tensor:
        """``kv_position - q_position`` on broadcastable index tensors (int64)."""
        if self.qp is None:
            return kv_idx - (q_idx + (nk - nq))
        qp, kp = self.qp.to(kv_idx.device), self.kp.to(kv_idx.device)
        return kp[row_index(kp, b), kv_idx] - qp[row_index(qp, b), q_idx]

    def bias(self, b, h, q_idx, kv_idx, nq, nk):
        return self.term(self.distance(b, q_idx, kv_idx, nq, nk), b, h, q_idx)

    def tensors(self):
        return self._tensors

    def __repr__(self):
        return self.name


def _mod_list(score_mod) -> list[ScoreMod]:
    m = as_score_mod(score_mod)
    return [] if m is None else [m]


class PositionalBias(nn.Module):
    """A positional module that contributes to attention scores (ALiBi, T5 buckets, Shaw).

    ``forward(q, *, scale=None, q_positions=None, kv_positions=None) -> ScoreMod`` builds this call's
    modifier (``q`` (B, H, Nq, D) is read only by schemes that need it). ``attend`` runs the operator with
    it first and any other modifiers after; a scheme that changes more than the scores (Shaw values)
    overrides ``attend``. :class:`qkv.nn.MultiHeadAttention` calls ``attend``.
    """

    def forward(self, q=None, *, scale=None, q_positions=None, kv_positions=None) -> ScoreMod:
        raise NotImplementedError

    def attend(self, q, k, v, *, scale=None, q_positions=None, kv_positions=None, score_mod=None,
               attention_fn=attention, **attention_kwargs):
        """``attention_fn(q, k, v, score_mod=[self(q, ...), *score_mod], ...)`` (default :func:`qkv.attention`)."""
        own = self(q, scale=_scale(q, scale), q_positions=q_positions, kv_positions=kv_positions)
        return attention_fn(q, k, v, score_mod=[own, *_mod_list(score_mod)], scale=scale, **attention_kwargs)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def t5_bucket(relative_position: torch.Tensor, *, bidirectional: bool = True, num_buckets: int = 32,
              max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of a relative distance ``j - p`` (memory position minus query position).

    Bidirectional: half the buckets for ``j > p``, half for ``j <= p``. Causal: distances ``j > p`` share
    bucket 0 with ``j = p``. Within a side, distances below ``num_buckets // 2`` (of that side) get a bucket
    each, larger ones log-spaced buckets up to ``max_distance``, beyond which they share the last bucket.

    Args:
        relative_position: integer tensor of any shape.

    Returns:
        int64 tensor of the same shape, values in ``[0, num_buckets)``.

    Example:
        >>> import torch
        >>> t5_bucket(torch.tensor([-200, -3, 0, 3, 200]), num_buckets=32, max_distance=128).tolist()
        [15, 3, 0, 19, 31]
    """
    n = num_buckets // 2 if bidirectional else num_buckets
    if n < 2 or max_distance <= n // 2:
        raise ValueError(f"t5_bucket: need num_buckets >= {4 if bidirectional else 2} and max_distance > "
                         f"num_buckets{' // 2' if bidirectional else ''} // 2, got num_buckets={num_buckets}, "
                         f"max_distance={max_distance}")
    rel = relative_position.to(torch.int64)
    if bidirectional:
        offset = (rel > 0).to(torch.int64) * n
        dist = rel.abs()
    else:
        offset = torch.zeros_like(rel)
        dist = (-rel).clamp_min(0)
    exact = n // 2
    # float32 on purpose: the bucket edges then agree with Mesh TensorFlow and HF T5 bit for bit.
    log_ratio = torch.log(dist.clamp_min(1).to(torch.float32) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (n - exact)).to(torch.int64)).clamp_max(n - 1)
    return offset + torch.where(dist < exact, dist, large)


class T5RelativeBias(PositionalBias):
    """T5's learned bucketed relative bias: a (num_buckets, n_heads) table, one scalar per bucket and head.

    One instance is usually shared by every layer of a stack (as in T5). ``weight`` has HF T5's layout
    (``relative_attention_bias.weight``).

    Args:
        n_heads: query heads.
        num_buckets, max_distance: HF ``relative_attention_num_buckets`` / ``relative_attention_max_distance``.
        bidirectional: True for encoders, False for causal decoders.

    Example:
        >>> rel = T5RelativeBias(4, bidirectional=False)
        >>> rel().dense_bias(1, 4, 3, 3).shape
        torch.Size([1, 4, 3, 3])
    """

    def __init__(self, n_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True) -> None:
        super().__init__()
        t5_bucket(torch.zeros(1, dtype=torch.int64), bidirectional=bidirectional, num_buckets=num_buckets,
                  max_distance=max_distance)  # validates the sizes
        self.weight = nn.Parameter(torch.randn(num_buckets, n_heads) * 0.02)
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance
        self.buckets = functools.partial(t5_bucket, bidirectional=bidirectional, num_buckets=num_buckets,
                                         max_distance=max_distance)

    def forward(self, q=None, *, scale=None, q_positions=None, kv_positions=None) -> ScoreMod:
        if q_positions is None and kv_positions is None:
            return relative_bias(self.weight, self.buckets)
        table, buckets = self.weight, self.buckets

        def term(dist, b, h, q_idx):
            return table[buckets(dist), h]

        return RelativePositionMod(term, q_positions=q_positions, kv_positions=kv_positions, tensors=(table,),
                                   name=f"t5_bias(buckets={self.num_buckets}, positions)")

    def extra_repr(self) -> str:
        return (f"n_heads={self.weight.shape[1]}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")


def shaw_index(relative_position: torch.Tensor, max_distance: int) -> torch.Tensor:
    """Row of the Shaw tables for distance ``j - p``: ``clip(j - p, -k, k) + k`` in ``[0, 2k]``."""
    return relative_position.clamp(-max_distance, max_distance) + max_distance


class ShawKeyBias(RelativePositionMod):
    """Shaw et al.'s key term ``scale * q_i . a^K_{clip(j - p)}`` from a precomputed table.

    Args:
        table: (B or 1, H, Nq, 2k+1), ``scale * q @ a^K.T`` (see :func:`shaw_key_bias`).
        max_distance: the clipping distance ``k``.
        q_positions, kv_positions: optional explicit positions (B, Nq) / (B, Nk).
    """

    def __init__(self, table: torch.Tensor, max_distance: int, *, q_positions=None, kv_positions=None) -> None:
        if table.dim() != 4 or table.shape[-1] != 2 * max_distance + 1:
            raise ValueError(f"ShawKeyBias: table must be (B, H, Nq, 2k+1) = (.., .., .., {2 * max_distance + 1}), "
                             f"got {tuple(table.shape)}")
        self.table, self.max_distance = table, max_distance
        super().__init__(self._term, q_positions=q_positions, kv_positions=kv_positions, tensors=(table,),
                         name=f"shaw_keys(k={max_distance})")
        if table.shape[0] > 1:
            if self.batch not in (None, table.shape[0]):
                raise ValueError(f"ShawKeyBias: table batch {table.shape[0]} != positions batch {self.batch}")
            self.batch = table.shape[0]

    def _term(self, dist, b, h, q_idx):
        t = self.table.to(dist.device)
        return t[row_index(t, b), h if t.shape[1] > 1 else torch.zeros_like(h), q_idx,
                 shaw_index(dist, self.max_distance)]

    def check(self, B, H, nq, nk):
        super().check(B, H, nq, nk)
        if self.table.shape[1] not in (1, H) or self.table.shape[2] != nq:
            raise ValueError(f"ShawKeyBias: table {tuple(self.table.shape)} does not fit H={H}, Nq={nq}")


def shaw_key_bias(q: torch.Tensor, rel_k: torch.Tensor, *, max_distance: int, scale: float | None = None,
                  q_positions=None, kv_positions=None) -> ShawKeyBias:
    """The key term of Shaw et al. for queries ``q`` (B, H, Nq, D) and ``rel_k`` (2k+1, D).

    Example:
        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 2, 5, 8); rel_k = torch.randn(5, 8)
        >>> qkv.attention(q, k, v, score_mod=shaw_key_bias(q, rel_k, max_distance=2)).shape
        torch.Size([1, 2, 5, 8])
    """
    if rel_k.dim() != 2 or rel_k.shape != (2 * max_distance + 1, q.shape[-1]):
        raise ValueError(f"shaw_key_bias: rel_k must be (2k+1, D) = ({2 * max_distance + 1}, {q.shape[-1]}), "
                         f"got {tuple(rel_k.shape)}")
    table = _scale(q, scale) * (q @ rel_k.to(q.dtype).transpose(0, 1))  # (B, H, Nq, 2k+1)
    return ShawKeyBias(table, max_distance, q_positions=q_positions, kv_positions=kv_positions)


def _distance_grid(nq: int, nk: int, q_positions, kv_positions, device) -> torch.Tensor:
    """``j - p`` as (B or 1, 1, Nq, Nk) int64."""
    if q_positions is None:
        p = torch.arange(nq, device=device).view(-1, 1) + (nk - nq)
        return (torch.arange(nk, device=device).view(1, -1) - p).view(1, 1, nq, nk)
    qp = _as_positions(q_positions, "q_positions").to(device)
    kp = _as_positions(kv_positions, "kv_positions").to(device)
    return (kp.unsqueeze(1) - qp.unsqueeze(2)).unsqueeze(1)


def shaw_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, max_distance: int,
                   rel_k: torch.Tensor | None = None, rel_v: torch.Tensor | None = None, mask=None,
                   score_mod=None, scale: float | None = None, q_positions=None, kv_positions=None,
                   return_lse: bool = False, dropout_p: float = 0.0, generator=None, backend: str = "auto"):
    """Attention with Shaw et al.'s clipped relative representations on keys and/or values.

    Args:
        q, k, v: as in :func:`qkv.attention`, (B, Hq, Nq, Dqk), (B, Hkv, Nk, Dqk), (B, Hkv, Nk, Dv).
        max_distance: clipping distance ``k``.
        rel_k: (2k+1, Dqk) key representations ``a^K``, or None.
        rel_v: (2k+1, Dv) value representations ``a^V``, or None. Needs the probabilities, so this path
            computes them in the same operator call (an identity block appended to ``v``): O(Nq * Nk)
            memory, and Nk extra output columns of work.
        mask, score_mod, scale, return_lse, dropout_p, generator, backend: as in :func:`qkv.attention`;
            ``score_mod`` terms apply after the Shaw key term.
        q_positions, kv_positions: optional explicit positions (B, Nq) / (B, Nk) for the distances.

    Returns:
        As :func:`qkv.attention`.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(2, 4, 6, 8)
        >>> out = shaw_attention(q, k, v, max_distance=2, rel_k=torch.randn(5, 8), rel_v=torch.randn(5, 8))
        >>> out.shape
        torch.Size([2, 4, 6, 8])
    """
    terms = []
    if rel_k is not None:
        terms.append(shaw_key_bias(q, rel_k, max_distance=max_distance, scale=scale, q_positions=q_positions,
                                   kv_positions=kv_positions))
    terms += _mod_list(score_mod)
    kw = dict(mask=mask, score_mod=terms or None, scale=scale, return_lse=return_lse, dropout_p=dropout_p,
              generator=generator, backend=backend)
    if rel_v is None:
        return attention(q, k, v, **kw)
    B, Hkv, Nk, Dv = v.shape
    Hq, Nq = q.shape[1], q.shape[2]
    if rel_v.shape != (2 * max_distance + 1, Dv):
        raise ValueError(f"shaw_attention: rel_v must be (2k+1, Dv) = ({2 * max_distance + 1}, {Dv}), "
                         f"got {tuple(rel_v.shape)}")
    eye = torch.eye(Nk, dtype=v.dtype, device=v.device).expand(B, Hkv, Nk, Nk)
    res = attention(q, k, torch.cat((v, eye), dim=-1), **kw)
    both = res.out if return_lse else res
    out, probs = both[..., :Dv], both[..., Dv:]  # (B, Hq, Nq, Dv), (B, Hq, Nq, Nk) after masks and dropout
    idx = shaw_index(_distance_grid(Nq, Nk, q_positions, kv_positions, q.device), max_distance)
    per_distance = torch.zeros(B, Hq, Nq, 2 * max_distance + 1, dtype=probs.dtype, device=probs.device)
    per_distance = per_distance.scatter_add(-1, idx.expand(B, Hq, Nq, Nk), probs)  # (B, Hq, Nq, 2k+1)
    out = out + per_distance @ rel_v.to(out.dtype)
    return type(res)(out, res.lse) if return_lse else out


class ShawRelativePosition(PositionalBias):
    """Learned Shaw et al. representations ``a^K`` (2k+1, D) and optionally ``a^V`` (2k+1, Dv).

    Args:
        head_dim: query/key head width ``D``.
        max_distance: clipping distance ``k`` (the paper found ``k >= 2`` enough for translation).
        values: also learn ``a^V`` (O(Nq * Nk) memory, see :func:`shaw_attention`).
        v_head_dim: value head width when it differs from ``head_dim``.

    Example:
        >>> import torch
        >>> shaw = ShawRelativePosition(8, 2, values=True)
        >>> q = k = v = torch.randn(1, 2, 5, 8)
        >>> shaw.attend(q, k, v).shape
        torch.Size([1, 2, 5, 8])
    """

    def __init__(self, head_dim: int, max_distance: int, *, values: bool = False,
                 v_head_dim: int | None = None) -> None:
        super().__init__()
        if not isinstance(max_distance, int) or max_distance < 0:
            raise ValueError(f"ShawRelativePosition: max_distance must be an int >= 0, got {max_distance!r}")
        self.max_distance = max_distance
        self.rel_k = nn.Parameter(torch.randn(2 * max_distance + 1, head_dim) * 0.02)
        self.rel_v = nn.Parameter(torch.randn(2 * max_distance + 1, v_head_dim or head_dim) * 0.02) if values else None

    def forward(self, q=None, *, scale=None, q_positions=None, kv_positions=None) -> ShawKeyBias:
        if q is None:
            raise ValueError("ShawRelativePosition: the key term needs the queries; call it as module(q, ...)")
        return shaw_key_bias(q, self.rel_k, max_distance=self.max_distance, scale=scale, q_positions=q_positions,
                             kv_positions=kv_positions)

    def attend(self, q, k, v, *, scale=None, q_positions=None, kv_positions=None, score_mod=None,
               attention_fn=attention, **attention_kwargs):
        if attention_fn is not attention:
            raise ValueError("ShawRelativePosition: Shaw's relative representations change the values as well as "
                             "the scores, so attention runs through shaw_attention; a replaced attention_fn "
                             "cannot be honoured (use ALiBi, T5 buckets or RoPE with it)")
        return shaw_attention(q, k, v, max_distance=self.max_distance, rel_k=self.rel_k, rel_v=self.rel_v,
                              score_mod=score_mod, scale=scale, q_positions=q_positions, kv_positions=kv_positions,
                              **attention_kwargs)

    def extra_repr(self) -> str:
        return f"head_dim={self.rel_k.shape[1]}, max_distance={self.max_distance}, values={self.rel_v is not None}"
