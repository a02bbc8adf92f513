"""Ring attention: exact attention over a sequence sharded across processes.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context".
Each of the P ranks holds one contiguous chunk of the queries and of the keys/values. Key/value chunks
travel around the ring; at each of the P steps a rank attends its queries to the chunk it holds and
folds the partial result in with :func:`qkv.merge_states` (the log-sum-exp merge), so the result is
exactly single-device attention. The backward pass sends the key/value chunks around again together
with their gradient accumulators, which arrive back at their owner after a full turn.

Masks are by global position (``causal`` and a sliding ``window``), so chunk pairs that a causal mask
empties (keys entirely after the queries) are skipped, not computed. Communication uses
``torch.distributed`` point-to-point ops, so it runs on any backend (gloo on CPU, NCCL on GPUs).

Shape legend: B batch, Hq/Hkv heads, n local chunk length, D head dim; global length N = P * n.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import masks
from ._attention import attention
from ._merge import merge_states

__all__ = ["ring_attention"]


def _ring_pass(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send each tensor to the next rank and receive the previous rank's."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    received = [torch.empty_like(t) for t in tensors]
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    ops = []
    for t, r in zip(tensors, received):
        ops.append(dist.P2POp(dist.isend, t.contiguous(), nxt, group))
        ops.append(dist.P2POp(dist.irecv, r, prv, group))
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


def _chunk_mask(q_start: int, k_start: int, nq: int, nk: int, causal: bool, window: int | None):
    """The mask between a query chunk and a key chunk by global position, or "skip" if empty."""
    if causal and k_start > q_start + nq - 1:
        return "skip"
    if window is not None and q_start - (k_start + nk - 1) >= window:
        return "skip"
    if not causal and window is None:
        return None
    qp = torch.arange(q_start, q_start + nq)
    kp = torch.arange(k_start, k_start + nk)
    return masks.positions(qp, kp, causal=causal, window=window)


def _pair_backward(q, k, v, do, lse, delta, mask, scale):
    """Gradients of one (query chunk, key chunk) pair from the saved global lse (FlashAttention-2)."""
    group = q.shape[1] // k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kx, vx = k.to(acc).repeat_interleave(group, 1), v.to(acc).repeat_interleave(group, 1)
    s = scale * (q.to(acc) @ kx.transpose(-1, -2))
    if mask is not None:
        b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)
        h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
        qi = torch.arange(q.shape[2]).view(1, 1, -1, 1)
        kj = torch.arange(k.shape[2]).view(1, 1, 1, -1)
        s = s.masked_fill(~mask.allowed(b, h, qi, kj, q.shape[2], k.shape[2]), float("-inf"))
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(acc).unsqueeze(-1)
    p = torch.exp(s - lse_safe)  # masked entries: exp(-inf) = 0
    dv = (p.transpose(-1, -2) @ do.to(acc))
    dp = do.to(acc) @ vx.transpose(-1, -2)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = scale * (ds @ kx)
    dk = scale * (ds.transpose(-1, -2) @ q.to(acc))
    fold = lambda t: t.view(t.shape[0], k.shape[1], group, *t.shape[2:]).sum(2)  # sum query heads per kv head
    return dq, fold(dk), fold(dv)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, window, scale, group, backend):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        n_q, n_k = q.shape[2], k.shape[2]
        outs, lses = [], []
        k_cur, v_cur = k, v
        for step in range(world):
            owner = (rank - step) % world
            mask = _chunk_mask(rank * n_q, owner * n_k, n_q, n_k, causal, window)
            if mask != "skip":
                r = attention(q, k_cur, v_cur, mask=mask, scale=scale, return_lse=True, backend=backend)
                outs.append(r.out)
                lses.append(r.lse)
            if step < world - 1:
                k_cur, v_cur = _ring_pass([k_cur, v_cur], group)
        if outs:
            out, lse = merge_states(outs, lses)
        else:
            out = q.new_zeros(*q.shape[:3], v.shape[-1])
            lse = torch.full(q.shape[:3], float("-inf"))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.window, ctx.scale, ctx.group = causal, window, scale, group
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        n_q, n_k = q.shape[2], k.shape[2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # D = rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=acc)
        k_cur, v_cur = k, v
        dk_cur, dv_cur = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
        for step in range(world):
            owner = (rank - step) % world
            mask = _chunk_mask(rank * n_q, owner * n_k, n_q, n_k, ctx.causal, ctx.window)
            if mask != "skip":
                gq, gk, gv = _pair_backward(q, k_cur, v_cur, dout, lse, delta, mask, ctx.scale)
                dq += gq
                dk_cur += gk
                dv_cur += gv
            # The accumulators travel with their chunk; after `world` passes they are home again.
            k_cur, v_cur, dk_cur, dv_cur = _ring_pass([k_cur, v_cur, dk_cur, dv_cur], group)
        return dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   window: int | None = None, scale: float | None = None, group=None, backend: str = "auto"):
    """Exact attention over a sequence split into equal contiguous chunks, one per rank.

    Args:
        q: this rank's queries (B, Hq, n, D): global positions ``rank * n .. rank * n + n - 1``.
        k, v: this rank's keys/values (B, Hkv, n_k, D) / (B, Hkv, n_k, Dv), same layout by rank.
        causal: mask keys after each query's global position.
        window: also mask keys ``window`` or more positions before the query.
        scale: default ``D ** -0.5``.
        group: a ``torch.distributed`` process group (default: the world).
        backend: the qkv backend for each chunk pair (it must return lse).

    Returns:
        ``AttentionOutput(out, lse)`` for this rank's queries: exactly what single-device attention over
        the whole sequence gives for them. Differentiable with respect to q, k, v.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first (backend 'gloo' on CPU)")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"ring_attention: window must be a positive int or None, got {window!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    from ._request import AttentionOutput

    out, lse = _RingAttention.apply(q, k, v, causal, window, scale, group, backend)
    return AttentionOutput(out, lse)
