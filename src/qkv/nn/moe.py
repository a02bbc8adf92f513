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
- :func:`route_sqrt_softplus`: DeepSeek-V4 (DeepSeek-AI 2026, DeepSeek-V4 report, Section 2.1): scores
  ``sqrt(softplus(logits))``, experts chosen by ``score + e_score_correction_bias`` (no groups), weighted by
  their unbiased scores; :func:`route_hash`: its first layers' hash routing, the experts a fixed table of the
  token id (``tid2eid``), weighted the same way.

Experts are stored stacked, as HF transformers 5 keeps them: :class:`Experts` (gated, SwiGLU and
relatives), :class:`ClampedSwiGLUExperts` (GPT-OSS: biases, clamped inputs, ``(up + 1) * gate *
sigmoid(alpha * gate)``) and :class:`ClampedSiLUExperts` (DeepSeek-V4: ``silu(min(gate, l)) * clamp(up, -l, l)``,
its shared expert :class:`ClampedGatedMLP`).

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

__all__ = ["MoEConfig", "Experts", "ClampedSwiGLUExperts", "ClampedSiLUExperts", "ClampedGatedMLP", "ExpertsKernel",
           "MoE", "clamped_swiglu", "route_softmax", "route_noaux_tc", "route_topk_softmax", "route_sqrt_softplus",
           "route_hash"]


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


