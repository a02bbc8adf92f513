"""Learnable attention sinks: one logit per query head that joins the softmax denominator without a value.

GPT-OSS (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card") learns such a logit per head; StreamingLLM
(Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks") motivates it: a head that
needs to attend "nowhere" can put its mass on the sink. With sink logit ``z[h]``::

    p_ij = exp(s_ij) / (exp(z[h]) + sum_j' exp(s_ij')),   out_i = sum_j p_ij v_j,
    lse_i = log(exp(z[h]) + sum_j exp(s_ij))                (the lse includes the sink)

A row with no allowed key puts all its mass on the sink: ``out = 0``, ``lse = z[h]``.

Backends either take the sink natively (the reference, as one more softmax column; SDPA and Flex, as one
more key whose score is ``z[h]`` and whose value is zero; tiled, by :func:`apply_sinks` on its own
log-sum-exp) or run without it and return their log-sum-exp, which ``qkv.attention`` merges with the sink
by :func:`apply_sinks`, exactly as :func:`qkv.merge_states` merges a part with ``out = 0, lse = z[h]``.
That merge is differentiable, so gradients reach ``z`` through autograd and reach q, k, v through the
backend's own backward of ``out`` and ``lse``.
"""

from __future__ import annotations

import dataclasses

import torch

from ._request import AttentionOutput, Request

__all__ = ["apply_sinks", "without_sinks"]


def without_sinks(req: Request) -> Request:
    """The request a backend without native sinks runs: no sinks, and its log-sum-exp returned."""
    return dataclasses.replace(req, sinks=None, return_lse=True)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> AttentionOutput:
    """Fold per-head sink logits into a result computed without them.

    Args:
        out: (B, Hq, Nq, Dv) attention output over the keys only.
        lse: (B, Hq, Nq) float32 natural-log log-sum-exp over the keys (``-inf`` for empty rows).
        sinks: (Hq,) float sink logits (finite).

    Returns:
        ``AttentionOutput(out * exp(lse - lse'), lse')`` with ``lse' = logaddexp(lse, sinks[h])``; out in
        the dtype of ``out``, lse float32 (float64 for float64 ``lse``).
    """
    acc = torch.float64 if lse.dtype == torch.float64 else torch.float32
    lse = lse.to(acc)
    z = sinks.to(acc).view(1, -1, 1)
    merged = torch.logaddexp(lse, z)  # (B, Hq, Nq)
    empty = torch.isneginf(merged)  # only where the sink itself is -inf
    safe = torch.where(empty, torch.zeros_like(merged), merged)
    w = torch.where(empty, torch.zeros_like(merged), torch.exp(lse - safe))  # mass left on the keys
    res = (out.to(acc) * w.unsqueeze(-1)).to(out.dtype)
    return AttentionOutput(res, merged if acc == torch.float64 else merged.to(torch.float32))
