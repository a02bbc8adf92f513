"""Host side of the Triton attention kernels: tile sizes, launches, and the autograd function.

Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning".

Shape legend: B batch, Hq/Hkv heads, G = Hq // Hkv, Nq/Nk lengths, D/Dv head dims, TQ/TK tile counts.

Importing this module imports triton; ``TRITON_INTERPRET=1`` at import time makes every kernel run in
Triton's interpreter (on CPU tensors), which is how CI checks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..._dropout import draw_seed
from ..._request import AttentionOutput, Request
from . import _kernels as K
from ._lower import MaskPlan, ModPlan, bias_tensor, lower_mask, lower_mods

__all__ = ["run", "tile_sizes", "Tiles"]


@dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    warps: int
    stages: int


def tile_sizes(D: int, Dv: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, *,
               backward: bool = False) -> Tiles:
    """Tile sizes for head dims up to 256 (shared memory bounds them: wider heads and float32 take smaller
    tiles; the backward's two kernels keep more tiles live than the forward). The interpreter runs tiles as
    numpy arrays: small ones keep many tiles (and their edges) in tiny test problems."""
    if device.type != "cuda":
        return Tiles(16, 16, 4, 1)
    widest = max(D, Dv)
    wide = dtype == torch.float32
    if backward:
        if widest <= 64:
            return Tiles(64, 64, 4, 2)
        if widest <= 128:  # bf16/fp16: the fastest of benchmarks/gpu_tune.py's sweep on an H200
            return Tiles(32, 32, 4, 2) if wide else Tiles(128, 64, 8, 2)
        return Tiles(32, 32, 4, 1) if wide else Tiles(32, 32, 4, 2)
    if widest <= 64:
        return Tiles(64, 64, 4, 3) if wide else Tiles(128, 64, 4, 3)
    if widest <= 128:  # bf16/fp16: the fastest over causal and window of benchmarks/gpu_tune.py's sweep, H200
        return Tiles(64, 32, 4, 2) if wide else Tiles(128, 128, 8, 3)
    return Tiles(32, 32, 4, 2) if wide else Tiles(64, 32, 8, 2)


#: The forward launches its query tiles last-first (under a causal mask the last hold the most key tiles, so the
#: long programs start first and the short ones fill the tail); benchmarks/gpu_tune.py times both orders.
FWD_HEAVY_FIRST = True


def _pow2(n: int) -> int:
    return max(16, 1 << (max(1, n) - 1).bit_length())


def _strides4(t: torch.Tensor):
    return t.stride(0), t.stride(1), t.stride(2)


class _Config:
    """Everything about one call except the differentiable tensors."""

    def __init__(self, req: Request, mods: ModPlan, tiles: Tiles, bwd_tiles: Tiles, seed: int) -> None:
        self.req_shape = (req.B, req.Hq, req.Hkv, req.Nq, req.Nk, req.Dqk, req.Dv)
        self.mask = req.mask
        self.scale, self.mods, self.tiles, self.bwd_tiles = req.scale, mods, tiles, bwd_tiles
        self.dropout_p, self.seed = req.dropout_p, seed
        self.device = req.device
        interpreted = req.device.type == "cpu"
        self.prec = 1 if req.dtype == torch.float32 else (2 if interpreted and req.dtype == torch.bfloat16 else 0)
        self.fwd_plan: MaskPlan = lower_mask(req.mask, req.B, req.Hq, req.Nq, req.Nk, tiles.bm, tiles.bn, req.device)
        self.bwd_plan: MaskPlan | None = None  # lowered on the first backward

    def backward_plan(self) -> MaskPlan:
        if self.bwd_plan is None:
            B, Hq, _, Nq, Nk, _, _ = self.req_shape
            t = self.bwd_tiles
            self.bwd_plan = lower_mask(self.mask, B, Hq, Nq, Nk, t.bm, t.bn, self.device)
        return self.bwd_plan

    def common_args(self, plan: MaskPlan, bias: torch.Tensor | None, slopes: torch.Tensor | None, by_key: bool):
        """Mask, modifier and dropout arguments shared by the three kernels, from the list pointers on:
        tile lists per query tile (forward, dQ) or per key tile (``by_key``: dK/dV)."""
        mods, dev = self.mods, self.device
        dummy = torch.zeros(1, dtype=torch.int32, device=dev)
        num, idx, kind = plan.bwd if by_key else plan.fwd
        rows = num.shape[1]
        lists = (num, idx, kind, rows if plan.Bm > 1 else 0, 1, idx.shape[2])
        band = plan.band if plan.band is not None else (0, 0)

        def vec(t):
            return (dummy, 0) if t is None else (t, 1 if t.shape[0] > 1 else 0)

        def rowed(t):
            return (dummy, 0) if t is None else (t, t.shape[1] if t.shape[0] > 1 else 0)

        kvlen, qid, kid, prefix = vec(plan.kvlen), rowed(plan.qid), rowed(plan.kid), vec(plan.prefix)
        tiles = plan.tiles if plan.tiles is not None else dummy
        s_tile = tiles.stride(0) if plan.tiles is not None else 0
        s_tile_h = tiles.stride(1) if plan.tiles is not None else 0
        if slopes is not None:
            slopes32 = slopes.detach().to(device=dev, dtype=torch.float32).contiguous()
            sl = (slopes32, 1 if slopes32.numel() > 1 else 0)
        else:
            sl = (torch.zeros(1, dtype=torch.float32, device=dev), 0)
        if bias is not None:
            b4 = bias.detach().to(dev).reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
            bst = tuple(0 if b4.shape[i] == 1 else b4.stride(i) for i in range(4))
            bias_args = (b4, *bst)
        else:
            bias_args = (torch.zeros(1, dtype=torch.float32, device=dev), 0, 0, 0, 0)
        threshold = int(self.dropout_p * 2**32)
        keep_scale = 1.0 / (1.0 - self.dropout_p) if self.dropout_p > 0 else 1.0
        args = (*lists, *band, *kvlen, *qid, *kid, *prefix, tiles, s_tile, s_tile_h, *sl, *bias_args,
                float(mods.cap or 1.0), self.seed, threshold, keep_scale)
        consts = dict(MASK_KIND=plan.kind, HAS_BAND=plan.band is not None, HAS_KVLEN=plan.kvlen is not None,
                      HAS_DOC=plan.qid is not None, HAS_PREFIX=plan.prefix is not None, TILE_HEADS=plan.tile_heads,
                      ALIBI_POS=mods.alibi_pos if mods.alibi is not None else 0,
                      ALIBI_BIDIR=bool(mods.alibi is not None and mods.alibi.bidirectional),
                      BIAS_POS=mods.bias_pos if bias is not None else 0, HAS_CAP=mods.cap is not None,
                      HAS_DROP=self.dropout_p > 0, PREC=self.prec)
        return args, consts


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim with stride 1."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward(cfg: _Config, q, k, v, bias, slopes):
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, Hq, Hkv, Nq, Nk, D, Dv = cfg.req_shape
    t = cfg.tiles
    out = torch.empty(B, Hq, Nq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)
    args, consts = cfg.common_args(cfg.fwd_plan, bias, slopes, by_key=False)
    grid = (math.ceil(Nq / t.bm), B * Hq)
    K.attn_fwd[grid](q, k, v, out, lse, *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out),
                     Hq, Hq // Hkv, Nq, Nk, D, Dv, cfg.scale, *args, **consts,
                     BM=t.bm, BN=t.bn, BD=_pow2(D), BDV=_pow2(Dv), HEAVY_FIRST=FWD_HEAVY_FIRST,
                     num_warps=t.warps, num_stages=t.stages)
    return out, lse


def _backward(cfg: _Config, q, k, v, out, lse, dout, dlse, bias, slopes, want_bias: bool, want_slopes: bool):
    B, Hq, Hkv, Nq, Nk, D, Dv = cfg.req_shape
    t, plan = cfg.bwd_tiles, cfg.backward_plan()
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # (B, Hq, Nq): rowsum(dO * O)
    if dlse is not None:
        delta = delta - dlse.float()
    lse_safe = lse.masked_fill(torch.isneginf(lse), float("inf")).contiguous()  # empty rows: P = 0
    delta = delta.contiguous()
    tq, tk = math.ceil(Nq / t.bm), math.ceil(Nk / t.bn)
    dq = torch.empty(B, Hq, Nq, D, dtype=torch.float32, device=q.device)
    dk = torch.empty(B, Hkv, Nk, D, dtype=torch.float32, device=q.device)
    dv = torch.empty(B, Hkv, Nk, Dv, dtype=torch.float32, device=q.device)
    dbias = torch.zeros(B, Hq, Nq, Nk, dtype=torch.float32, device=q.device) if want_bias else lse_safe
    dslope = torch.zeros(B, Hq, tq, dtype=torch.float32, device=q.device) if want_slopes else lse_safe
    BD, BDV = _pow2(D), _pow2(Dv)
    args, consts = cfg.common_args(plan, bias, slopes, by_key=False)
    K.attn_bwd_dq[(tq, B * Hq)](q, k, v, dout, lse_safe, delta, dq, dbias, dslope,
                                *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(dout),
                                Hq, Hq // Hkv, Nq, Nk, D, Dv, cfg.scale, tq, *args, **consts,
                                BIAS_GRAD=want_bias, SLOPE_GRAD=want_slopes,
                                BM=t.bm, BN=t.bn, BD=BD, BDV=BDV, num_warps=t.warps, num_stages=t.stages)
    args, consts = cfg.common_args(plan, bias, slopes, by_key=True)
    K.attn_bwd_dkdv[(tk, B * Hkv)](q, k, v, dout, lse_safe, delta, dk, dv,
                                   *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(dout),
                                   Hq, Hkv, Hq // Hkv, Nq, Nk, D, Dv, cfg.scale, *args, **consts,
                                   BM=t.bm, BN=t.bn, BD=BD, BDV=BDV, num_warps=t.warps, num_stages=t.stages)
    dbias_out = None
    if want_bias:
        shape4 = (1,) * (4 - bias.dim()) + tuple(bias.shape)
        dims = tuple(i for i in range(4) if shape4[i] == 1 and dbias.shape[i] != 1)
        dbias_out = (dbias.sum(dims, keepdim=True) if dims else dbias).reshape(bias.shape).to(bias.dtype)
    dslope_out = None
    if want_slopes:
        per_head = dslope.sum((0, 2))  # (Hq,)
        dslope_out = (per_head if slopes.numel() > 1 else per_head.sum().reshape(1)).to(slopes.dtype)
    return dq, dk, dv, dbias_out, dslope_out


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: _Config, q, k, v, bias, slopes):
        out, lse = _forward(cfg, q, k, v, bias, slopes)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse, bias, slopes)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, bias, slopes = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq, dk, dv, dbias, dslope = _backward(ctx.cfg, q, k, v, out, lse, dout, dlse, bias, slopes,
                                              want_bias=bias is not None and need[4],
                                              want_slopes=slopes is not None and need[5])
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, dslope


def run(req: Request, tiles: Tiles | None = None, bwd_tiles: Tiles | None = None) -> AttentionOutput:
    """Run ``req`` (already accepted by the backend) through the kernels; ``tiles``/``bwd_tiles`` override
    the forward's and the backward's tile sizes (the backward lowers the mask again at its own size)."""
    if req.B * req.Hq * req.Nq == 0 or req.Nk == 0:
        out = req.q.new_zeros(req.B, req.Hq, req.Nq, req.Dv)
        lse = torch.full((req.B, req.Hq, req.Nq), float("-inf"), device=req.device)
        if req.requires_grad:  # keep the graph: zero gradients flow back
            out = out + 0.0 * (req.q.sum() + req.k.sum() + req.v.sum())
        return AttentionOutput(out, lse)
    mods = lower_mods(req.score_mod)
    assert isinstance(mods, ModPlan), mods  # the backend declined otherwise
    seed = draw_seed(req.generator) if req.dropout_p > 0 else 0
    fwd_tiles = tiles or tile_sizes(req.Dqk, req.Dv, req.device, req.dtype)
    bwd_tiles = bwd_tiles or tiles or tile_sizes(req.Dqk, req.Dv, req.device, req.dtype, backward=True)
    cfg = _Config(req, mods, fwd_tiles, bwd_tiles, seed)
    bias = bias_tensor(mods, req.B, req.Hq, req.Nq, req.Nk, req.device)
    slopes = mods.alibi.slopes if mods.alibi is not None else None
    out, lse = _TritonAttention.apply(cfg, req.q, req.k, req.v, bias, slopes)
    return AttentionOutput(out, lse)
