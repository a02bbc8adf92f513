"""``qkv.sdpa``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention`` that runs on qkv.

Same signature and semantics as torch's, so replacing the call is the whole migration::

    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=False, scale=s, enable_gqa=True)
    out = qkv.sdpa(q, k, v, attn_mask=m, is_causal=False, scale=s, enable_gqa=True)

How torch's arguments map onto :func:`qkv.attention` (``backend="auto"``):

- ``query (..., L, E)``, ``key (..., S, E)``, ``value (..., S, Ev)``; dim -3 is the head dim (2-D inputs get
  one head, 3-D ones are (H, N, D) of one batch row, more than 4 dims fold into the batch). Batch dims must
  match (no broadcasting). Zero-size inputs return an empty (or, with no keys, zero) output, as torch does.
- ``attn_mask`` boolean (True = may attend) becomes a dense ``qkv.masks`` mask; a float mask is additive:
  its finite part becomes a tensor score modifier (``mods.bias``, gradients reach it) and its ``-inf``
  entries become a boolean mask. Either broadcasts to ``(..., L, S)`` as in torch.
- ``is_causal=True`` is torch's top-left alignment, ``masks.causal(align="top_left")``; with an
  ``attn_mask`` it raises, as torch does.
- ``enable_gqa=False`` with fewer key/value heads than query heads raises, as torch does; ``True`` maps to
  qkv's grouped-query attention (query head ``h`` reads kv head ``h // (Hq // Hkv)``).
- ``dropout_p`` drops attention weights with qkv's seeded dropout (same distribution as torch's, a
  different pattern); ``generator`` (keyword) seeds it, else torch's default generator does.

The one difference, on purpose: a query row with no allowed key returns zeros (qkv's contract, and what
torch 2.13's CPU kernels return). Older torch versions and some fused CUDA kernels return NaN there; pass
``empty_rows="nan"`` to get NaN on those rows explicitly.

Example:
    >>> import torch, qkv
    >>> import torch.nn.functional as F
    >>> q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 20, 32), torch.randn(2, 2, 20, 32)
    >>> ours = qkv.sdpa(q, k, v, is_causal=True, enable_gqa=True)
    >>> theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> bool(torch.allclose(ours, theirs, atol=1e-5))
    True
"""

from __future__ import annotations

import math

import torch

from .. import masks as M
from .. import mods
from .._attention import attention

__all__ = ["sdpa", "scaled_dot_product_attention"]

_EMPTY_ROWS = ("zeros", "nan")