def _weigh(scores: torch.Tensor, idx: torch.Tensor, m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    weights = scores.gather(1, idx)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * m.routed_scaling_factor, idx


def route_sqrt_softplus(logits: torch.Tensor, correction: torch.Tensor,
                        m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 routing: logits (T, E), correction (E,) the ``e_score_correction_bias`` -> (weights (T, k),
    expert ids (T, k)). Scores ``sqrt(softplus(logits))``; the top-k of ``score + correction`` are chosen and
    weighted by their unbiased scores (renormalized when ``norm_topk_prob``, times ``routed_scaling_factor``).

    Example:
        >>> import torch
        >>> m = MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        ...               topk_method="sqrtsoftplus", norm_topk_prob=True)
        >>> w, idx = route_sqrt_softplus(torch.tensor([[0.0, 3.0, -1.0, 2.0]]), torch.zeros(4), m)
        >>> sorted(idx[0].tolist()), round(float(w.sum()), 6)
        ([1, 3], 1.0)
    """
    scores = F.softplus(logits).sqrt()  # (T, E)
    idx = (scores + correction.to(scores.dtype)).topk(m.num_experts_per_tok, dim=-1, sorted=False).indices
    return _weigh(scores, idx, m)


def route_hash(logits: torch.Tensor, idx: torch.Tensor, m: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hash routing: logits (T, E) and the experts ``idx`` (T, k) a fixed table gives each token's id
    -> (weights (T, k), ``idx``), the weights their sqrt-softplus scores as :func:`route_sqrt_softplus`'s."""
    return _weigh(F.softplus(logits).sqrt(), idx, m)


def clamped_swiglu(h: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's gate: a fused gate-up projection ``h`` (..., 2f), gate first -> ``silu(min(gate, limit)) *
    clamp(up, -limit, limit)`` (..., f)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


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


class ClampedSiLUExperts(nn.Module):
    """DeepSeek-V4's routed experts, stored stacked like :class:`Experts` (``gate_up_proj`` (E, 2f, d) gate rows
    first, ``down_proj`` (E, d, f)); each expert ``down(clamped_swiglu(gate_up(x), limit))``."""

    def __init__(self, n: int, d: int, f: int, *, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * f, d).normal_(std=0.02))
        self.down_proj = nn.Parameter(torch.empty(n, d, f).normal_(std=0.02))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, d); idx (T, k) chosen experts; weights (T, k) -> (T, d), the weighted sum."""
        check_expert_ids(idx, self.gate_up_proj.shape[0], "ClampedSiLUExperts")
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        token, w = order // k, weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                t = token[start:start + n]
                h = clamped_swiglu(F.linear(x[t], self.gate_up_proj[e]), self.limit)  # (n, f)
                out.index_add_(0, t, (F.linear(h, self.down_proj[e]) * w[start:start + n, None]).to(out.dtype))
                start += n
        return out


class ClampedGatedMLP(nn.Module):
    """DeepSeek-V4's shared expert: ``down(clamped_swiglu(gate_up(x), limit))`` (``gate_up_proj`` d -> 2f, gate rows
    first). ``forward(x)``: (..., d) -> (..., d)."""

    def __init__(self, d_model: int, d_ff: int, *, limit: float, bias: bool = False) -> None:
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Linear(d_model, 2 * d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit))


class MoE(nn.Module):
    """DeepSeekMoE: ``shared_experts(x) + sum_k w_k expert_k(x)`` over the top-k routed experts.

    Args:
        hidden_size: ``d``. config: a :class:`MoEConfig`. activation: the experts' gate activation (a key of
            :data:`qkv.nn.activations.ACTIVATIONS`). bias: biases of the shared experts' projections.
        hash_vocab: the vocabulary size on a hash-routed layer (DeepSeek-V4): the experts of token id ``t`` are
            the buffer ``tid2eid[t]`` (V, k); None: routed by the scores.

    ``forward(x, input_ids=None)``: (..., d) -> (..., d); a hash-routed layer needs ``input_ids`` (...,).
    """

    def __init__(self, hidden_size: int, config: MoEConfig, *, activation: str = "silu", bias: bool = False,
                 hash_vocab: int | None = None) -> None:
        super().__init__()
        check_activation("MoE", activation)
        m = self.config = config
        self.hashed = hash_vocab is not None
        if self.hashed and m.topk_method != "sqrtsoftplus":
            raise ValueError(f"MoE: hash routing (hash_vocab) weighs experts by sqrt-softplus scores; the config's "
                             f"topk_method is {m.topk_method!r}, set 'sqrtsoftplus'")
        self.router = nn.Linear(hidden_size, m.n_routed_experts, bias=m.router_bias)
        if self.hashed:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, m.num_experts_per_tok, dtype=torch.long))
        if m.silu_limit is not None:
            self.experts = ClampedSiLUExperts(m.n_routed_experts, hidden_size, m.moe_intermediate_size,
                                              limit=m.silu_limit)
        elif m.swiglu_limit is not None:
            self.experts = ClampedSwiGLUExperts(m.n_routed_experts, hidden_size, m.moe_intermediate_size,
                                                alpha=m.swiglu_alpha, limit=m.swiglu_limit)
        else:
            self.experts = Experts(m.n_routed_experts, hidden_size, m.moe_intermediate_size, activation)
        if m.topk_method == "noaux_tc" or (m.topk_method == "sqrtsoftplus" and not self.hashed):
            # DeepSeek-V3's balancing bias: steers the choice, not trained by SGD
            self.register_buffer("e_score_correction_bias", torch.zeros(m.n_routed_experts))
        if not m.n_shared_experts:
            self.shared_experts = None
        elif m.silu_limit is not None:
            self.shared_experts = ClampedGatedMLP(hidden_size, m.shared_width, limit=m.silu_limit, bias=bias)
        else:
            self.shared_experts = GatedMLP(hidden_size, m.shared_width, activation=activation, bias=bias)
        # Qwen3-Next: the shared expert's output times sigmoid of a learned scalar per token
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if m.shared_expert_gate else None

    def route(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, d) -> (weights (T, k) float32, float64 for a float64 model, expert ids (T, k)); the router runs in
        float32 for lower precisions, as HF's, and a float64 model stays a float64 reference throughout.
        ``input_ids`` (T,): the tokens of a hash-routed layer."""
        m = self.config
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        bias = None if self.router.bias is None else self.router.bias.to(work)
        logits = F.linear(x.to(work), self.router.weight.to(work), bias)  # (T, E)
        if m.topk_method == "sqrtsoftplus":
            if self.hashed:
                return route_hash(logits, self.tid2eid[input_ids], m)
            return route_sqrt_softplus(logits, self.e_score_correction_bias, m)
        if m.topk_method == "noaux_tc":
            return route_noaux_tc(logits, self.e_score_correction_bias, m)
        if m.topk_method == "topk_softmax":
            return route_topk_softmax(logits, m)
        return route_softmax(logits, m)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, d)
        if self.hashed:
            if not isinstance(input_ids, torch.Tensor) or input_ids.numel() != flat.shape[0]:
                seen = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else input_ids
                raise ValueError(f"MoE: a hash-routed layer needs input_ids, one token id per row of x "
                                 f"{tuple(shape[:-1])}, got {seen!r}")
            input_ids = input_ids.reshape(-1)
            vocab = self.tid2eid.shape[0]
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
                raise ValueError(f"MoE: input_ids must lie in [0, {vocab}) for the hash table tid2eid, got ids "
                                 f"{int(input_ids.min())} .. {int(input_ids.max())}")
        weights, idx = self.route(flat, input_ids)
        out = self.experts(flat, idx, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)
