"""A mixture of experts beside the dense feed-forward, not instead of it: Gemma 4's 26B-A4B block (Gemma Team 2026,
Gemma 4 model card, google/gemma-4-26B-A4B; HF ``Gemma4TextDecoderLayer`` with ``enable_moe_block``).

The layer's feed-forward branch has two paths, each normed on its way in and out, summed::

    dense  = dense_out_norm(mlp(ffn_norm(x)))                    # ffn_norm: the layer's own pre-norm
    w, e   = route(router(rms(x) * router_scale / sqrt(d)))       # softmax over E, top k, renormalized
    w      = w * per_expert_scale[e]
    moe    = experts_out_norm(sum_k w_k expert_{e_k}(experts_norm(x)))
    branch = dense + moe                                          # then the layer's ffn_out_norm

where ``x`` is the branch's input *before* the layer's pre-norm (the router and the experts read the residual
stream with their own norms). The dense path is a :class:`qkv.nn.GatedMLP` of the layer's width, the experts a
stacked :class:`qkv.nn.moe.Experts` bank, both with the config's activation; the routing is
:func:`qkv.nn.moe.route_softmax` (``topk_method="greedy"``, ``norm_topk_prob``) in float32 (float64 for a float64
model), as HF's router.

Shape legend: B batch, N tokens, T = B * N, d hidden size, E experts, k experts per token.

Example:
    >>> import torch
    >>> from qkv.nn.moe import MoEConfig
    >>> from qkv.nn.parallel_moe import ParallelMoE
    >>> m = MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
    ...               beside_dense=True)
    >>> block = ParallelMoE(16, 32, m, activation="gelu_pytorch_tanh")
    >>> x = torch.randn(2, 3, 16)
    >>> block(x, raw=x).shape
    torch.Size([2, 3, 16])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.moe import MoEConfig
from .ffn import GatedMLP
from .moe import Experts, route_softmax
from .norm import RMSNorm, rms_norm

__all__ = ["ParallelMoE"]


class ParallelMoE(nn.Module):
    """Gemma 4's dense feed-forward plus routed experts (module docstring).

    Args:
        hidden_size: ``d``. intermediate_size: the dense MLP's width. config: a :class:`MoEConfig` with
            ``beside_dense=True``. activation: the gate activation of both paths. eps: the norms' epsilon.

    ``forward(x, raw)``: ``x`` (..., d) the branch input after the layer's pre-norm (the dense path's),
    ``raw`` (..., d) the same before it (the router's and the experts') -> (..., d).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, config: MoEConfig, *, activation: str,
                 eps: float = 1e-6) -> None:
        super().__init__()
        if not config.beside_dense:
            raise ValueError("ParallelMoE: config.beside_dense must be True (the experts run beside a dense MLP); "
                             "for experts that replace the MLP use qkv.nn.MoE")
        self.config, self.eps = config, eps
        d, E = hidden_size, config.n_routed_experts
        self.mlp = GatedMLP(d, intermediate_size, activation=activation)
        self.dense_out_norm = RMSNorm(d, eps=eps)
        self.router = nn.Linear(d, E, bias=False)
        self.router_scale = nn.Parameter(torch.ones(d))
        self.per_expert_scale = nn.Parameter(torch.ones(E))
        self.experts_norm = RMSNorm(d, eps=eps)
        self.experts = Experts(E, d, config.moe_intermediate_size, activation)
        self.experts_out_norm = RMSNorm(d, eps=eps)

    def route(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """raw (T, d) -> (weights (T, k) float32, float64 for a float64 model; expert ids (T, k))."""
        work = torch.float64 if raw.dtype == torch.float64 else torch.float32
        x = rms_norm(raw.to(work), eps=self.eps) * self.router_scale.to(work) * raw.shape[-1] ** -0.5
        weights, idx = route_softmax(F.linear(x, self.router.weight.to(work)), self.config)
        return weights * self.per_expert_scale.to(work)[idx], idx

    def forward(self, x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        if x.shape != raw.shape:
            raise ValueError(f"ParallelMoE: x (after the pre-norm) and raw (before it) must have one shape, got "
                             f"{tuple(x.shape)} and {tuple(raw.shape)}")
        dense = self.dense_out_norm(self.mlp(x))
        flat = raw.reshape(-1, raw.shape[-1])  # (T, d)
        weights, idx = self.route(flat)
        routed = self.experts(self.experts_norm(flat), idx, weights)
        return dense + self.experts_out_norm(routed).view(x.shape)
