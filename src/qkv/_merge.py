"""Merging partial attention results computed over disjoint key sets.

Attention over keys ``K1 ∪ K2`` equals a weighted mix of attention over each part, with weights from
their log-sum-exps (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the same
identity drives FlashAttention's tiles, split-KV decoding and ring attention):

    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) * out_i

Parts with ``lse = -inf`` (no allowed key) contribute nothing; if every part is empty the result is
zeros with ``lse = -inf``. Every ``lse`` must follow qkv's contract (natural log, :mod:`qkv.lse`); partials
from kernels that keep it in base 2 or token-major convert with ``qkv.lse.from_base2`` /
``from_token_major`` first. The merge itself only needs ``lse.shape == out.shape[:-1]``, in any layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._request import AttentionOutput

__all__ = ["merge_states"]


def merge_states(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> AttentionOutput:
    """Exact attention over the union of disjoint key sets from per-part results.

    Args:
        outs: each (B, H, N, Dv), any float dtype (all alike).
        lses: each (B, H, N), the matching log-sum-exp (from ``return_lse=True``).

    Returns:
        ``AttentionOutput(out, lse)``: out in the dtype of ``outs``; lse float32, float64 when the parts are
        float64. A NaN lse stays NaN (never read as empty); a part with ``lse = -inf`` adds nothing, even when
        its ``out`` holds NaN.

    Example:
        >>> import torch, qkv
        >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
        >>> a = qkv.attention(q, k[:, :, :6], v[:, :, :6], return_lse=True)
        >>> b = qkv.attention(q, k[:, :, 6:], v[:, :, 6:], return_lse=True)
        >>> merged = qkv.merge_states([a.out, b.out], [a.lse, b.lse])
        >>> torch.allclose(merged.out, qkv.attention(q, k, v), atol=1e-5)
        True
    """
    _check_parts(outs, lses)
    acc = torch.float64 if outs[0].dtype == torch.float64 or any(l.dtype == torch.float64 for l in lses) \
        else torch.float32
    lse = torch.stack([l.to(acc) for l in lses])  # (P, B, H, N)
    m = lse.amax(0)  # NaN when a part's lse is NaN: it stays NaN below, never "empty"
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # parts with -inf get weight 0; the max subtraction keeps large lses finite
    total = w.sum(0)
    empty = total == 0
    safe_total = torch.where(empty, torch.ones_like(total), total)
    zero = torch.zeros((), dtype=acc, device=total.device)
    # A part of weight exactly 0 contributes nothing, even when its buffer holds NaN (an untouched split-KV slot).
    out = sum(torch.where(wi == 0, zero, wi * o.to(acc)) for wi, o in zip((w / safe_total).unsqueeze(-1), outs))
    merged_lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(safe_total))
    return AttentionOutput(out.to(outs[0].dtype), merged_lse)


def _check_parts(outs, lses) -> None:
    """Refuse what is not a list of float tensors with matching shapes, saying what was seen and the fix."""
    for name, parts in (("outs", outs), ("lses", lses)):
        if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence):
            seen = (f"a tensor of shape {tuple(parts.shape)}" if isinstance(parts, torch.Tensor)
                    else type(parts).__name__)
            raise TypeError(f"merge_states: {name} must be a list of tensors (one per part), got {seen}; for stacked "
                            f"parts pass list({name}.unbind(0))")
        for i, t in enumerate(parts):
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                seen = f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"merge_states: {name}[{i}] must be a float tensor, got {seen}; pass the out and lse "
                                "of qkv.attention(..., return_lse=True) for each part")
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_states: need the same non-zero number of outs and lses, got {len(outs)} and "
                         f"{len(lses)}")
    for i, (o, l) in enumerate(zip(outs, lses)):
        if o.dim() < 1 or o.shape[:-1] != l.shape:
            raise ValueError(f"merge_states: outs[{i}] has shape {tuple(o.shape)} but lses[{i}] has "
                             f"{tuple(l.shape)}; lse must be out.shape[:-1]")
        if o.shape != outs[0].shape:
            raise ValueError(f"merge_states: outs[{i}] shape {tuple(o.shape)} != outs[0] {tuple(outs[0].shape)}")
        if o.dtype != outs[0].dtype:
            raise TypeError(f"merge_states: outs[{i}] has dtype {o.dtype} but outs[0] has {outs[0].dtype}; cast the "
                            "parts to one dtype")
        if o.device != outs[0].device or l.device != outs[0].device:
            raise ValueError(f"merge_states: part {i} is on {o.device}/{l.device} but outs[0] on {outs[0].device}; "
                             "move every part to one device")
