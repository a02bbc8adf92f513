"""Gated linear attention and the gated delta rule as RNNs: a scan over tokens and the decode step.

Yang et al., "Gated Linear Attention Transformers with Hardware-Efficient Training", ICML 2024
(arXiv:2312.06635); Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025 (arXiv:2412.06464);
Kimi Team, "Kimi Linear", 2025 (arXiv:2510.26692). The recurrences (see :mod:`qkv.linear.gated_naive`)::

    gated linear:  S_t = exp(g_t) * S_{t-1} + k_t v_t^T
    gated delta:   S_t = exp(g_t) * S_{t-1} + beta_t k_t (v_t - (exp(g_t) * S_{t-1})^T k_t)^T
    both:          o_t = S_t^T q_t

The delta update is written as a rank-one correction (``v_t`` minus what the decayed state already predicts
for ``k_t``), which costs O(Dk Dv) per token. The scan is the readable statement of the recurrence and the
form that decoding uses one token at a time; ``gated_chunk`` is the fast way to process a prompt.

Shape legend: B batch, Hk query/key heads, H value heads, N tokens, Dk key dim, Dv value dim.
"""

from __future__ import annotations

import torch

from qkv.linear._common import LinearAttentionOutput
from qkv.linear._gated import Prepared, check_one_token, expand_heads, prepare_gated

__all__ = ["gated_linear_recurrent", "gated_linear_step", "gated_delta_recurrent", "gated_delta_step"]


def _scan(p: Prepared, *, delta: bool) -> LinearAttentionOutput:
    B, H, N, Dv = p.v.shape
    Dk = p.k.shape[-1]
    q, k = expand_heads(p.q, H), expand_heads(p.k, H)
    decay = p.g.exp()
    decay = decay.unsqueeze(-1) if p.per_channel else decay[..., None, None]  # (B, H, N, Dk|1, 1)
    S = p.state if p.state is not None else q.new_zeros(B, H, Dk, Dv)
    outs = []
    for t in range(N):
        S = S * decay[:, :, t]
        k_t = k[:, :, t].unsqueeze(-1)  # (B, H, Dk, 1)
        if delta:
            pred = (S * k_t).sum(-2)  # (B, H, Dv): what the decayed state reads at k_t
            write = (p.v[:, :, t] - pred) * p.beta[:, :, t, None]
        else:
            write = p.v[:, :, t]
        S = S + k_t * write.unsqueeze(-2)
        outs.append((S * q[:, :, t].unsqueeze(-1)).sum(-2))  # (B, H, Dv)
    out = torch.stack(outs, dim=2) if outs else p.v.new_zeros(B, H, 0, Dv)
    return LinearAttentionOutput(out.to(p.out_dtype), S)


def gated_linear_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                           initial_state: torch.Tensor | None = None) -> LinearAttentionOutput:
    """Gated linear attention by a loop over tokens carrying ``S_t``; slow (one step per token).

    Args:
        q: ``(B, Hk, N, Dk)`` floating.
        k: ``(B, Hk, N, Dk)``, same dtype and device.
        v: ``(B, H, N, Dv)`` with ``H`` a multiple of ``Hk``.
        g: log-decay ``(B, H, N)`` or ``(B, H, N, Dk)``.
        initial_state: ``(B, H, Dk, Dv)`` or ``None`` for zeros.

    Returns:
        ``LinearAttentionOutput(out (B, H, N, Dv) in q's dtype, state (B, H, Dk, Dv))``.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
        >>> out, state = gated_linear_recurrent(q, k, v, -torch.rand(1, 2, 5))
        >>> out.shape, state.shape
        (torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 4, 4]))
    """
    p = prepare_gated(q, k, v, g, None, initial_state, fn="gated_linear_recurrent", delta=False)
    return _scan(p, delta=False)


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          *, initial_state: torch.Tensor | None = None) -> LinearAttentionOutput:
    """The gated delta rule by a loop over tokens carrying ``S_t``; slow (one step per token).

    Args:
        q: ``(B, Hk, N, Dk)`` floating.
        k: ``(B, Hk, N, Dk)``, same dtype and device.
        v: ``(B, H, N, Dv)`` with ``H`` a multiple of ``Hk``.
        g: log-decay ``(B, H, N)`` or ``(B, H, N, Dk)``.
        beta: ``(B, H, N)`` write strength.
        initial_state: ``(B, H, Dk, Dv)`` or ``None`` for zeros.

    Returns:
        ``LinearAttentionOutput(out (B, H, N, Dv) in q's dtype, state (B, H, Dk, Dv))``.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
        >>> out, state = gated_delta_recurrent(q, k, v, -torch.rand(1, 2, 5), torch.rand(1, 2, 5))
        >>> out.shape
        torch.Size([1, 2, 5, 4])
    """
    p = prepare_gated(q, k, v, g, beta, initial_state, fn="gated_delta_recurrent", delta=True)
    return _scan(p, delta=True)


def gated_linear_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      state: torch.Tensor | None) -> LinearAttentionOutput:
    """Decode one token of gated linear attention: O(Dk Dv) per head, whatever the context length.

    Args:
        q: ``(B, Hk, 1, Dk)``; k: ``(B, Hk, 1, Dk)``; v: ``(B, H, 1, Dv)``.
        g: ``(B, H, 1)`` or ``(B, H, 1, Dk)``.
        state: ``(B, H, Dk, Dv)`` from any form of this rule, or ``None`` for the first token.

    Returns:
        ``LinearAttentionOutput(out (B, H, 1, Dv), state including this token)``.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(3, 1, 2, 6, 4).unbind(0)
        >>> g = -torch.rand(1, 2, 6)
        >>> state = gated_linear_recurrent(q[:, :, :5], k[:, :, :5], v[:, :, :5], g[:, :, :5]).state
        >>> out, state = gated_linear_step(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], g[:, :, 5:], state)
        >>> torch.allclose(out, gated_linear_recurrent(q, k, v, g).out[:, :, 5:], atol=1e-5)
        True
    """
    fn = "gated_linear_step"
    check_one_token(fn, {"q": q, "k": k, "v": v, "g": g}, whole="gated_linear_chunked")
    p = prepare_gated(q, k, v, g, None, state, fn=fn, state_name="state", delta=False)
    return _scan(p, delta=False)


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None) -> LinearAttentionOutput:
    """Decode one token of the gated delta rule: O(Dk Dv) per head, whatever the context length.

    Args:
        q: ``(B, Hk, 1, Dk)``; k: ``(B, Hk, 1, Dk)``; v: ``(B, H, 1, Dv)``.
        g: ``(B, H, 1)`` or ``(B, H, 1, Dk)``; beta: ``(B, H, 1)``.
        state: ``(B, H, Dk, Dv)`` from any form of this rule, or ``None`` for the first token.

    Returns:
        ``LinearAttentionOutput(out (B, H, 1, Dv), state including this token)``.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(3, 1, 2, 1, 4).unbind(0)
        >>> out, state = gated_delta_step(q, k, v, -torch.rand(1, 2, 1), torch.rand(1, 2, 1), None)
        >>> out.shape, state.shape
        (torch.Size([1, 2, 1, 4]), torch.Size([1, 2, 4, 4]))
    """
    fn = "gated_delta_step"
    check_one_token(fn, {"q": q, "k": k, "v": v, "g": g, "beta": beta}, whole="gated_delta_chunked")
    p = prepare_gated(q, k, v, g, beta, state, fn=fn, state_name="state", delta=True)
    return _scan(p, delta=True)
