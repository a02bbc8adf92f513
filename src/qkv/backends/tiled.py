"""The tiled backend: exact attention in tiles with an online softmax, skipping masked-out tiles.

Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness";
Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning".
The online softmax is Milakov & Gimelshein 2018, "Online normalizer calculation for softmax".

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv, Nq/Nk lengths, D/Dv head
dims, bq/bk tile sizes, TQ/TK tile counts.

How it works, in plain PyTorch (no custom kernels, so it runs wherever torch does):

- The mask's ``block_map`` classifies each (query tile, key tile) as EMPTY, PARTIAL or FULL. EMPTY
  tiles are never touched, FULL tiles never evaluate the mask, PARTIAL tiles evaluate
  ``mask.allowed`` on their own index tensors. Work scales with the allowed tiles: a sliding window
  of W keys costs O(N * W), not O(N^2).
- Work is batched so Python overhead does not dominate: query tiles are grouped into row batches of
  rows visiting similar numbers of key tiles, and each step multiplies ``[rows, G*bq, D]`` queries by
  ``[rows, D, C*bk]`` keys (gathered per row, or one contiguous slice when rows share key tiles, as
  under causal and dense masks). At most one batch of score tiles exists at a time, in buffers reused
  from step to step: memory beyond the inputs is O(N) plus that bounded batch. Plans (the schedule,
  gather indices, mask biases of PARTIAL tiles up to 32 MiB) are cached on the mask object, so masks
  are treated as immutable: rebuild a mask whose tensors you change in place.
- GQA never repeats K/V: the G query heads of a kv head are stacked as rows of one matmul.
- The forward takes each chunk's softmax in one fused pass (with its row max and log-sum-exp) and
  merges chunks into a running float32 (float64 for float64 inputs) output and log-sum-exp, the
  online-softmax rescaling done in log space; it returns the log-sum-exp. The backward recomputes each tile's
  probabilities from the saved log-sum-exp (FlashAttention-2: ``D = rowsum(dO * O)``,
  ``dS = P * (dP - D)``) with the same skipping; score-modifier gradients (and the chain rule through
  non-additive modifiers such as softcap) come from autograd on each recomputed tile.
- Dropout keep-masks come from :func:`qkv._dropout.keep_mask`, a pure function of coordinates, so the
  pattern equals the reference backend's for the same seed and the backward recomputes it.

Example:
    >>> import torch, qkv
    >>> q = k = v = torch.randn(1, 2, 300, 32)
    >>> out = qkv.attention(q, k, v, mask=qkv.masks.sliding_window(63), backend="tiled")
    >>> ref = qkv.attention(q, k, v, mask=qkv.masks.sliding_window(63), backend="reference")
    >>> bool(torch.allclose(out, ref, atol=1e-5))
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._dropout import draw_seed
from .._request import AttentionOutput, Request
from .._sinks import apply_sinks
from ._invariant import invariant_attention, invariant_decline
from ._tiled_kernel import Problem, backward_slice, forward_slice, pad_keys, pad_rows, unpad_rows
from ._tiled_plan import TilePlan, block_map_cached, block_map_for, plan_for, tile_counts
from .base import NOMINAL_FLOPS, Backend, Estimate, format_seconds, format_work, predicate_seconds

__all__ = ["TiledBackend", "TiledConfig", "TiledStats"]


@dataclass(frozen=True)
class TiledConfig:
    """Tile sizes and step budget. ``score_budget`` bounds the score elements one step materializes
    (summed over batch and heads); ``chunk_tiles`` is the number of key tiles per step."""

    block_q: int
    block_k: int
    chunk_tiles: int
    score_budget: int = 1 << 21


@dataclass
class TiledStats:
    """What the last run did: tiles visited out of the whole grid, and how many Python-level steps.

    Counts are per batch slice (one slice unless the mask carries per-batch data), not per head."""

    grid_tiles: int = 0  # TQ * TK summed over slices
    tiles: int = 0  # non-empty tiles visited
    partial_tiles: int = 0  # tiles that evaluated the mask
    computed_tiles: int = 0  # tiles multiplied, padding slots included
    steps: int = 0  # forward steps (chunks)

    def add(self, plan: TilePlan) -> None:
        self.grid_tiles += plan.tq * plan.tk
        self.tiles += plan.tiles
        self.partial_tiles += plan.partial_tiles
        self.computed_tiles += plan.computed_tiles
        self.steps += plan.steps


def default_config(req: Request) -> TiledConfig:
    """Tile sizes chosen by measurement on CPU (``benchmarks/tiled.py``, ``benchmarks/sparse.py``).

    Dense problems take wide steps (fewer, larger matmuls). Masked ones take 128 x 128 tiles, or 64 x 64
    when more than a third of the visited 128-tiles of a grid of at least 16 are PARTIAL (windows,
    documents, block patterns), where finer tiles skip more and waste less on the ragged edges. From 64
    they halve again (to 32, then 16) while the finer tiles compute at most 2/3 of the pairs: a +-16
    window at N = 520 ends at 16 x 16 tiles, computing 1/11 of the pairs where every 64-tile is PARTIAL
    (``benchmarks/sparse.py``, table ``sparse_train``), while a 256-key window stays at 64 (32-tiles would
    save 10% of the pairs and cost more per pair)."""
    if req.mask is None:
        bq, bk, chunk, budget = 256, 512, 2, 1 << 21
    else:
        bq, bk, chunk, budget = 128, 128, 4, 1 << 20
        bm = block_map_for(req.mask, req.Nq, req.Nk, bq, bk, req.device, B=req.B, H=req.Hq)
        visited, partial = tile_counts(req.mask, bm)
        if bm.shape[-2] * bm.shape[-1] >= 16 and partial > visited / 3:
            bq = bk = 64
            chunk, budget = 8, 1 << 19
            visited, _ = tile_counts(req.mask, block_map_for(req.mask, req.Nq, req.Nk, 64, 64, req.device, B=req.B,
                                                             H=req.Hq))
            while bq > 16:
                finer = bq // 2
                fm = block_map_for(req.mask, req.Nq, req.Nk, finer, finer, req.device, B=req.B, H=req.Hq)
                fine_visited, _ = tile_counts(req.mask, fm)
                if fine_visited * finer * finer * 3 > visited * bq * bq * 2:
                    break
                bq = bk = finer
                visited = fine_visited
                chunk = 8 if bq > 16 else 16
    bq = min(bq, max(1, req.Nq))
    bk = min(bk, max(1, req.Nk))
    return TiledConfig(bq, bk, chunk, budget)


def _scores_surely_finite(req: Request, acc: torch.dtype) -> bool:
    bound = abs(req.scale) * req.Dqk
    for t in (req.q, req.k):
        lo, hi = torch.aminmax(t.detach())
        bound *= float(torch.maximum(hi, -lo))  # NaN stays NaN
    return math.isfinite(bound) and bound < torch.finfo(acc).max / 4


class _Spec:
    """Everything about a run except the tensors (shared by forward and backward)."""

    def __init__(self, req: Request, cfg: TiledConfig, seed: int, stats: TiledStats | None) -> None:
        self.mask, self.mod, self.scale = req.mask, req.score_mod, req.scale
        self.dropout_p, self.seed = req.dropout_p, seed
        self.cfg, self.stats = cfg, stats
        self.B, self.Hq, self.Hkv, self.G = req.B, req.Hq, req.Hkv, req.group
        self.nq, self.nk = req.Nq, req.Nk
        self.dtype = req.dtype
        self.acc = torch.float64 if req.dtype == torch.float64 else torch.float32
        self.device = req.device
        self.empty = req.B * req.Hq * req.Nq == 0 or req.Nk == 0
        if self.empty:
            self.fill_masked = False
            return
        self.bm = block_map_for(self.mask, self.nq, self.nk, cfg.block_q, cfg.block_k, self.device, B=self.B,
                                H=self.Hq)
        # Scores that are finite everywhere may be masked by adding -inf; otherwise masked scores are filled, so an
        # inf (q.k overflowing at a masked-out pair) or NaN there never reaches the softmax. |scale * q.k| is at
        # most scale * D * max|q| * max|k|: one min/max pass per input bounds every score (NaN makes it NaN).
        self.fill_masked = self.mod is not None or not _scores_surely_finite(req, self.acc)

    def slices(self):
        """(batch slice, plan) pairs: one slice for all of B, or one per batch row when the block map
        differs per row."""
        bm = self.bm
        if bm.shape[0] == 1:
            yield slice(0, self.B), self._plan(bm[0], 0, self.B)
        else:
            for b in range(self.B):
                yield slice(b, b + 1), self._plan(bm[b], b, 1)

    def _plan(self, bm_row: torch.Tensor, index: int, nb: int) -> TilePlan:
        cfg = self.cfg
        step_tiles = max(1, cfg.score_budget // (nb * self.Hq * cfg.block_q * cfg.block_k))
        chunk = max(1, min(cfg.chunk_tiles, step_tiles))
        return plan_for(self.mask, bm_row, index, self.nq, self.nk, cfg.block_q, cfg.block_k, step_tiles, chunk,
                        B=self.B, H=self.Hq)

    def problem(self, sl: slice) -> Problem:
        b_index = torch.arange(sl.start, sl.stop, device=self.device)
        return Problem(b_index=b_index, Hkv=self.Hkv, G=self.G, nq=self.nq, nk=self.nk, scale=self.scale,
                       mask=self.mask, score_mod=self.mod, dropout_p=self.dropout_p, seed=self.seed,
                       device=self.device, fill_masked=self.fill_masked)


def _forward(spec: _Spec, q, k, v):
    """Returns out (B, Hq, Nq, Dv) and lse (B, Hq, Nq), both in the compute dtype."""
    if spec.empty:  # no queries, or no keys: zeros and lse = -inf
        return (torch.zeros(spec.B, spec.Hq, spec.nq, v.shape[-1], dtype=spec.acc, device=spec.device),
                torch.full((spec.B, spec.Hq, spec.nq), float("-inf"), dtype=spec.acc, device=spec.device))
    outs, lses = [], []
    for sl, plan in spec.slices():
        qp = pad_rows(q[sl], plan, spec.acc)
        kt, vt = pad_keys(k[sl], plan, spec.acc), pad_keys(v[sl], plan, spec.acc)
        o, lse = forward_slice(plan, spec.problem(sl), qp, kt, vt, spec.stats)
        outs.append(unpad_rows(o, plan))
        lses.append(unpad_rows(lse, plan))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def _backward(spec: _Spec, q, k, v, out, lse, dout, dlse, mod_inputs):
    mod_grads: list[torch.Tensor | None] = [None] * len(mod_inputs)
    if spec.empty:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), mod_grads
    dqs, dks, dvs = [], [], []
    dout = dout.to(spec.acc)
    delta = (dout * out.to(spec.acc)).sum(-1)  # (B, Hq, Nq): rowsum(dO * O)
    if dlse is not None:
        delta = delta - dlse.to(spec.acc)
    lse_safe = lse.masked_fill(torch.isneginf(lse), float("inf"))  # empty rows: P = exp(s - inf) = 0
    for sl, plan in spec.slices():
        qp = pad_rows(q[sl], plan, spec.acc)
        kt, vt = pad_keys(k[sl], plan, spec.acc), pad_keys(v[sl], plan, spec.acc)
        do = pad_rows(dout[sl], plan, spec.acc)
        l_rows = pad_rows(lse_safe[sl].unsqueeze(-1), plan, spec.acc, fill=float("inf"))[..., 0]
        d_rows = pad_rows(delta[sl].unsqueeze(-1), plan, spec.acc)[..., 0]
        dq, dk, dv, grads = backward_slice(plan, spec.problem(sl), qp, kt, vt, do, l_rows, d_rows, mod_inputs)
        dqs.append(unpad_rows(dq, plan))
        dks.append(dk[:, :, : spec.nk])
        dvs.append(dv[:, :, : spec.nk])
        for i, g in enumerate(grads):
            if g is not None:
                mod_grads[i] = g if mod_grads[i] is None else mod_grads[i] + g
    cat = (lambda xs: xs[0]) if len(dqs) == 1 else torch.cat
    return cat(dqs), cat(dks), cat(dvs), mod_grads


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, q, k, v, *mod_tensors):
        out, lse = _forward(spec, q, k, v)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, out, lse)
        out_d = out.to(spec.dtype)
        return out_d, lse  # lse in the compute dtype: ``run`` folds in sinks at full precision, then casts

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        spec: _Spec = ctx.spec
        q, k, v, out, lse = ctx.saved_tensors
        mod_tensors = spec.mod.tensors() if spec.mod is not None else ()
        wanted = [t for t, need in zip(mod_tensors, ctx.needs_input_grad[4:]) if need]
        dq, dk, dv, grads = _backward(spec, q, k, v, out, lse, dout, dlse, wanted)
        it = iter(grads)
        mod_grads = [next(it) if need else None for need in ctx.needs_input_grad[4:]]
        mod_grads = [g.to(t.dtype) if g is not None else None for g, t in zip(mod_grads, mod_tensors)]
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *mod_grads)


# the backend
#: Fitted on a 2-core AVX-512 CPU (one thread, ``benchmarks/tiled.py``), in the same nominal units as
#: the ``sdpa`` estimate (whose nominal rate reads about 0.75x its measured time): matmuls on the
#: visited tiles run near the nominal rate, the softmax passes cost ~1.5 ns per computed score (~2 ns
#: more where the mask is evaluated), a step ~40 us of Python, a call ~0.5 ms.
_RATE_FACTOR = 1.1
_PAIR_SECONDS = 1.5e-9
_PARTIAL_PAIR_SECONDS = 2.2e-9
_STEP_SECONDS = 4e-5
_CALL_SECONDS = 5e-4


class TiledBackend(Backend):
    """Tiled online-softmax attention with block-sparse skipping; forward and backward; any device."""

    name = "tiled"
    native_sinks = True
    batch_invariant = True

    def __init__(self, config: TiledConfig | None = None) -> None:
        self.config = config
        #: What the last ``run`` did (tiles visited, steps); for tests and ``qkv.explain`` readers.
        self.last_stats = TiledStats()

    def config_for(self, req: Request) -> TiledConfig:
        return self.config if self.config is not None else default_config(req)

    def decline(self, req: Request) -> str | None:
        if req.device.type == "meta":
            return ("meta tensors hold no values, and the tiled schedule reads them (to bound the scores); "
                    "backend='reference' propagates shapes on meta tensors")
        if min(req.Dqk, req.Dv) == 0:
            return f"head dim 0 (Dqk={req.Dqk}, Dv={req.Dv}): no tiles to compute; use backend='reference' or 'sdpa'"
        return invariant_decline(req) if req.batch_invariant else None

    @staticmethod
    def _held_maps(req: Request) -> int | None:
        """How many of the block maps ``config_for`` may read are cached (None for analytic masks)."""
        if req.mask is None or not req.mask.predicate_pairs(1, 1, 1, 1):
            return None
        return sum(block_map_cached(req.mask, req.Nq, req.Nk, s, s, req.device, B=req.B, H=req.Hq)
                   for s in (128, 64, 32, 16))

    def estimate(self, req: Request) -> Estimate:
        """Work on the visited tiles only (from the cached block map) over the nominal rate, plus the
        softmax passes per computed score, Python per step and a fixed cost per call."""
        if req.Nq == 0 or req.Nk == 0:
            return Estimate(_CALL_SECONDS, "empty problem")
        held = self._held_maps(req)
        cfg = self.config_for(req)
        bm = block_map_for(req.mask, req.Nq, req.Nk, cfg.block_q, cfg.block_k, req.device, B=req.B, H=req.Hq)
        # a mask without an analytic block map evaluates its predicate once per block size, then it is cached
        first = (self._held_maps(req) - held) * predicate_seconds(req) if held is not None else 0.0
        visited, partial = tile_counts(req.mask, bm)
        rows = (req.B if bm.shape[0] == 1 else 1) * req.Hq  # heads (and batch rows) sharing each tile
        tile_pairs = cfg.block_q * cfg.block_k * rows
        pairs, partial_pairs = visited * tile_pairs, partial * tile_pairs
        flops = 2.0 * pairs * (req.Dqk + req.Dv)
        rate = NOMINAL_FLOPS.get(req.device.type, NOMINAL_FLOPS["cpu"]) * _RATE_FACTOR
        steps = max(1.0, pairs / cfg.score_budget) + math.ceil(req.Nq / cfg.block_q) * bm.shape[0] / 16
        elem = 1.0 if req.device.type == "cpu" else 1e-3  # elementwise passes are cheap next to GPU matmuls
        seconds = (flops / rate + elem * (pairs * _PAIR_SECONDS + partial_pairs * _PARTIAL_PAIR_SECONDS)
                   + steps * _STEP_SECONDS + _CALL_SECONDS)
        note = (f"{visited}/{bm.numel()} tiles of {cfg.block_q}x{cfg.block_k} ({partial} partial), "
                f"{format_work(flops)} on visited tiles, ~{int(steps)} steps")
        if first:
            note += f", first call evaluates the mask predicate (~{format_seconds(first)}; cached per mask object)"
        return Estimate(seconds + first, note)

    def run(self, req: Request) -> AttentionOutput:
        if req.batch_invariant:  # one row at a time in fixed tiles, whatever the config (qkv.backends._invariant)
            return invariant_attention(req)
        cfg = self.config_for(req) if req.Nq and req.Nk else TiledConfig(1, 1, 1)
        stats = TiledStats()
        self.last_stats = stats
        seed = draw_seed(req.generator) if req.dropout_p > 0 else 0
        spec = _Spec(req, cfg, seed, stats)
        mod_tensors = req.score_mod.tensors() if req.score_mod is not None else ()
        out, lse = _TiledAttention.apply(spec, req.q, req.k, req.v, *mod_tensors)
        if req.sinks is not None:  # merged with the compute-dtype lse, differentiably (qkv._sinks)
            out, lse = apply_sinks(out, lse, req.sinks)
        return AttentionOutput(out, lse)  # float32, float64 for float64 inputs
