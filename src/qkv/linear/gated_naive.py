"""Gated linear attention and the gated delta rule, reference forms: what every other form is tested against.

Yang, Wang, Shen, Panda, Kim, "Gated Linear Attention Transformers with Hardware-Efficient Training",
ICML 2024 (arXiv:2312.06635): the gated linear rule with a per-channel gate; Dao and Gu, "Transformers are
SSMs" (Mamba2's state space duality), ICML 2024 (arXiv:2405.21060): the same rule with one decay per head;
Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025
(arXiv:2412.06464): the gated delta rule; Kimi Team, "Kimi Linear: An Expressive, Efficient Attention
Architecture", 2025 (arXiv:2510.26692): the gated delta rule with a per-channel gate (KDA).

For each batch row and value head, with a state ``S`` of shape ``(Dk, Dv)``, a log-decay ``g_t`` (a scalar,
or a vector of size ``Dk`` that scales the rows of ``S``) and a write strength ``beta_t``::

    gated linear:  S_t = exp(g_t) * S_{t-1} + k_t v_t^T                                o_t = S_t^T q_t
    gated delta:   S_t = (I - beta_t k_t k_t^T)(exp(g_t) * S_{t-1}) + beta_t k_t v_t^T   o_t = S_t^T q_t

No normalization or scaling happens inside: the caller applies what its model does (L2-normalised q/k,
``Dk ** -0.5`` on q). ``S_0`` is ``initial_state`` (zeros by default).

The gated linear rule has a quadratic form: with ``G_t = g_1 + ... + g_t`` (per channel or per head),
``o_t = (q_t * exp(G_t))^T S_0 + sum_{s <= t} sum_d q_td k_sd exp(G_td - G_sd) v_s``; every exponent
``G_t - G_s`` with ``s <= t`` is at most 0, so this is computed without overflow as a masked ``(N, N)``
(or ``(N, N, Dk)``) product. The delta rule has no such closed form that is shorter than its recurrence,
so its reference applies the recurrence literally, one ``(Dk, Dk)`` transition matrix per token.

Grouped heads: q and k may have fewer heads (``Hk``) than v (``H = Hk * r``); value head ``h`` reads key
head ``h // r`` (HF's Qwen3-Next ``num_v_heads > num_k_heads``, Mamba2's ``n_groups``). ``g`` and ``beta``
have one entry per value head.

Shape legend: B batch, Hk query/key heads, H value heads, N tokens, Dk key dim, Dv value dim.
"""

from __future__ import annotations

import torch

from qkv.linear._common import LinearAttentionOutput
from qkv.linear._gated import expand_heads, prepare_gated

__all__ = ["gated_linear_parallel", "gated_delta_parallel"]


def gated_linear_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
) -> LinearAttentionOutput:
    """Causal gated linear attention by its masked quadratic form: the reference.

    O(N^2 Dk) time and memory with a per-channel gate, O(N^2) with one per head; any dtype including float64.

    Args:
        q: ``(B, Hk, N, Dk)`` floating.
        k: ``(B, Hk, N, Dk)``, same dtype and device.
        v: ``(B, H, N, Dv)`` with ``H`` a multiple of ``Hk``.
        g: log-decay, ``(B, H, N)`` (one per value head) or ``(B, H, N, Dk)`` (one per key channel); the
            state is multiplied by ``exp(g_t)`` before token ``t`` is written, so ``g <= 0`` forgets.
        initial_state: ``(B, H, Dk, Dv)`` left by earlier tokens, or ``None`` for zeros.

    Returns:
        ``LinearAttentionOutput(out (B, H, N, Dv) in q's dtype, state (B, H, Dk, Dv))``, the state in
        float32 (float64 for float64 inputs).

    Example:
        >>> import torch
        >>> q, k = torch.randn(2, 1, 2, 6, 4, dtype=torch.float64).unbind(0)
        >>> v = torch.randn(1, 4, 6, 3, dtype=torch.float64)
        >>> g = -torch.rand(1, 4, 6, dtype=torch.float64)
        >>> out, state = gated_linear_parallel(q, k, v, g)
        >>> out.shape, state.shape
        (torch.Size([1, 4, 6, 3]), torch.Size([1, 4, 4, 3]))
    """
    p = prepare_gated(q, k, v, g, None, initial_state, fn="gated_linear_parallel", delta=False)
    H, N = p.v.shape[1], p.v.shape[2]
    q, k, v = expand_heads(p.q, H), expand_heads(p.k, H), p.v
    G = p.g.cumsum(2)  # (B, H, N) or (B, H, N, Dk): the log-decay from the start to token t
    causal = torch.ones(N, N, dtype=torch.bool, device=q.device).tril()
    if p.per_channel:
        diff = G.unsqueeze(3) - G.unsqueeze(2)  # (B, H, N, N, Dk): G_t - G_s
        decay = torch.where(causal[..., None], diff, -torch.inf).exp()
        A = torch.einsum("bhtd,bhsd,bhtsd->bhts", q, k, decay)
        q_in = q * G.exp()
    else:
        diff = G.unsqueeze(3) - G.unsqueeze(2)  # (B, H, N, N)
        A = (q @ k.transpose(-1, -2)) * torch.where(causal, diff, -torch.inf).exp()
        q_in = q * G.exp().unsqueeze(-1)
    out = A @ v
    G_end = G[:, :, -1:] if N else G.new_zeros(*G.shape[:2], 1, *G.shape[3:])  # (B, H, 1[, Dk])
    k_to_end = k * ((G_end - G).exp() if p.per_channel else (G_end - G).exp().unsqueeze(-1))
    S = k_to_end.transpose(-1, -2) @ v  # (B, H, Dk, Dv)
    if p.state is not None:
        out = out + q_in @ p.state
        end = G_end.squeeze(2).exp()  # (B, H[, Dk])
        S = S + p.state * (end.unsqueeze(-1) if p.per_channel else end[..., None, None])
    return LinearAttentionOutput(out.to(p.out_dtype), S)


