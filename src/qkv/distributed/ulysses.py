"""Ulysses: all-to-all from sequence shards to head shards, full-sequence attention on a share of the heads,
and all-to-all back.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models". The head count must divide over the ranks; when there are fewer K/V heads than ranks
they are replicated (``W % Hkv == 0``). The exchange runs on the backend's all-to-all or, with
``all_to_all="p2p"``, on pairwise sends and receives (exact; for backends without all-to-all).

Collectives per call: forward 3 all-to-alls (Q, K, V) and 1 back (out, plus 1 for lse when returned);
backward the reverse of each.
"""

from __future__ import annotations

import torch

from .exchange import Exchange
from .plan import Plan
from .ring import RingAttention
from .sharding import ShardLayout

__all__ = ["AllToAll", "split_heads", "ulysses_attention"]


def _exchange(ex: Exchange, x: torch.Tensor, split_dim: int, cat_dim: int, step: str) -> torch.Tensor:
    return torch.cat(ex.all_to_all(list(x.chunk(ex.world, split_dim)), step), cat_dim)


class AllToAll(torch.autograd.Function):
    """Split ``x`` along ``split_dim`` into W parts, send part j to rank j, concatenate what arrives along
    ``cat_dim``. Its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, ex: Exchange, x, split_dim: int, cat_dim: int, step: str):
        ctx.ex, ctx.dims, ctx.step = ex, (split_dim, cat_dim), step
        return _exchange(ex, x, split_dim, cat_dim, step)

    @staticmethod
    def backward(ctx, g):
        ctx.ex.phase = "backward"
        split_dim, cat_dim = ctx.dims
        return None, _exchange(ctx.ex, g, cat_dim, split_dim, ctx.step), None, None, None


def split_heads(q, k, v, world: int, scheme: str):
    """Check that the heads divide over ``world`` ranks; replicate K/V heads when there are fewer than ranks."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq % world:
        raise ValueError(f"qkv.distributed {scheme}: {Hq} query heads do not divide over {world} ranks; Ulysses "
                         f"shards heads, so use a head count that is a multiple of {world}, or scheme='ring'")
    if Hkv % world == 0:
        return k, v
    if world % Hkv == 0:  # fewer K/V heads than ranks: each rank gets a copy of the one its queries read
        return k.repeat_interleave(world // Hkv, 1), v.repeat_interleave(world // Hkv, 1)
    raise ValueError(f"qkv.distributed {scheme}: {Hkv} key/value heads neither divide over {world} ranks nor "
                     f"divide {world} (for replication); use scheme='ring' or 'allgather'")


def ulysses_attention(ex: Exchange, q, k, v, q_layout: ShardLayout, k_layout: ShardLayout, *, mask, mod, scale: float,
                      backend: str, log, mod_tensors: tuple, return_lse: bool = False):
    """``(out, lse or None)`` of this rank's sequence shard; see the module docstring."""
    W, r = ex.world, ex.rank
    k, v = split_heads(q, k, v, W, ex.scheme)
    qh = AllToAll.apply(ex, q, 1, 2, "Q")  # (B, Hq/W, NQ, Dqk)
    kh = AllToAll.apply(ex, k, 1, 2, "K")
    vh = AllToAll.apply(ex, v, 1, 2, "V")
    nq, nk = q_layout.n_local, k_layout.n_local
    plan = Plan(None, 0, 1, [torch.cat(q_layout.index).to(q.device)], [torch.cat(k_layout.index).to(q.device)],
                [[slice(i * nq, (i + 1) * nq) for i in range(W)]], [[slice(i * nk, (i + 1) * nk) for i in range(W)]],
                r * (q.shape[1] // W), q.shape[1], q_layout.n_global, k_layout.n_global, mask, mod, scale, backend,
                log, mod_tensors)
    out, lse = RingAttention.apply(plan, qh, kh, vh, *mod_tensors)
    out = AllToAll.apply(ex, out, 2, 1, "out")  # (B, Hq, nq, Dv)
    if not return_lse:
        return out, None
    return out, AllToAll.apply(ex, lse.unsqueeze(-1), 2, 1, "lse").squeeze(-1)
