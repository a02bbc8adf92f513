"""The tensor layouts ``qkv.attention`` reads: ``"bhnd"`` (B, H, N, D), its contract, and ``"bnhd"``
(B, N, H, D), the layout of FlashAttention's API and of HF transformers' projections before their transpose.

A ``"bnhd"`` tensor is read through a ``transpose(1, 2)`` view, never a copy: backends that take strided
inputs (reference, SDPA) use it as is; the tiled backend copies into its padded tiles anyway, so no extra
copy arises there either. The output comes back in the caller's layout (a view of the backend's result);
the log-sum-exp keeps its (B, Hq, Nq) contract in both (see :mod:`qkv.lse` for (B, Nq, Hq)).
"""

from __future__ import annotations

import torch

from ._request import LAYOUT_NAMES

__all__ = ["to_bhnd", "from_bhnd", "layout_hint"]


def _check(layout) -> None:
    if not isinstance(layout, str) or layout not in LAYOUT_NAMES:
        raise ValueError(f"attention: layout must be one of {sorted(LAYOUT_NAMES)} ('bhnd' = (B, H, N, D), "
                         f"'bnhd' = (B, N, H, D)), got {layout!r}")


def to_bhnd(q, k, v, layout: str):
    """q, k, v as (B, H, N, D) views."""
    _check(layout)
    if layout == "bhnd":
        return q, k, v
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"attention: with layout='bnhd', {name} must be a rank-4 (B, N, H, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def from_bhnd(out: torch.Tensor, layout: str) -> torch.Tensor:
    """The (B, H, N, Dv) output in the caller's layout (a view)."""
    return out if layout == "bhnd" else out.transpose(1, 2)


def _fits(q, k, v, h: int, n: int) -> bool:
    """Whether rank-4 q, k, v fit attention with heads at dim ``h`` and length at dim ``n``."""
    return (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[3] == k.shape[3] and k.shape[h] == v.shape[h]
            and k.shape[n] == v.shape[n] and k.shape[h] > 0 and q.shape[h] % k.shape[h] == 0)


def layout_hint(q, k, v, layout: str) -> str:
    """A hint for a shape error: the other layout would have fit."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return ""
    if layout == "bhnd" and _fits(q, k, v, 2, 1):
        return "; these shapes fit (B, N, H, D): if that is their layout, pass layout='bnhd'"
    if layout == "bnhd" and _fits(q, k, v, 1, 2):
        return "; these shapes fit (B, H, N, D): if that is their layout, pass layout='bhnd' (the default)"
    return ""
