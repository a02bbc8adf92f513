"""Causal linear attention as an RNN: a scan over tokens and the single-token decode step.

Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast Autoregressive Transformers with
Linear Attention", ICML 2020 (arXiv:2006.16236), section 3.4 (equations 16-20)::

    S_t = S_{t-1} + phi(k_t) v_t^T                        (B, H, F, Dv)
    z_t = z_{t-1} + phi(k_t)                              (B, H, F)
    out_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)        (B, H, Dv)

The scan is a Python loop over tokens: it is the readable statement of the recurrence and the form
that decoding uses one step at a time, not the fast way to process a prompt (``chunk.py`` is).

Shape legend: B batch, H heads, N tokens, D head dim of q/k, Dv value head dim, F features per head.
"""

from __future__ import annotations

import torch

from qkv.linear._common import DEFAULT_EPS, LinearAttentionOutput, LinearState, prepare
from qkv.linear.feature_maps import FeatureMap, elu_plus_one

__all__ = ["linear_attention_recurrent", "linear_attention_step"]


def _step(fq_BHF: torch.Tensor, fk_BHF: torch.Tensor, v_BHV: torch.Tensor, S_BHFV: torch.Tensor,
          z_BHF: torch.Tensor, *, normalize: bool, eps: float):
    """One token of the recurrence; returns ``(out (B, H, Dv), S, z)`` without modifying inputs."""
    S_BHFV = torch.addcmul(S_BHFV, fk_BHF.unsqueeze(-1), v_BHV.unsqueeze(-2))  # S + phi(k) v^T
    z_BHF = z_BHF + fk_BHF
    num_BHV = (fq_BHF.unsqueeze(-2) @ S_BHFV).squeeze(-2)
    if normalize:
        den_BH = (fq_BHF * z_BHF).sum(-1)
        num_BHV = num_BHV / (den_BH + eps).unsqueeze(-1)
    return num_BHV, S_BHFV, z_BHF


def _zeros_state(fq: torch.Tensor, v: torch.Tensor) -> LinearState:
    B, H, _, F = fq.shape
    return LinearState(fq.new_zeros(B, H, F, v.shape[-1]), fq.new_zeros(B, H, F))


def linear_attention_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str | FeatureMap | None = elu_plus_one,
    normalize: bool = True,
    eps: float = DEFAULT_EPS,
    initial_state: LinearState | None = None,
) -> LinearAttentionOutput:
    """Causal linear attention by a loop over tokens carrying ``(S_t, z_t)``.

    Always causal (the non-causal form has no recurrence: it is one ``phi(Q) (phi(K)^T V)``).
    Matches ``linear_attention_parallel(..., causal=True)``; slow (one step per token).

    Args:
        q: ``(B, H, N, D)`` floating.
        k: ``(B, H, N, D)``, same dtype and device.
        v: ``(B, H, N, Dv)``, same dtype and device.
        feature_map: ``"elu_plus_one"`` (default), ``"relu"``, a callable ``phi(x_BHND) -> x_BHNF``,
            or ``None`` when q and k already are features.
        normalize: divide by ``phi(q_t)^T z_t + eps``.
        eps: absolute guard added to the normalizer (see ``linear_attention_parallel``).
        initial_state: ``LinearState(S (B, H, F, Dv), z (B, H, F))`` or ``None`` for zeros.

    Returns:
        ``LinearAttentionOutput(out (B, H, N, Dv) in the input dtype, state after token N)``.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4).unbind(0)
        >>> out, state = linear_attention_recurrent(q, k, v)
        >>> out.shape, state.S.shape
        (torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 4, 4]))
    """
    fn = "linear_attention_recurrent"
    fq, fk, v_acc, state0 = prepare(q, k, v, feature_map=feature_map, causal=True, initial_state=initial_state,
                                     eps=eps, fn=fn)
    S, z = state0 if state0 is not None else _zeros_state(fq, v_acc)
    outs = []
    for t in range(fq.shape[2]):
        out_t, S, z = _step(fq[:, :, t], fk[:, :, t], v_acc[:, :, t], S, z, normalize=normalize, eps=eps)
        outs.append(out_t)
    if outs:
        out = torch.stack(outs, dim=2)  # (B, H, N, Dv)
    else:
        out = v_acc.new_zeros(v.shape)
    return LinearAttentionOutput(out.to(q.dtype), LinearState(S, z))


def linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: LinearState | None,
    *,
    feature_map: str | FeatureMap | None = elu_plus_one,
    normalize: bool = True,
    eps: float = DEFAULT_EPS,
) -> LinearAttentionOutput:
    """Decode one token: fold ``(k, v)`` into ``state``, then read it with ``q``. O(F Dv), not O(context).

    Args:
        q: ``(B, H, 1, D)`` floating: the new token's query.
        k: ``(B, H, 1, D)``, same dtype and device.
        v: ``(B, H, 1, Dv)``, same dtype and device.
        state: ``LinearState(S (B, H, F, Dv), z (B, H, F))`` after the earlier tokens (from any
            linear-attention function with ``causal=True``), or ``None`` for the first token.
        feature_map: as for ``linear_attention_recurrent``; must match the one that built ``state``.
        normalize: divide by ``phi(q)^T z + eps``.
        eps: absolute guard added to the normalizer.

    Returns:
        ``LinearAttentionOutput(out (B, H, 1, Dv) in the input dtype, state including this token)``.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(3, 1, 2, 6, 4).unbind(0)
        >>> state = linear_attention_recurrent(q[:, :, :5], k[:, :, :5], v[:, :, :5]).state
        >>> out, state = linear_attention_step(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], state)
        >>> torch.allclose(out, linear_attention_recurrent(q, k, v).out[:, :, 5:], atol=1e-6)
        True
    """
    fn = "linear_attention_step"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] != 1:
            raise ValueError(
                f"{fn}: {name} must hold one token (B, H, 1, D), got shape {tuple(t.shape)}; for several "
                f"tokens use linear_attention_chunked(..., causal=True, initial_state=state)"
            )
    fq, fk, v_acc, state0 = prepare(q, k, v, feature_map=feature_map, causal=True, initial_state=state,
                                     eps=eps, fn=fn, state_name="state")
    S, z = state0 if state0 is not None else _zeros_state(fq, v_acc)
    out, S, z = _step(fq[:, :, 0], fk[:, :, 0], v_acc[:, :, 0], S, z, normalize=normalize, eps=eps)
    return LinearAttentionOutput(out.unsqueeze(2).to(q.dtype), LinearState(S, z))
