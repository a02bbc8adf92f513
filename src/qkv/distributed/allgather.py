"""All-gather context parallelism: every rank gathers the whole K/V once and attends its own queries.

Llama 3 (Dubey et al. 2024, section 3.3.2) trains long context this way: K/V are small next to Q under GQA
(and smaller still for MQA or MLA's latent), so one all-gather is cheaper than W-1 ring steps, and the
zigzag layout keeps causal work even. Backward reduce-scatters the float32 dK/dV back to their owners.

Collectives per call: forward one all-gather (K and V packed); backward one reduce-scatter (dK and dV packed).
"""

from __future__ import annotations

import torch

from .blocks import accumulation_dtype
from .plan import ForwardState, Plan, attend_owner, grad_owner

__all__ = ["AllGatherAttention"]


class AllGatherAttention(torch.autograd.Function):
    """``AllGatherAttention.apply(plan, q, k, v, *mod_tensors) -> (out, lse)``."""

    @staticmethod
    def forward(ctx, plan: Plan, q, k, v, *mod_tensors):
        dqk = k.shape[-1]
        parts = plan.exchange.all_gather(torch.cat([k, v], -1), "K/V")  # W x (B, Hkv, n, Dqk + Dv)
        state = ForwardState(q, v.shape[-1])
        for owner, kv in enumerate(parts):
            attend_owner(state, plan, owner, q, kv[..., :dqk], kv[..., dqk:])
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, torch.stack(parts), state.out, state.lse)
        return state.out.to(q.dtype), state.lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv_all, out, lse = ctx.saved_tensors
        plan: Plan = ctx.plan
        acc = accumulation_dtype(q.dtype)
        if dout is None:
            dout = torch.zeros_like(out)
        plan.exchange.phase = "backward"
        dqk = q.shape[-1]
        delta = (dout.to(acc) * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv_all.shape, dtype=acc, device=q.device)  # (W, B, Hkv, n, Dqk + Dv)
        dmod: list = [None] * len(plan.mod_tensors)
        for owner in range(plan.world):
            kv = kv_all[owner]
            grad_owner(plan, owner, q, kv[..., :dqk], kv[..., dqk:], dout, lse, delta, dlse, dq,
                       dkv[owner][..., :dqk], dkv[owner][..., dqk:], dmod)
        mine = plan.exchange.reduce_scatter(list(dkv.unbind(0)), "dK/dV")
        grads_mod = tuple(None if g is None else g.to(t.dtype) for g, t in zip(dmod, plan.mod_tensors))
        dtype = kv_all.dtype
        return None, dq.to(q.dtype), mine[..., :dqk].to(dtype), mine[..., dqk:].to(dtype), *grads_mod
