"""One block of distributed attention: a slice of local queries against a slice of (possibly remote) keys,
with the mask and score modifiers evaluated at the tokens' *global* positions and heads.

Forward runs :func:`qkv.attention` on the block and returns ``(out, lse)``; partial results merge with
:func:`qkv.merge_states`. Backward recomputes the block's scores in float32 (float64 for float64 inputs) and
applies the FlashAttention-2 gradient from the saved global ``lse`` (Dao 2023): ``dS = P * (dO V^T - delta
+ dlse)``; gradients of learnable score-modifier tensors come from autograd through the recomputed scores.

Shape legend: B batch, Hq/Hkv local heads, nq/nk block lengths, Dqk/Dv head dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import masks as _masks
from .._attention import attention as _attention
from ..mods.base import ScoreMod

__all__ = ["BlockGeometry", "GlobalMod", "block_mask", "block_forward", "block_backward", "accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class BlockGeometry:
    """Where a block sits in the global problem: global query/key indices (nq,), (nk,), the global index of
    the first local head, and the global problem's sizes."""

    q_index: torch.Tensor  # on the inputs' device
    k_index: torch.Tensor
    head_offset: int
    n_heads: int  # global query heads
    nq_global: int
    nk_global: int


def _grids(geo: BlockGeometry, hq: int, device):
    h = (torch.arange(hq, device=device) + geo.head_offset).view(1, -1, 1, 1)
    qi = geo.q_index.to(device).view(1, 1, -1, 1)
    kj = geo.k_index.to(device).view(1, 1, 1, -1)
    return h, qi, kj


def block_mask(mask, geo: BlockGeometry, hq: int, device) -> torch.Tensor | None:
    """The block's allowed pairs, (Bm, Hm, nq, nk) bool, or None for no mask."""
    if mask is None:
        return None
    h, qi, kj = _grids(geo, hq, device)
    b = torch.arange(mask.batch or 1, device=device).view(-1, 1, 1, 1)
    if not mask.depends_on_head:
        h = torch.zeros_like(h[:, :1])
    d = mask.allowed(b, h, qi, kj, geo.nq_global, geo.nk_global)
    return torch.broadcast_to(d, (max(d.shape[0], 1), h.shape[1], qi.shape[2], kj.shape[3])).contiguous()


class GlobalMod(ScoreMod):
    """A score modifier evaluated at a block's global heads and positions."""

    def __init__(self, mod: ScoreMod, geo: BlockGeometry) -> None:
        self.mod, self.geo = mod, geo
        self.additive, self.batch = mod.additive, mod.batch

    def _map(self, h, q_idx, kv_idx):
        return h + self.geo.head_offset, self.geo.q_index[q_idx], self.geo.k_index[kv_idx]

    def apply(self, score, b, h, q_idx, kv_idx, nq, nk):
        h, qi, kj = self._map(h, q_idx, kv_idx)
        return self.mod.apply(score, b, h, qi, kj, self.geo.nq_global, self.geo.nk_global)

    def bias(self, b, h, q_idx, kv_idx, nq, nk):
        h, qi, kj = self._map(h, q_idx, kv_idx)
        return self.mod.bias(b, h, qi, kj, self.geo.nq_global, self.geo.nk_global)

    def tensors(self):
        return self.mod.tensors()

    def __repr__(self):
        return f"global({self.mod!r})"


def block_forward(q, k, v, d: torch.Tensor | None, mod: ScoreMod | None, geo: BlockGeometry, scale: float,
                  backend: str):
    """``(out, lse)`` of one block; ``d`` from :func:`block_mask` (None or all-True: no mask)."""
    mask = None if d is None or bool(d.all()) else _masks.dense(d)
    gmod = None if mod is None else GlobalMod(mod, geo)
    return _attention(q, k, v, mask=mask, score_mod=gmod, scale=scale, return_lse=True, backend=backend)


def block_backward(q, k, v, do, lse, delta, dlse, d, mod: ScoreMod | None, geo: BlockGeometry, scale: float,
                   mod_tensors: tuple[torch.Tensor, ...]):
    """Gradients of one block in the accumulation dtype: dq (B, Hq, nq, Dqk), dk (B, Hkv, nk, Dqk),
    dv (B, Hkv, nk, Dv) and one gradient (or None) per tensor in ``mod_tensors``.

    ``lse`` is the row's *global* log-sum-exp, ``delta = rowsum(dO * O)`` of the global output, ``dlse`` the
    gradient flowing into the returned lse (or None).
    """
    acc = accumulation_dtype(q.dtype)
    B, Hq, nq, _ = q.shape
    Hkv, nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    learn = [t for t in mod_tensors if t.requires_grad]
    with torch.enable_grad():
        qa = q.detach().to(acc).requires_grad_(True)
        ka = k.detach().to(acc).requires_grad_(True)
        s = scale * (qa @ ka.repeat_interleave(group, 1).transpose(-1, -2))  # (B, Hq, nq, nk)
        if mod is not None:
            dev = q.device
            s = GlobalMod(mod, geo).apply(s, torch.arange(B, device=dev).view(-1, 1, 1, 1),
                                          torch.arange(Hq, device=dev).view(1, -1, 1, 1),
                                          torch.arange(nq, device=dev).view(1, 1, -1, 1),
                                          torch.arange(nk, device=dev).view(1, 1, 1, -1), nq, nk)
        with torch.no_grad():
            lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(acc).unsqueeze(-1)
            sm = s.detach() if d is None else s.detach().masked_fill(~d, float("-inf"))
            p = torch.exp(sm - lse_safe)  # (B, Hq, nq, nk); masked pairs and empty rows give 0
            doa = do.to(acc)
            dv = (p.transpose(-1, -2) @ doa).view(B, Hkv, group, nk, -1).sum(2)
            dp = doa @ v.to(acc).repeat_interleave(group, 1).transpose(-1, -2)
            row = dp - delta.to(acc).unsqueeze(-1)
            if dlse is not None:
                row = row + dlse.to(acc).unsqueeze(-1)
            ds = p * row
        grads = torch.autograd.grad(s, [qa, ka, *learn], ds, allow_unused=True)
    it = iter(grads[2:])
    mod_grads = tuple(next(it) if t.requires_grad else None for t in mod_tensors)
    return grads[0], grads[1], dv, mod_grads
