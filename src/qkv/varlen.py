"""Packed variable-length batches in FlashAttention's varlen style, on document masks, with no padding computed.

Dao 2023, "FlashAttention-2" (``flash_attn_varlen_func``); sequence packing as in Krell et al. 2021,
"Efficient Sequence Packing without Cross-contamination".

Sequences are concatenated along the token axis: ``q (total_q, Hq, D)``, ``k (total_k, Hkv, D)``,
``v (total_k, Hkv, Dv)``, with ``cu_seqlens_q = [0, n0, n0+n1, ...]`` (and ``cu_seqlens_k``) marking where
each sequence starts. :func:`varlen_attention` runs them as one batch row of ``qkv.attention`` (the
``(total, H, D)`` tensors are read as ``layout="bnhd"`` views, no copy) under the mask of
:func:`varlen_mask`: a ``masks.document`` mask (a query sees only its own sequence's keys) and, per
sequence, a causal mask and/or a window, both bottom-right aligned within the sequence as in
FlashAttention (query ``i`` of a sequence with ``sq`` queries and ``sk`` keys sits at key position
``i + sk - sq``). The tiled and Flex backends skip every tile between two sequences, so the work is that of
the sequences alone.

Padded batches convert with :func:`pack` / :func:`unpack` (FlashAttention's ``unpad_input`` /
``pad_input``, any padding side), and :func:`packed_documents` trains a qkv decoder padding-free: the
packed tokens as one row with per-sequence positions, every attention call restricted to its document.

Shape legend: S sequences, total_q / total_k packed tokens, Hq / Hkv heads, D / Dv head dims.

Example:
    >>> import torch, qkv
    >>> cu = torch.tensor([0, 3, 8])                       # two sequences of 3 and 5 tokens
    >>> q = k = v = torch.randn(8, 2, 16)                   # (total, H, D)
    >>> out = qkv.varlen_attention(q, k, v, cu, cu, causal=True)
    >>> first = qkv.attention(q[None, :3], k[None, :3], v[None, :3], mask=qkv.masks.causal(), layout="bnhd")
    >>> out.shape, bool(torch.allclose(out[:3], first[0], atol=1e-6))
    (torch.Size([8, 2, 16]), True)
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from . import masks as M
from ._attention import attention
from ._request import AttentionOutput
from .masks.base import Mask
from .pos.ids import positions_from_padding

__all__ = ["varlen_attention", "varlen_mask", "Packed", "pack", "unpack", "cu_seqlens_from_lengths",
           "as_cu_seqlens"]


def as_cu_seqlens(cu, name: str = "cu_seqlens") -> torch.Tensor:
    """Check cumulative lengths ``[0, n0, n0+n1, ...]`` (a 1-D integer tensor, starting at 0, non-decreasing) and
    return them as int64; ``name`` is the argument named in the error."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point \
            or cu.dtype == torch.bool:
        raise TypeError(f"varlen: {name} must be a 1-D integer tensor [0, n0, n0+n1, ...], got "
                        f"{type(cu).__name__} {getattr(cu, 'dtype', '')} {tuple(getattr(cu, 'shape', ()))}")
    c = cu.to(torch.int64)
    if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"varlen: {name} must start at 0 and be non-decreasing, got {c.tolist()}")
    return c


def cu_seqlens_from_lengths(lengths) -> torch.Tensor:
    """``[0, n0, n0+n1, ...]`` (int32, FlashAttention's dtype) from sequence lengths (list or 1-D integer tensor).

    Refuses float lengths (never truncated), negative ones, and totals past int32's ``2**31 - 1`` (never wrapped).
    """
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"cu_seqlens_from_lengths: lengths must be integers, got a {lengths.dtype} tensor; "
                            "round them yourself (lengths.round().long()) if that is meant")
        t = lengths.to(torch.int64)
    else:
        try:
            if isinstance(lengths, (str, bytes)) or any(isinstance(n, bool) for n in lengths):
                raise TypeError
            items = [operator.index(n) for n in lengths]  # ints (numpy's too); a float has no exact index
        except TypeError:
            raise TypeError(f"cu_seqlens_from_lengths: lengths must be a list of ints or a 1-D integer tensor, got "
                            f"{lengths!r}") from None
        t = torch.tensor(items, dtype=torch.int64) if items else torch.zeros(0, dtype=torch.int64)
    if t.dim() != 1 or (t.numel() and int(t.min()) < 0):
        raise ValueError(f"cu_seqlens_from_lengths: expected non-negative lengths of shape (S,), got {t.tolist()}")
    total = int(t.sum()) if t.numel() else 0
    if total > torch.iinfo(torch.int32).max:
        raise ValueError(f"cu_seqlens_from_lengths: the lengths sum to {total:,} tokens, past int32's "
                         f"{torch.iinfo(torch.int32).max:,} (FlashAttention's cu_seqlens dtype); split the batch")
    return torch.nn.functional.pad(t.cumsum(0), (1, 0)).to(torch.int32)


