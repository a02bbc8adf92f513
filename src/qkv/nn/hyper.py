"""Manifold-constrained hyper-connections (mHC): DeepSeek-V4's residual, ``n`` streams mixed by doubly stochastic
matrices. Xie et al. 2026, "mHC: Manifold-Constrained Hyper-Connections" (after Zhu et al. 2024, "Hyper-Connections",
arXiv:2409.19606), as the DeepSeek-V4 report (DeepSeek-AI 2026, Section 2.2) uses them.

The residual is ``n`` parallel copies of the hidden state, streams ``X`` (B, N, n, d). Before each branch
(attention or feed-forward), a linear map of the RMS-normed, flattened streams gives, per token, three sets of
weights (:func:`hyper_weights`)::

    pre  = sigmoid(s_pre  * W_pre  x + b_pre) + eps          (n,)     the branch input: sum_j pre_j X_j
    post = 2 * sigmoid(s_post * W_post x + b_post)           (n,)     how much of the branch output each stream gets
    comb = Sinkhorn-Knopp(softmax_rows(s_comb * W_comb x + b_comb) + eps)   (n, n)   doubly stochastic

and the branch output ``y`` goes back as ``X'_i = post_i * y + sum_j comb[j, i] X_j``. A doubly stochastic mix
neither grows nor shrinks the streams' total, so deep stacks stay stable. The embedding is widened to ``n`` equal
copies; :class:`HyperHead` collapses the streams before the final norm with its own ``pre`` weights.

:class:`HyperConnection` (one per branch) and :class:`HyperHead` (one per model) follow the decoder's
:class:`qkv.nn.residual.Residual` protocol; ``HyperConnection`` enters and leaves, ``HyperHead`` widens and collapses,
and each refuses the other pair. The weights are computed in float64 for a float64 model and in float32 otherwise
(as DeepSeek-V4 runs them in float32 beside bfloat16 blocks).

Shape legend: B batch, N tokens, n streams, d hidden size.

Example:
    >>> import torch
    >>> from qkv.config.hyper import HyperConfig
    >>> head, branch = HyperHead(8, HyperConfig(hc_mult=4)), HyperConnection(8, HyperConfig(hc_mult=4))
    >>> streams = head.widen(torch.randn(2, 3, 8))
    >>> x, ctx = branch.enter(streams)
    >>> streams = branch.leave(streams, torch.tanh(x), ctx)
    >>> streams.shape, head.collapse(streams).shape
    (torch.Size([2, 3, 4, 8]), torch.Size([2, 3, 8]))
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config.hyper import HyperConfig

__all__ = ["HyperConnection", "HyperHead", "HyperWeights", "hyper_weights", "sinkhorn_knopp", "widen_streams"]


def _work(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _normed_flat(streams: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(B, N, n, d) -> (B, N, n * d) in the work dtype, divided by its root mean square (no weight)."""
    flat = streams.flatten(-2).to(_work(streams.dtype))
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def sinkhorn_knopp(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternately normalize the columns and rows of positive matrices ``m`` (..., n, n) to sum to 1: columns first,
    then ``iters - 1`` rounds of rows and columns (DeepSeek-V4's order), each denominator plus ``eps``.

    Example:
        >>> import torch
        >>> p = sinkhorn_knopp(torch.rand(3, 3) + 0.1, 50, 0.0)
        >>> torch.allclose(p.sum(-1), torch.ones(3)), torch.allclose(p.sum(-2), torch.ones(3))
        (True, True)
    """
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


class HyperWeights(NamedTuple):
    """One branch's mixing weights, per token, in the work dtype: ``pre`` and ``post`` (B, N, n), ``comb``
    (B, N, n, n) (``comb[j, i]``: how much of input stream ``j`` goes to output stream ``i``)."""

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


def hyper_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                  iters: int, eps: float, norm_eps: float) -> HyperWeights:
    """A branch's mHC weights from its input streams (module notes).

    Args:
        streams: (B, N, n, d).
        fn: ((2 + n) * n, n * d), the pre, post and comb rows in that order.
        base: ((2 + n) * n,) their biases. scale: (3,) the pre, post and comb scales.
        iters: Sinkhorn-Knopp iterations. eps: the floor of the pre and comb weights and of each normalization.
        norm_eps: the epsilon of the streams' RMS normalization.

    Returns:
        :class:`HyperWeights`.
    """
    n = streams.shape[-2]
    work = _work(streams.dtype)
    mixes = F.linear(_normed_flat(streams, norm_eps), fn.to(work))  # (B, N, (2 + n) n)
    pre, post, comb = mixes.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.to(work).split([n, n, n * n])
    s_pre, s_post, s_comb = scale.to(work).unbind(0)
    pre = torch.sigmoid(pre * s_pre + b_pre) + eps
    post = 2 * torch.sigmoid(post * s_post + b_post)
    comb = torch.softmax(comb.unflatten(-1, (n, n)) * s_comb + b_comb.view(n, n), dim=-1) + eps
    return HyperWeights(pre, post, sinkhorn_knopp(comb, iters, eps))


def widen_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """The embedding (B, N, d) -> ``n`` equal streams (B, N, n, d)."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def _collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j X_j: (B, N, n, d), (B, N, n) -> (B, N, d) in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams.to(pre.dtype)).sum(-2).to(streams.dtype)


def _check_streams(owner: str, streams: torch.Tensor, n: int, d: int) -> None:
    if not isinstance(streams, torch.Tensor) or streams.dim() != 4 or tuple(streams.shape[-2:]) != (n, d):
        seen = tuple(streams.shape) if isinstance(streams, torch.Tensor) else type(streams).__name__
        raise ValueError(f"{owner}: streams must be (B, N, hc_mult={n}, d={d}) (widen the embedding with "
                         f"HyperHead.widen first), got {seen}")


class HyperConnection(nn.Module):
    """One branch's manifold-constrained hyper-connection: a :class:`qkv.nn.residual.Residual` that enters and leaves.

    Args:
        hidden_size: ``d``. config: the :class:`qkv.config.hyper.HyperConfig`. norm_eps: the streams' RMS
            normalization epsilon (the model's ``rms_norm_eps``).

    Weights (HF names): ``fn`` ((2 + n) n, n d), ``base`` ((2 + n) n,), ``scale`` (3,).
    """

    def __init__(self, hidden_size: int, config: HyperConfig, *, norm_eps: float = 1e-6) -> None:
        super().__init__()
        n = config.hc_mult
        self.hidden_size, self.config, self.norm_eps = hidden_size, config, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size).normal_(std=0.02))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def weights(self, streams: torch.Tensor) -> HyperWeights:
        """:func:`hyper_weights` of ``streams`` (B, N, n, d) with this branch's weights."""
        _check_streams("HyperConnection", streams, self.config.hc_mult, self.hidden_size)
        c = self.config
        return hyper_weights(streams, self.fn, self.base, self.scale, iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                             norm_eps=self.norm_eps)

    def enter(self, streams: torch.Tensor) -> tuple[torch.Tensor, HyperWeights]:
        """streams (B, N, n, d) -> (the branch input sum_j pre_j X_j (B, N, d), the weights)."""
        w = self.weights(streams)
        return _collapse(streams, w.pre), w

    def leave(self, streams: torch.Tensor, y: torch.Tensor, ctx: HyperWeights) -> torch.Tensor:
        """``X'_i = post_i * y + sum_j comb[j, i] X_j`` over ``y``'s tokens (B, N' <= N, d), the last ones of the
        streams -> (B, N', n, d), in the streams' dtype."""
        n = y.shape[1]
        post, comb = ctx.post, ctx.comb
        if n != streams.shape[1]:
            cut = streams.shape[1] - n
            streams, post, comb = streams[:, cut:], post[:, cut:], comb[:, cut:]
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)

    def widen(self, h: torch.Tensor) -> torch.Tensor:
        raise TypeError("HyperConnection is a branch's residual (enter, leave); the model's HyperHead widens")

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        raise TypeError("HyperConnection is a branch's residual (enter, leave); the model's HyperHead collapses")