def gated_delta_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
) -> LinearAttentionOutput:
    """The gated delta rule by its recurrence applied literally: the reference.

    Each token multiplies the state by its ``(Dk, Dk)`` transition ``(I - beta_t k_t k_t^T) diag(exp(g_t))``
    and adds ``beta_t k_t v_t^T``. O(N Dk^2 Dv); meant for float64 checks, not for speed.

    Args:
        q: ``(B, Hk, N, Dk)`` floating.
        k: ``(B, Hk, N, Dk)``, same dtype and device.
        v: ``(B, H, N, Dv)`` with ``H`` a multiple of ``Hk``.
        g: log-decay, ``(B, H, N)`` (Gated DeltaNet) or ``(B, H, N, Dk)`` (Kimi Delta Attention).
        beta: ``(B, H, N)`` write strength (usually in ``(0, 1)``).
        initial_state: ``(B, H, Dk, Dv)`` or ``None`` for zeros.

    Returns:
        ``LinearAttentionOutput(out (B, H, N, Dv) in q's dtype, state (B, H, Dk, Dv))``.

    Example:
        >>> import torch
        >>> q, k, v = torch.randn(3, 1, 2, 5, 4, dtype=torch.float64).unbind(0)
        >>> g, beta = -torch.rand(1, 2, 5, dtype=torch.float64), torch.rand(1, 2, 5, dtype=torch.float64)
        >>> out, state = gated_delta_parallel(q, k, v, g, beta)
        >>> out.shape, state.shape
        (torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 4, 4]))
    """
    p = prepare_gated(q, k, v, g, beta, initial_state, fn="gated_delta_parallel", delta=True)
    B, H, N, Dv = p.v.shape
    Dk = p.k.shape[-1]
    q, k = expand_heads(p.q, H), expand_heads(p.k, H)
    S = p.state if p.state is not None else q.new_zeros(B, H, Dk, Dv)
    eye = torch.eye(Dk, dtype=q.dtype, device=q.device)
    outs = []
    for t in range(N):
        k_t, b_t = k[:, :, t], p.beta[:, :, t, None, None]  # (B, H, Dk), (B, H, 1, 1)
        decay = torch.diag_embed(p.g[:, :, t].exp() if p.per_channel else
                                 p.g[:, :, t, None].exp().expand(B, H, Dk))  # (B, H, Dk, Dk)
        transition = (eye - b_t * k_t.unsqueeze(-1) * k_t.unsqueeze(-2)) @ decay
        S = transition @ S + b_t * k_t.unsqueeze(-1) * p.v[:, :, t].unsqueeze(-2)
        outs.append((S.transpose(-1, -2) @ q[:, :, t, :, None]).squeeze(-1))  # (B, H, Dv)
    out = torch.stack(outs, dim=2) if outs else p.v.new_zeros(B, H, 0, Dv)
    return LinearAttentionOutput(out.to(p.out_dtype), S)
