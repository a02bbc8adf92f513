"""Ring attention, for the ``ring``, ``zigzag`` and ``stripe`` layouts (and the ring dimension of ``usp``).

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context";
Brandon et al. 2023, "Striped Attention: Faster Ring Attention for Causal Transformers" (stripe); zigzag as
in ring-flash-attention and Llama 3. Each rank holds its queries and one chunk of keys/values. For W steps
it attends to the chunk it holds while sending that chunk on to the next rank (the send overlaps the block
computation), and merges the partial results with :func:`qkv.merge_states` in float32 (float64 for float64
inputs). Blocks a mask empties are skipped. Backward passes the chunks around again; the float32 dK/dV
accumulators travel with their chunk and arrive home after a full turn.

Collectives per call: forward W-1 ring shifts (K, V); backward W-1 shifts of K, V and W shifts of dK, dV.
"""

from __future__ import annotations

import torch

from .blocks import accumulation_dtype
from .plan import ForwardState, Plan, attend_owner, grad_owner

__all__ = ["RingAttention"]


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(plan, q, k, v, *mod_tensors) -> (out, lse)`` for this rank's queries."""

    @staticmethod
    def forward(ctx, plan: Plan, q, k, v, *mod_tensors):
        W, r = plan.world, plan.rank
        state = ForwardState(q, v.shape[-1])
        k_cur, v_cur = k, v
        for step in range(W):
            pending = plan.exchange.start_shift([k_cur, v_cur], f"K/V step {step + 1} of {W - 1}") \
                if step < W - 1 else None
            attend_owner(state, plan, (r - step) % W, q, k_cur, v_cur)
            if pending is not None:
                k_cur, v_cur = pending.wait()
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, state.out, state.lse)
        return state.out.to(q.dtype), state.lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan: Plan = ctx.plan
        W, r = plan.world, plan.rank
        acc = accumulation_dtype(q.dtype)
        if dout is None:
            dout = torch.zeros_like(out)
        delta = (dout.to(acc) * out).sum(-1)  # rowsum(dO * O), (B, Hq, n)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        dmod: list = [None] * len(plan.mod_tensors)
        ex = plan.exchange
        if ex is not None:
            ex.phase = "backward"
        k_cur, v_cur = k, v
        for step in range(W):
            pending = ex.start_shift([k_cur, v_cur], f"K/V step {step + 1} of {W - 1}") if step < W - 1 else None
            grad_owner(plan, (r - step) % W, q, k_cur, v_cur, dout, lse, delta, dlse, dq, dk, dv, dmod)
            if pending is not None:
                k_cur, v_cur = pending.wait()
            if W > 1:  # the accumulators follow their chunk; after W shifts they are home
                dk, dv = ex.start_shift([dk, dv], f"dK/dV step {step + 1} of {W}").wait()
        grads_mod = tuple(None if g is None else g.to(t.dtype) for g, t in zip(dmod, plan.mod_tensors))
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *grads_mod