def _as4(t: torch.Tensor, name: str) -> torch.Tensor:
    """(..., N, D) -> (B, H, N, D): one head for 2-D/3-D, leading dims folded into B beyond 4-D."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sdpa: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"sdpa: {name} must have at least 2 dims (..., N, D), got shape {tuple(t.shape)}")
    if t.dim() == 2:
        return t.view(1, 1, *t.shape)
    if t.dim() == 3:  # dim -3 holds the heads (enable_gqa groups them), as in torch
        return t.unsqueeze(0)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])  # never -1: a zero-size dim must not be inferred


def _mask4(m: torch.Tensor, lead: tuple[int, ...], L: int, S: int, H: int) -> torch.Tensor:
    """attn_mask broadcast to (..., L, S) -> (B or 1, H or 1, L, S) like the inputs, broadcast dims kept at 1."""
    try:
        target = torch.broadcast_shapes(tuple(m.shape), (*lead, L, S))
    except RuntimeError:
        target = None
    if target != (*lead, L, S):
        raise ValueError(f"sdpa: attn_mask of shape {tuple(m.shape)} does not broadcast to (..., L, S) = "
                         f"{(*lead, L, S)}")
    m = m.reshape((1,) * max(0, 2 - m.dim()) + tuple(m.shape))
    m = m.expand(*m.shape[:-2], L, S)  # a view
    if len(lead) > 2:  # fold the batch dims like the inputs
        return m.expand(*lead, L, S).reshape(-1, H, L, S)
    m = m.reshape((1,) * (len(lead) + 2 - m.dim()) + tuple(m.shape))  # (*lead-or-1, L, S)
    return m.view(1, 1, L, S) if not lead else m.unsqueeze(0) if len(lead) == 1 else m


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
         empty_rows: str = "zeros", generator: torch.Generator | None = None, backend: str = "auto") -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on qkv (see the module docstring).

    Args:
        query: (..., L, E); key: (..., S, E); value: (..., S, Ev). Dim -3 holds the heads.
        attn_mask: bool (True = attend) or float (added to the scores), broadcastable to (..., L, S).
        dropout_p: attention dropout probability.
        is_causal: top-left causal (query ``i`` sees keys ``j <= i``); not with ``attn_mask``.
        scale: multiplier on ``q @ k^T``; default ``E ** -0.5``.
        enable_gqa: allow fewer key/value heads than query heads.
        empty_rows: ``"zeros"`` (default, qkv's contract) or ``"nan"`` (older torch's result) for query rows
            with no allowed key.
        generator: seeds the dropout pattern.
        backend: the :func:`qkv.attention` backend.

    Returns:
        (..., L, Ev) in the query's dtype.
    """
    q4, k4, v4 = _as4(query, "query"), _as4(key, "key"), _as4(value, "value")
    if empty_rows not in _EMPTY_ROWS:
        raise ValueError(f"sdpa: empty_rows must be one of {_EMPTY_ROWS}, got {empty_rows!r}")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"sdpa: query, key and value must have the same number of dims, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    lead = tuple(query.shape[:-2])
    if query.dim() >= 4 and (tuple(key.shape[:-3]) != lead[:-1] or tuple(value.shape[:-3]) != lead[:-1]):
        raise ValueError(f"sdpa: batch dims must match (qkv does not broadcast them): query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}")
    Hq, Hkv = q4.shape[1], k4.shape[1]
    if Hq != Hkv and not enable_gqa:
        raise ValueError(f"sdpa: query {tuple(query.shape)} has {Hq} heads but key {tuple(key.shape)} has {Hkv} "
                         "(dim -3); for grouped-query attention pass enable_gqa=True, as with torch")
    if Hkv and Hq % Hkv:
        raise ValueError(f"sdpa: query heads ({Hq}, dim -3 of {tuple(query.shape)}) must be a multiple of key/value "
                         f"heads ({Hkv}, dim -3 of {tuple(key.shape)}) for grouped-query attention")
    L, S = q4.shape[2], k4.shape[2]
    mask, score_mod = None, None
    if is_causal:
        if attn_mask is not None:
            raise ValueError("sdpa: pass either attn_mask or is_causal=True, not both (as torch requires); fold "
                             "the causal pattern into the mask instead")
        mask = M.causal(align="top_left")
    elif attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"sdpa: attn_mask must be a bool or float tensor, got {type(attn_mask).__name__}")
        m4 = _mask4(attn_mask, lead, L, S, Hq)
        if m4.dtype == torch.bool:
            mask = M.dense(m4)
        elif m4.dtype.is_floating_point:
            hidden = torch.isneginf(m4)
            if bool(hidden.any()):
                mask = M.dense(~hidden)
                m4 = torch.where(hidden, torch.zeros((), dtype=m4.dtype, device=m4.device), m4)
            score_mod = mods.bias(m4)
        else:
            raise TypeError(f"sdpa: attn_mask must be bool (True = attend) or float (additive), got {attn_mask.dtype}")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"sdpa: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"sdpa: scale must be a finite float or None, got {scale!r}")
    if q4.shape[0] * Hq * L == 0 or Hkv == 0:  # nothing to attend with: torch returns an empty (or zero) output
        return query.new_zeros(*lead, L, value.shape[-1])
    out = attention(q4, k4, v4, mask=mask, score_mod=score_mod, scale=scale, dropout_p=float(dropout_p),
                    generator=generator, backend=backend, layout="bhnd")  # (B, Hq, L, Ev)
    if empty_rows == "nan" and mask is not None:
        empty = ~mask.materialize(q4.shape[0], Hq, L, S, device=q4.device).any(-1)  # (B, Hq, L)
        out = out.masked_fill(empty.unsqueeze(-1), float("nan"))
    return out.reshape(*lead, L, value.shape[-1])


#: torch's name for the same function.
scaled_dot_product_attention = sdpa
