"""DeepSeekMoE feed-forward: Dai et al. 2024, "DeepSeekMoE: Towards Ultimate Expert Specialization in
Mixture-of-Experts Language Models" (arXiv:2401.06066), as DeepSeek-V2 uses it (arXiv:2405.04434).

A softmax router (float32) picks the top ``num_experts_per_tok`` of ``n_routed_experts`` gated experts per
token (``greedy``, or ``group_limited_greedy`` over groups), their outputs are summed with the router
weights (times ``routed_scaling_factor``), and ``n_shared_experts`` experts every token goes through are
added. Experts are stored stacked, as HF transformers 5 keeps them.

Shape legend: T tokens (B * N), d hidden size, E routed experts, k experts per token, f expert hidden size.

Example:
    >>> import torch
    >>> from qkv.nn.moe import MoE, MoEConfig
    >>> moe = MoE(16, MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
    ...                         n_shared_experts=1))
    >>> moe(torch.randn(2, 3, 16)).shape
    torch.Size([2, 3, 16])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..spec.moe import MoEConfig
from .activations import ACTIVATIONS, check_activation
from .ffn import GatedMLP

__all__ = ["MoEConfig", "Experts", "MoE"]


class Experts(nn.Module):
    """``E`` gated experts stored stacked, as HF transformers 5 keeps them: ``gate_up_proj`` (E, 2f, d),
    ``down_proj`` (E, d, f). Each expert's products run through ``linear_fn`` (``F.linear``; a
    :class:`qkv.cpu.LinearHost`, which :func:`qkv.cpu.optimize` gives CPU products)."""

    def __init__(self, n: int, d: int, f: int, act: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * f, d).normal_(std=0.02))
        self.down_proj = nn.Parameter(torch.empty(n, d, f).normal_(std=0.02))
        self.linear_fn = F.linear

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, d); idx (T, k) chosen experts; weights (T, k) float32 -> (T, d), the weighted sum."""
        T, k = idx.shape
        if T == 1:  # one token (a one-sequence decode step): its k experts in ascending id, as below
            out = torch.zeros_like(x)
            for e, j in sorted((e, j) for j, e in enumerate(idx[0].tolist())):
                gate, up = self.linear_fn(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                out += (self.linear_fn(self.act(gate) * up, self.down_proj[e]) * weights[:, j:j + 1]).to(out.dtype)
            return out
        flat = idx.reshape(-1)  # (T * k,)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token = order // k
        w = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t = token[start:start + n]
            gate, up = self.linear_fn(x[t], self.gate_up_proj[e]).chunk(2, dim=-1)  # (n, f) each
            y = self.linear_fn(self.act(gate) * up, self.down_proj[e]) * w[start:start + n, None]  # float32 weights
            out.index_add_(0, t, y.to(out.dtype))
            start += n
        return out


class MoE(nn.Module):
    """DeepSeekMoE: ``shared_experts(x) + sum_k w_k expert_k(x)`` over the top-k routed experts.

    Args:
        hidden_size: ``d``. config: a :class:`MoEConfig`. activation: the experts' gate activation (a key of
        :data:`qkv.nn.activations.ACTIVATIONS`). bias: biases of the shared experts' projections.

    ``forward(x)``: (..., d) -> (..., d).
    """

    def __init__(self, hidden_size: int, config: MoEConfig, *, activation: str = "silu", bias: bool = False) -> None:
        super().__init__()
        check_activation("MoE", activation)
        m = self.config = config
        self.router = nn.Linear(hidden_size, m.n_routed_experts, bias=False)
        self.experts = Experts(m.n_routed_experts, hidden_size, m.moe_intermediate_size, activation)
        self.shared_experts = (GatedMLP(hidden_size, m.moe_intermediate_size * m.n_shared_experts,
                                        activation=activation, bias=bias) if m.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, d) -> (weights (T, k) float32, expert ids (T, k)); the router runs in float32, as HF's."""
        m = self.config
        scores = F.linear(x.float(), self.router.weight.float()).softmax(dim=-1)  # (T, E)
        if m.topk_method == "group_limited_greedy":
            T, E = scores.shape
            best = scores.view(T, m.n_group, E // m.n_group).amax(dim=-1)  # (T, groups)
            keep = torch.zeros_like(best).scatter_(1, best.topk(m.topk_group, dim=-1, sorted=False).indices, 1.0)
            scores = scores.masked_fill(~keep.bool().repeat_interleave(E // m.n_group, dim=1), 0.0)
        weights, idx = scores.topk(m.num_experts_per_tok, dim=-1, sorted=False)
        if m.norm_topk_prob and m.num_experts_per_tok > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, d)
        weights, idx = self.route(flat)
        out = self.experts(flat, idx, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
