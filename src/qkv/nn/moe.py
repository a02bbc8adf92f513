"""Mixture-of-experts feed-forwards: DeepSeekMoE (Dai et al. 2024, "DeepSeekMoE: Towards Ultimate Expert
Specialization in Mixture-of-Experts Language Models", arXiv:2401.06066) as DeepSeek-V2 (arXiv:2405.04434)
and DeepSeek-V3 (arXiv:2412.19437) use it, Qwen3-MoE (arXiv:2505.09388) and GPT-OSS (OpenAI 2025,
"gpt-oss-120b & gpt-oss-20b Model Card").

A router (float32) picks ``num_experts_per_tok`` of ``n_routed_experts`` experts per token, their outputs
are summed with the router weights (times ``routed_scaling_factor``), and ``n_shared_experts`` experts
every token goes through are added. The routing rules, one function each:

- :func:`route_softmax`: softmax over all experts, top-k (``greedy``), or top-k inside the ``topk_group``
  best of ``n_group`` groups (``group_limited_greedy``, DeepSeek-V2; ``group_limited_top2``, Mistral 4);
  renormalized when ``norm_topk_prob`` (Qwen3-MoE).
- :func:`route_noaux_tc`: DeepSeek-V3's auxiliary-loss-free balancing: sigmoid scores; experts are *chosen*
  by ``score + e_score_correction_bias`` inside the ``topk_group`` groups whose two best biased scores sum
  highest, and *weighted* by their unbiased scores (renormalized, times ``routed_scaling_factor``).
- :func:`route_topk_softmax`: GPT-OSS: top-k of the (biased) router logits, softmax over those k only.

Experts are stored stacked, as HF transformers 5 keeps them: :class:`Experts` (gated, SwiGLU and
relatives) and :class:`ClampedSwiGLUExperts` (GPT-OSS: biases, clamped inputs, ``(up + 1) * gate *
sigmoid(alpha * gate)``).

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

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config.moe import MoEConfig
from .activations import ACTIVATIONS, GateKernel, check_activation, gated
from .ffn import GatedMLP

__all__ = ["MoEConfig", "Experts", "ClampedSwiGLUExperts", "ExpertsKernel", "MoE", "route_softmax", "route_noaux_tc",
           "route_topk_softmax"]


class ExpertsKernel(Protocol):
    """A faster implementation of a stacked experts module's routed sum, put into its ``experts_kernel`` slot from
    outside (``qkv.cpu.optimize``: one compiled call with the same products and ops in the same order). Each method
    returns None for a call it does not run, and the module runs its loop."""

    def one_token(self, experts: nn.Module, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, *,
                  clamped: bool) -> torch.Tensor | None:
        """x (1, d); idx and weights (1, k) -> (1, d)."""

    def grouped(self, experts: nn.Module, x: torch.Tensor, token: torch.Tensor, w: torch.Tensor, counts: list[int], *,
                clamped: bool) -> torch.Tensor | None:
        """x (T, d); ``token`` and router weights ``w`` (A,) of the assignments grouped by expert, ``counts`` (E,)
        -> (T, d)."""


def route_softmax(logits: torch.Tensor, m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 / Qwen3-MoE / Mistral 4 routing: logits (T, E) float32 -> (weights (T, k), expert ids (T, k)).
    Group-limited methods keep the ``topk_group`` groups whose best score (``group_limited_greedy``) or two best
    scores summed (``group_limited_top2``) are highest."""
    scores = logits.softmax(dim=-1)  # (T, E)
    if m.topk_method in ("group_limited_greedy", "group_limited_top2"):
        T, E = scores.shape
        grouped = scores.view(T, m.n_group, E // m.n_group)
        best = (grouped.amax(dim=-1) if m.topk_method == "group_limited_greedy"
                else grouped.topk(2, dim=-1).values.sum(dim=-1))  # (T, groups)
        keep = torch.zeros_like(best).scatter_(1, best.topk(m.topk_group, dim=-1, sorted=False).indices, 1.0)
        scores = scores.masked_fill(~keep.bool().repeat_interleave(E // m.n_group, dim=1), 0.0)
    weights, idx = scores.topk(m.num_experts_per_tok, dim=-1, sorted=False)
    if m.norm_topk_prob:  # one expert renormalized weighs 1 (Qwen; transformers' DeepSeek-V2 never renormalizes)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * m.routed_scaling_factor, idx


def route_noaux_tc(logits: torch.Tensor, correction: torch.Tensor, m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (arXiv:2412.19437, 2.1.2): logits (T, E) float32, correction (E,) the
    ``e_score_correction_bias`` -> (weights (T, k), expert ids (T, k)). The bias only steers the choice;
    the weights are the unbiased sigmoid scores."""
    scores = logits.sigmoid()  # (T, E)
    T, E = scores.shape
    biased = (scores + correction.to(scores.dtype)).view(T, m.n_group, E // m.n_group)  # (T, groups, E / groups)
    group_score = biased.topk(2, dim=-1).values.sum(dim=-1)  # (T, groups): the two best biased scores
    groups = group_score.topk(m.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
    biased = biased.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    idx = biased.topk(m.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, idx)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * m.routed_scaling_factor, idx


def route_topk_softmax(logits: torch.Tensor, m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS routing: the top-k logits (T, E) -> softmax over those k (weights (T, k), expert ids (T, k))."""
    top, idx = logits.topk(m.num_experts_per_tok, dim=-1)
    return top.softmax(dim=-1) * m.routed_scaling_factor, idx


def check_expert_ids(idx: torch.Tensor, n: int, owner: str) -> None:
    """Raise ``ValueError`` unless every chosen expert id lies in ``[0, n)``: a -1 would otherwise pick the last
    expert on the torch ops (Python indexing) while the compiled kernels refuse it."""
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"{owner}: expert ids must lie in [0, {n}), got ids {int(idx.min())} .. {int(idx.max())}; "
                         f"the router picks among the {n} experts")


class Experts(nn.Module):
    """``E`` gated experts stored stacked, as HF transformers 5 keeps them: ``gate_up_proj`` (E, 2f, d),
    ``down_proj`` (E, d, f). Each expert's products run through ``linear_fn`` (``F.linear``; a
    :class:`qkv.cpu.LinearHost`, which :func:`qkv.cpu.optimize` gives CPU products). ``experts_kernel``
    (:class:`ExpertsKernel`) and ``gate_kernel`` (:data:`qkv.nn.activations.GateKernel`) are None until
    :func:`qkv.cpu.optimize` fills them."""

    def __init__(self, n: int, d: int, f: int, act: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * f, d).normal_(std=0.02))
        self.down_proj = nn.Parameter(torch.empty(n, d, f).normal_(std=0.02))
        self.linear_fn = F.linear
        self.experts_kernel: ExpertsKernel | None = None
        self.gate_kernel: GateKernel | None = None

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, d); idx (T, k) chosen experts; weights (T, k) float32 -> (T, d), the weighted sum."""
        check_expert_ids(idx, self.gate_up_proj.shape[0], "Experts")
        T, k = idx.shape
        if T == 1:  # one token (a one-sequence decode step): its k experts in ascending id, as below
            kernel = self.experts_kernel if self.act is F.silu else None
            fused = None if kernel is None else kernel.one_token(self, x, idx, weights, clamped=False)
            if fused is not None:
                return fused
            out = torch.zeros_like(x)
            for e, j in sorted((e, j) for j, e in enumerate(idx[0].tolist())):
                h = gated(self.linear_fn(x, self.gate_up_proj[e]), self.act, self.gate_kernel)
                out += (self.linear_fn(h, self.down_proj[e]) * weights[:, j:j + 1]).to(out.dtype)
            return out
        flat = idx.reshape(-1)  # (T * k,)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token = order // k
        w = weights.reshape(-1)[order]
        kernel = self.experts_kernel if self.act is F.silu else None
        fused = None if kernel is None else kernel.grouped(self, x, token, w, counts, clamped=False)
        if fused is not None:
            return fused
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t = token[start:start + n]
            h = gated(self.linear_fn(x[t], self.gate_up_proj[e]), self.act, self.gate_kernel)  # (n, f)
            y = self.linear_fn(h, self.down_proj[e]) * w[start:start + n, None]  # float32 weights
            out.index_add_(0, t, y.to(out.dtype))
            start += n
        return out


class ClampedSwiGLUExperts(nn.Module):
    """GPT-OSS experts, stored stacked like :class:`Experts` (output-major; each product runs through
    ``linear_fn``, ``F.linear`` until :func:`qkv.cpu.optimize` gives it CPU products): ``gate_up_proj`` (E, 2f, d)
    gate rows then up rows, ``gate_up_proj_bias`` (E, 2f), ``down_proj`` (E, d, f), ``down_proj_bias`` (E, d).
    Per expert: ``gate = min(g, limit)``, ``up = clamp(u, -limit, limit)``,
    ``h = (up + 1) * gate * sigmoid(alpha * gate)``, ``out = down(h)``. (HF keeps ``gate_up_proj`` input-major
    (E, d, 2f) with gate and up columns interleaved; :mod:`qkv.models.family_gpt_oss` reorders it.)"""

    def __init__(self, n: int, d: int, f: int, *, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * f, d).normal_(std=0.02))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(n, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(n, d, f).normal_(std=0.02))
        self.down_proj_bias = nn.Parameter(torch.zeros(n, d))
        self.linear_fn = F.linear
        self.experts_kernel: ExpertsKernel | None = None  # qkv.cpu.optimize puts its compiled experts here

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fn(x, self.gate_up_proj[e], self.gate_up_proj_bias[e]).chunk(2, dim=-1)  # (n, f)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        h = (up + 1) * gate * torch.sigmoid(gate * self.alpha)  # (n, f)
        return self.linear_fn(h, self.down_proj[e], self.down_proj_bias[e])  # (n, d)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, d); idx (T, k) chosen experts; weights (T, k) float32 -> (T, d), the weighted sum."""
        check_expert_ids(idx, self.gate_up_proj.shape[0], "ClampedSwiGLUExperts")
        T, k = idx.shape
        if T == 1:  # one token (a one-sequence decode step): its k experts in ascending id, as below
            fused = None if self.experts_kernel is None else self.experts_kernel.one_token(self, x, idx, weights,
                                                                                            clamped=True)
            if fused is not None:
                return fused
            out = torch.zeros_like(x)
            for e, j in sorted((e, j) for j, e in enumerate(idx[0].tolist())):
                out += (self._expert(e, x) * weights[:, j:j + 1]).to(out.dtype)
            return out
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token, w = order // k, weights.reshape(-1)[order]
        fused = None if self.experts_kernel is None else self.experts_kernel.grouped(self, x, token, w, counts,
                                                                                      clamped=True)
        if fused is not None:
            return fused
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                t = token[start:start + n]
                out.index_add_(0, t, (self._expert(e, x[t]) * w[start:start + n, None]).to(out.dtype))
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
        self.router = nn.Linear(hidden_size, m.n_routed_experts, bias=m.router_bias)
        if m.swiglu_limit is not None:
            self.experts = ClampedSwiGLUExperts(m.n_routed_experts, hidden_size, m.moe_intermediate_size,
                                                alpha=m.swiglu_alpha, limit=m.swiglu_limit)
        else:
            self.experts = Experts(m.n_routed_experts, hidden_size, m.moe_intermediate_size, activation)
        if m.topk_method == "noaux_tc":  # DeepSeek-V3's balancing bias: steers the choice, not trained by SGD
            self.register_buffer("e_score_correction_bias", torch.zeros(m.n_routed_experts))
        self.shared_experts = (GatedMLP(hidden_size, m.shared_width, activation=activation, bias=bias)
                               if m.n_shared_experts else None)
        # Qwen3-Next: the shared expert's output times sigmoid of a learned scalar per token
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if m.shared_expert_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, d) -> (weights (T, k) float32, float64 for a float64 model, expert ids (T, k)); the router runs in
        float32 for lower precisions, as HF's, and a float64 model stays a float64 reference throughout."""
        m = self.config
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        bias = None if self.router.bias is None else self.router.bias.to(work)
        logits = F.linear(x.to(work), self.router.weight.to(work), bias)  # (T, E)
        if m.topk_method == "noaux_tc":
            return route_noaux_tc(logits, self.e_score_correction_bias, m)
        if m.topk_method == "topk_softmax":
            return route_topk_softmax(logits, m)
        return route_softmax(logits, m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, d)
        weights, idx = self.route(flat)
        out = self.experts(flat, idx, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)