def _window(window) -> tuple[int, int]:
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"varlen: window must be (left, right) ints >= -1 (-1 = unbounded, FlashAttention's "
                         f"window_size), got {window!r}")
    return int(window[0]), int(window[1])


def varlen_mask(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, causal: bool = False,
                window: tuple[int, int] = (-1, -1)) -> Mask | None:
    """The mask of packed sequences over (total_q, total_k), for one batch row.

    A query sees the keys of its own sequence; with ``causal`` those at or before its aligned position
    ``p = i + sk - sq`` (local indices); with ``window = (left, right)`` those in ``p - left .. p + right``
    (``-1``: no bound on that side; ``causal`` implies ``right = 0``). Returns None when one sequence with
    neither causal nor window needs no mask.
    """
    cq, ck = as_cu_seqlens(cu_seqlens_q, "cu_seqlens_q"), as_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if cq.numel() != ck.numel():
        raise ValueError(f"varlen: cu_seqlens_q has {cq.numel() - 1} sequences but cu_seqlens_k has "
                         f"{ck.numel() - 1}")
    left, right = _window(window)
    n_seq = cq.numel() - 1
    total_q, total_k = int(cq[-1]), int(ck[-1])
    seq_q = torch.repeat_interleave(torch.arange(n_seq), cq.diff())  # (total_q,)
    seq_k = torch.repeat_interleave(torch.arange(n_seq), ck.diff())  # (total_k,)
    mask = M.document(seq_k, q_ids=seq_q) if n_seq > 1 else None
    if not causal and left < 0 and right < 0:
        return mask
    # Aligned query positions in the packed key coordinates: within sequence s, query p - key j equals the
    # local distance. The offset keeps positions >= 0 (masks.positions treats negative ones as padding).
    off = total_q + 1
    shift = (ck[1:] - cq[1:])[seq_q] if n_seq else torch.zeros(0, dtype=torch.int64)
    p = torch.arange(total_q) + shift + off
    kpos = torch.arange(total_k) + off
    parts = []
    if causal:
        parts.append(M.positions(p, kpos, causal=True))  # j <= p
    elif right >= 0:
        parts.append(M.positions(p + right, kpos, causal=True))  # j <= p + right
    if left >= 0:
        parts.append(M.positions(p, kpos, causal=False, window=left + 1))  # p - j <= left
    for part in parts:
        mask = part if mask is None else mask & part
    return mask


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, *,
                     causal: bool = False, window: tuple[int, int] = (-1, -1), scale: float | None = None,
                     score_mod=None, dropout_p: float = 0.0, generator: torch.Generator | None = None,
                     sinks: torch.Tensor | None = None, return_lse: bool = False, backend: str = "auto"):
    """Attention over packed sequences (FlashAttention's ``flash_attn_varlen_func``), on qkv's backends.

    Args:
        q: (total_q, Hq, D); k: (total_k, Hkv, D); v: (total_k, Hkv, Dv). Same dtype and device.
        cu_seqlens_q, cu_seqlens_k: (S + 1,) integer, ``[0, n0, n0+n1, ..., total]``.
        max_seqlen_q, max_seqlen_k: the longest sequence (FlashAttention needs them to size its grid); checked
            when given, otherwise not needed.
        causal: causal within each sequence, bottom-right aligned when ``sq != sk``::

                sq=2, sk=4:  k0 k1 k2 k3
                        q0:  x  x  x  .
                        q1:  x  x  x  x

        window: (left, right) keys around each query's aligned position, ``-1`` = unbounded
            (FlashAttention's ``window_size``; HF's ``sliding_window = W`` is ``(W - 1, 0)``).
        scale, score_mod, dropout_p, generator, sinks, backend: as in :func:`qkv.attention`; a score
            modifier sees packed indices (batch 0, query and key positions along the packed axis).
        return_lse: also return the log-sum-exp, (Hq, total_q) float32 (float64 for float64 inputs), FlashAttention's
            varlen layout.

    Returns:
        out (total_q, Hq, Dv), or ``AttentionOutput(out, lse)``. A query whose sequence has no allowed key
        returns zeros (``lse = -inf``).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"varlen_attention: {name} must be a packed (total, H, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    cq, ck = as_cu_seqlens(cu_seqlens_q, "cu_seqlens_q"), as_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if int(cq[-1]) != q.shape[0] or int(ck[-1]) != k.shape[0]:
        raise ValueError(f"varlen_attention: cu_seqlens_q ends at {int(cq[-1])} and cu_seqlens_k at {int(ck[-1])}, "
                         f"but q has {q.shape[0]} tokens and k {k.shape[0]}; the last entry is the total")
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cq), ("max_seqlen_k", max_seqlen_k, ck)):
        longest = int(cu.diff().max()) if cu.numel() > 1 else 0
        if given is not None and (not isinstance(given, int) or given < longest):
            raise ValueError(f"varlen_attention: {name}={given!r} but the longest sequence has {longest} tokens")
    mask = varlen_mask(cq, ck, causal=causal, window=window)
    res = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask=mask, score_mod=score_mod, scale=scale,
                    return_lse=return_lse, dropout_p=dropout_p, generator=generator, backend=backend, sinks=sinks,
                    layout="bnhd")  # (1, total_q, Hq, Dv) [and lse (1, Hq, total_q)]
    return AttentionOutput(res.out[0], res.lse[0]) if return_lse else res[0]


class Packed(NamedTuple):
    """A padded batch with its padding removed (:func:`pack`)."""

    values: torch.Tensor  # (total, ...) the real tokens, row by row
    cu_seqlens: torch.Tensor  # (B + 1,) int32
    max_seqlen: int
    indices: torch.Tensor  # (total,) int64 flat indices into the padded (B * N) token grid
    positions: torch.Tensor  # (total,) int64 position of each token within its sequence
    batch_shape: tuple[int, int]  # (B, N) of the padded batch


def pack(x: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """Remove the padding of a batch: ``x (B, N, ...)`` with ``attention_mask (B, N)`` (bool or 0/1, 1 = real
    token, any padding side; each row's real tokens form one sequence) -> :class:`Packed`."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"pack: x must be a (B, N, ...) tensor, got {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"pack: attention_mask must have shape (B, N) = {tuple(x.shape[:2])}, got "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}")
    if attention_mask.dtype != torch.bool:
        if attention_mask.dtype.is_floating_point or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise TypeError(f"pack: attention_mask must be bool or 0/1 integers, got {attention_mask.dtype}")
        attention_mask = attention_mask != 0
    B, N = attention_mask.shape
    valid = attention_mask.to(x.device)
    indices = valid.reshape(-1).nonzero().squeeze(1)  # (total,)
    lengths = valid.sum(1)
    positions = positions_from_padding(valid).reshape(-1)[indices]
    values = x.reshape(B * N, *x.shape[2:])[indices]
    return Packed(values, cu_seqlens_from_lengths(lengths.cpu()).to(x.device), int(lengths.max()) if B else 0,
                  indices, positions, (B, N))


def unpack(values: torch.Tensor, packed: Packed, fill: float = 0.0) -> torch.Tensor:
    """Put packed ``values (total, ...)`` back at their places of the padded batch: (B, N, ...), ``fill`` at
    padding (differentiable)."""
    if not isinstance(packed, Packed):
        raise TypeError(f"unpack: packed must be the Packed that pack() returned, got {type(packed).__name__}")
    if values.shape[0] != packed.indices.numel():
        raise ValueError(f"unpack: values have {values.shape[0]} tokens but the packing holds {packed.indices.numel()}")
    B, N = packed.batch_shape
    out = values.new_full((B * N, *values.shape[1:]), fill)
    out = out.index_copy(0, packed.indices, values)
    return out.view(B, N, *values.shape[1:])