class HyperHead(nn.Module):
    """The model's side of mHC, a :class:`qkv.nn.residual.Residual` that widens (``n`` equal copies of the embedding)
    and collapses (``sum_j pre_j X_j`` with ``pre = sigmoid(scale * W x + base) + eps``, before the final norm).

    Args: as :class:`HyperConnection`. Weights (HF ``hc_head``'s ``hc_fn``, ``hc_base``, ``hc_scale``): ``fn``
    (n, n d), ``base`` (n,), ``scale`` (1,).
    """

    def __init__(self, hidden_size: int, config: HyperConfig, *, norm_eps: float = 1e-6) -> None:
        super().__init__()
        n = config.hc_mult
        self.hidden_size, self.config, self.norm_eps = hidden_size, config, norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * hidden_size).normal_(std=0.02))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def widen(self, h: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, n, d), ``n`` equal copies."""
        return widen_streams(h, self.config.hc_mult)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """(B, N, n, d) -> (B, N, d)."""
        _check_streams("HyperHead", streams, self.config.hc_mult, self.hidden_size)
        work = _work(streams.dtype)
        mixes = F.linear(_normed_flat(streams, self.norm_eps), self.fn.to(work))
        pre = torch.sigmoid(mixes * self.scale.to(work) + self.base.to(work)) + self.config.hc_eps
        return _collapse(streams, pre)

    def enter(self, streams: torch.Tensor):
        raise TypeError("HyperHead is the model's residual (widen, collapse); each branch enters its HyperConnection")

    def leave(self, streams: torch.Tensor, y: torch.Tensor, ctx) -> torch.Tensor:
        raise TypeError("HyperHead is the model's residual (widen, collapse); each branch leaves its HyperConnection")
