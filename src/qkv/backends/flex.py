"""The Flex backend: torch's FlexAttention (``torch.nn.attention.flex_attention``), compiled once per shape.

Lowering. A qkv mask becomes two things: a ``mask_mod(b, h, q_idx, kv_idx)`` closure over the mask's
own ``allowed`` predicate (with ``nq``, ``nk`` bound), and a ``BlockMask`` built with
``BlockMask.from_kv_blocks`` from the mask's analytic ``block_map`` (O(tiles), never by evaluating
every element): FULL tiles are listed as ``full_kv`` blocks, where Flex skips the mask, PARTIAL tiles
as ``kv`` blocks, where it evaluates ``mask_mod``, and EMPTY tiles are left out, so Flex never visits
them. The block map uses Flex's own block size (128 x 128); per-batch masks (padding, document) give a
batch-dependent map (``Bm = B``), everything else ``Bm = 1``; the head dimension is always 1 (a
head-dependent mask's map is the union over heads and its ``mask_mod`` sees the query head). Score
modifiers become a ``score_mod(score, b, h, q_idx, kv_idx)`` closure over ``mod.apply``. GQA is
``enable_gqa=True``; query head ``h`` reads kv head ``h // (Hq // Hkv)``, as in qkv.

What we found by experiment (torch 2.13, x86 CPU with AVX-512, 2 cores; CUDA facts are read from
torch's source and not run here):

- CPU is inference only. ``q``/``k``/``v`` that require grad raise ``NotImplementedError`` ("does not
  support backward on CPU"); a captured score-mod tensor that requires grad fails inside inductor's
  lowering (``IndexError``). Requests that need gradients are declined on CPU. CUDA has a backward,
  including gradients for captured tensors (tensor bias, relative-bias tables).
- CPU has no log-sum-exp: the compiled CPU kernel raises "``return_lse`` is not supported yet", so
  ``return_lse=True`` is declined on CPU. On CUDA it comes from ``return_aux=AuxRequest(lse=True)``
  (``return_lse=`` is deprecated), already natural-log.
- dtypes: float32, bfloat16, float16. float64 fails to lower on CPU; upstream tests Flex only in the
  three low dtypes, so float64 is declined everywhere (the reference backend does float64).
- No size constraints on CPU: Nq, Nk of 1, 63, 200, 263 (not multiples of 128), head dims 1, 3, 17,
  48, 80, 256, ``Dv != Dqk``, GQA groups of 3 and 6 all match the reference, so nothing is padded; the
  BlockMask carries the true ``seq_lengths``. The CPU kernel needs AVX2 or AVX-512, not macOS, and a
  C++ compiler. On CUDA inductor rejects head dims below 16, which is declined.
- Fully masked rows (inside a partial tile, or whole batch rows whose tiles are all EMPTY) come back
  as zeros without NaN. On CUDA the output is also zeroed where Flex's lse is ``-inf``, which keeps
  the contract (zeros, ``lse = -inf``, zero gradients) whatever the kernel does there.
- Compile cost: about 40 s for the first compile in a cold process with an empty inductor disk cache,
  5-10 s for each new signature after that on an idle machine (15-30 s with the 2 cores shared), under
  1 s when inductor's disk cache already holds the graph. A cached call costs ~0.4 ms of overhead
  (SDPA: ~20 us). Dynamo specialises on shapes, strides, dtypes, the scale and the Python constants of
  the mask and modifiers (a window size, a softcap), not on tensor contents (padding lengths, document
  ids, bias values): the signature tracked here follows that.
- Speed, sliding window of 256 keys, B=1 H=8 D=64 fp32, cached kernel, on a loaded 2-core CPU: N=4096
  ~7-10x faster than SDPA with the boolean mask, N=16384 ~25-40x (9% and 2% of tiles are visited).
- Sinks (``qkv._sinks``) run as one more key: K and V get a zero row at index ``Nk`` (a copy), the mask
  allows that key for every query (its block map adds it to the last key tile), and the score modifier
  sets its score to the head's sink logit. So they need no log-sum-exp and run on CPU too (inference
  only there, like everything on Flex's CPU kernel); on CUDA the sinks get gradients as a captured tensor.
- Dynamo's default recompile limit (8 per function) would, once reached, silently run Flex's unfused
  eager path; calls here run under a raised limit so each signature gets its compiled kernel.
- Auto-dispatch cost: ``estimate`` counts only the allowed tiles, and adds the compile cost until the
  signature has been compiled in this process, so ``auto`` picks Flex when the work dwarfs the compile
  or the kernel is warm.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Nq queries, Nk keys, Dqk, Dv head dims,
Bm mask batch (1 or B), TQ/TK tile counts.

Example:
    >>> import torch, qkv
    >>> from qkv.backends.flex import to_block_mask
    >>> bm = to_block_mask(qkv.masks.causal(), 300, 300)
    >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()  # diagonal partial, below it full
    ([[[1, 1, 1]]], [[[0, 1, 2]]])
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import sys
import types
from collections.abc import Callable

import torch

from .._request import AttentionOutput, Request
from ..masks.base import EMPTY, FULL, PARTIAL, Mask
from ..masks.topk import UNROLL, longest_list
from ..mods.base import ScoreMod
from . import state_changed
from .base import NOMINAL_FLOPS, Backend, Estimate, format_seconds, predicate_seconds, restore_nonfinite

__all__ = ["FlexBackend", "to_block_mask", "BLOCK_SIZE"]

#: Flex's tile (query rows, key columns); the block map is computed with the same tiles.
BLOCK_SIZE = (128, 128)
#: Compile seconds, the first in a process and later ones: measured on the CPU above; CUDA's (Triton
#: codegen and autotuning) are not measured here.
_FIRST_COMPILE_S = {"cpu": 40.0, "cuda": 40.0}
_COMPILE_S = {"cpu": 8.0, "cuda": 15.0}
#: Evaluating ``mask_mod`` makes a partial tile dearer than a full one.
_PARTIAL_TILE_COST = 1.5
_CALL_OVERHEAD_S = 4e-4  # measured: BlockMask build ~90 us, guards and launch; SDPA ~20 us
#: Signatures this process may compile before Dynamo would fall back to the unfused eager path.
_RECOMPILE_LIMIT = 1024
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)

# signatures compiled (and run) in this process
_compiled: set[tuple] = set()


def to_block_mask(mask: Mask | None, nq: int, nk: int, *, device=None, block_size=BLOCK_SIZE,
                  with_q_blocks: bool = False, B: int | None = None, H: int | None = None):
    """The Flex ``BlockMask`` of ``mask`` from its analytic block map; never evaluates ``allowed``.

    Args:
        mask: a qkv mask, already checked against the request (``build_request`` does), or None (every
            tile FULL). A mask with per-batch data gives ``Bm`` = its batch, otherwise ``Bm = 1``.
        nq, nk: query and key lengths.
        block_size: (rows, columns) of a tile, Flex's ``BLOCK_SIZE``.
        with_q_blocks: also build the transposed (query-major) indices that Flex's backward reads.
        B, H: the request's batch size and query heads (a user predicate may read ``b`` and ``h``; the block
            map then covers every row and head the mask reads).

    Returns:
        ``BlockMask`` with ``kv_num_blocks`` (Bm, 1, TQ) int32, ``kv_indices`` (Bm, 1, TQ, TK) int32 for
        PARTIAL tiles (``mask_mod`` applies), the ``full_kv_*`` pair for FULL tiles, and ``mask_mod``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    bq, bk = block_size
    if mask is None:
        states = torch.full((1, 1, math.ceil(nq / bq), math.ceil(nk / bk)), FULL, dtype=torch.int8, device=device)
    else:
        states = mask.block_map(nq, nk, bq, bk, B=B, H=H, device=device)  # (Bm, 1, TQ, TK)
    kv_num, kv_idx = _ordered(states == PARTIAL)
    full_num, full_idx = _ordered(states == FULL)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(bq, bk),
                                    mask_mod=None if mask is None else _mask_mod(mask, nq, nk),
                                    seq_lengths=(nq, nk), compute_q_blocks=with_q_blocks)


def _ordered(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of tiles, how many are selected and their column indices first: (..., TQ), (..., TQ, TK)."""
    num = selected.sum(-1, dtype=torch.int32)
    idx = torch.argsort(selected.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


def _mask_mod(mask: Mask, nq: int, nk: int) -> Callable:
    def mask_mod(b, h, q_idx, kv_idx):
        return mask.allowed(b, h, q_idx, kv_idx, nq, nk)

    return mask_mod


def _score_mod(mod: ScoreMod, nq: int, nk: int) -> Callable:
    def score_mod(score, b, h, q_idx, kv_idx):
        return mod.apply(score, b, h, q_idx, kv_idx, nq, nk)

    return score_mod


class _SinkKey(Mask):
    """The request's mask over ``nk`` keys plus one key at index ``nk`` (the sink) that every query may see."""

    def __init__(self, mask: Mask | None, nk: int) -> None:
        self.mask, self.nk = mask, nk
        self.batch = None if mask is None else mask.batch
        self.depends_on_head = False if mask is None else mask.depends_on_head

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        sink = kv_idx == self.nk
        if self.mask is None:
            return sink | (kv_idx < self.nk)
        return sink | self.mask.allowed(b, h, q_idx, torch.clamp(kv_idx, max=self.nk - 1), nq, self.nk)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        tq, tk = math.ceil(nq / bq), math.ceil(nk / bk)
        inner = (torch.full((1, tq, math.ceil(self.nk / bk)), FULL, dtype=torch.int8, device=device)
                 if self.mask is None else self.mask._block_map(nq, self.nk, bq, bk, device, B, H))
        inner = inner if inner.dim() == 3 else inner.unsqueeze(0)
        if tk > inner.shape[-1]:  # the sink key opens a tile of its own, allowed for every row
            return torch.cat([inner, torch.full((*inner.shape[:-1], 1), FULL, dtype=torch.int8, device=device)], -1)
        last = inner[..., -1:]
        last = torch.where(last == EMPTY, torch.tensor(PARTIAL, dtype=torch.int8, device=device), last)
        return torch.cat([inner[..., :-1], last], -1)

    def __repr__(self):
        return f"({self.mask!r} + sink key)"


class _SinkScore(ScoreMod):
    """The request's score modifier on the real keys; the sink key's score is its head's sink logit."""

    def __init__(self, mod: ScoreMod | None, sinks: torch.Tensor, nk: int) -> None:
        self.mod, self.sinks, self.nk = mod, sinks, nk

    def apply(self, score, b, h, q_idx, kv_idx, nq, nk):
        if self.mod is not None:
            score = self.mod.apply(score, b, h, q_idx, torch.clamp(kv_idx, max=self.nk - 1), nq, self.nk)
        return torch.where(kv_idx == self.nk, self.sinks[h].to(score.dtype), score)

    def tensors(self):
        return (*(self.mod.tensors() if self.mod is not None else ()), self.sinks)

    def __repr__(self):
        return f"({self.mod!r} + sinks)"


def _with_sink_key(req: Request) -> Request:
    """The request with its sinks as one more key (see the module docstring)."""
    zk = req.k.new_zeros(req.B, req.Hkv, 1, req.Dqk)
    zv = req.v.new_zeros(req.B, req.Hkv, 1, req.Dv)
    return dataclasses.replace(req, k=torch.cat([req.k, zk], 2), v=torch.cat([req.v, zv], 2),
                               mask=_SinkKey(req.mask, req.Nk), score_mod=_SinkScore(req.score_mod, req.sinks, req.Nk),
                               sinks=None)


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _structure(x, depth: int = 0):
    """What Dynamo specialises on in a mask or modifier: types, Python constants, tensor metadata."""
    if depth > 8:
        return "..."
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device.type, x.requires_grad)
    if isinstance(x, (tuple, list)):
        return tuple(_structure(v, depth + 1) for v in x)
    if isinstance(x, (type, types.ModuleType)):
        return getattr(x, "__qualname__", x.__name__)
    if isinstance(x, dict):
        return tuple((k, _structure(v, depth + 1)) for k, v in x.items() if not str(k).startswith("_"))
    code = getattr(x, "__code__", None)
    if code is not None:  # a user function: its code, and what its closure captured
        cells = tuple(_structure(c.cell_contents, depth + 1) for c in (x.__closure__ or ()))
        return ("fn", id(code), cells)
    if hasattr(x, "__dict__"):
        attrs = {k: v for k, v in vars(x).items() if not k.startswith("_")}
        return (type(x).__qualname__, _structure(attrs, depth + 1))
    return type(x).__qualname__


def _signature(req: Request) -> tuple:
    return (req.device.type, req.device.index, req.dtype, req.scale, req.requires_grad, req.return_lse,
            tuple((tuple(t.shape), t.stride()) for t in (req.q, req.k, req.v)),
            _structure(req.mask), _structure(req.score_mod), BLOCK_SIZE)


def _lse_kwargs(want: bool) -> dict:
    """``return_aux=AuxRequest(lse=True)`` where torch has it (``return_lse`` is deprecated there)."""
    if not want:
        return {}
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


# platform checks
#: The last torch release whose AVX2 Flex CPU kernel was seen to return wrong rows: with B = H = 2, D = 16 and
#: N = 40 or 56, rows of the last (batch, head) come back off by 0.5-0.7 or NaN, differing run to run (raw
#: ``torch.compile(flex_attention)`` does the same; reproduced here with ``ATEN_CPU_CAPABILITY=avx2`` in 3 of
#: the first 3 calls, while the AVX-512 kernel was right in 120 of 120). Flex is declined on AVX2 CPUs up to it.
_AVX2_WRONG_ROWS_THROUGH = (2, 13)


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.cache
def _cpu_problem() -> str | None:
    cap = torch.backends.cpu.get_cpu_capability()
    if sys.platform == "darwin" or cap not in ("AVX2", "AVX512"):
        return (f"FlexAttention's compiled CPU kernel needs an x86 CPU with AVX2 or AVX-512 and not macOS "
                f"(this CPU reports {cap!r} on {sys.platform})")
    if cap == "AVX2" and _torch_release() <= _AVX2_WRONG_ROWS_THROUGH:
        return (f"FlexAttention's AVX2 CPU kernel in torch {torch.__version__} returns wrong rows (off by ~0.6, or "
                "NaN, run to run) for some lengths with several batch rows and heads (B = H = 2, D = 16, N = 40); "
                "use backend='tiled' or 'sdpa' on this CPU")
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        return "FlexAttention's compiled CPU kernel needs a C++ compiler (g++ or clang++) on PATH"
    return None


def _compile_problem() -> str | None:
    """Why torch.compile cannot run here; None when it can. Checked only once Dynamo is loaded, so that
    considering this backend does not import it (seconds); ``run`` checks before compiling."""
    if "torch._dynamo" not in sys.modules:
        return None
    return _dynamo_problem()


@functools.cache
def _dynamo_problem() -> str | None:
    from torch._dynamo import is_dynamo_supported

    if not is_dynamo_supported():
        return (f"torch.compile is unavailable on Python {sys.version.split()[0]} with torch {torch.__version__}, "
                "and uncompiled Flex materializes every score")
    return None


class FlexBackend(Backend):
    """torch FlexAttention: block-sparse over the mask's allowed tiles, compiled once per signature."""

    name = "flex"
    native_sinks = True

    def decline(self, req: Request) -> str | None:
        if req.dropout_p > 0:
            return "dropout: FlexAttention has no attention dropout (score_mod acts before the softmax)"
        if req.dtype not in _SUPPORTED:
            return (f"dtype {str(req.dtype).replace('torch.', '')}: FlexAttention supports float32, bfloat16 and "
                    "float16 (float64 fails to compile on CPU); use backend='reference' for float64")
        if min(req.Dqk, req.Dv) == 0:
            return f"head dim 0 (Dqk={req.Dqk}, Dv={req.Dv}): nothing for a compiled kernel to do"
        if longest_list(req.mask) > UNROLL:
            return (f"masks.topk lists of {longest_list(req.mask)} keys: a compiled mask_mod looks up at most {UNROLL} "
                    f"per row (longer ones need a reduction inductor cannot lower); use backend='gather'")
        if req.device.type == "cpu":
            problem = _cpu_problem()
            if problem is not None:
                return problem
            if req.requires_grad:
                return (f"backward: FlexAttention on CPU is inference-only in torch {torch.__version__} (q/k/v "
                        "requiring grad raise, captured score-mod tensors requiring grad fail to compile); "
                        "run under torch.no_grad() or use backend='reference'")
            if req.return_lse:
                return (f"return_lse=True: FlexAttention's compiled CPU kernel does not return the log-sum-exp in "
                        f"torch {torch.__version__}")
        elif req.device.type == "cuda":
            if min(req.Dqk, req.Dv) < 16:
                return f"head dims below 16 (Dqk={req.Dqk}, Dv={req.Dv}): FlexAttention's Triton kernel needs >= 16"
        else:
            return f"device {req.device.type}: this backend drives FlexAttention on CPU and CUDA only"
        return _compile_problem()

    def is_compiled(self, req: Request) -> bool:
        """True when this request's signature was already compiled (and run) in this process."""
        return _signature(req) in _compiled

    def estimate(self, req: Request) -> Estimate:
        dev = req.device.type
        rate = NOMINAL_FLOPS.get(dev, NOMINAL_FLOPS["cpu"])
        bq, bk = BLOCK_SIZE
        states = None if req.mask is None else req.mask.block_map(req.Nq, req.Nk, bq, bk, B=req.B, H=req.Hq,
                                                                       device=req.device)
        tiles = math.ceil(req.Nq / bq) * math.ceil(req.Nk / bk)
        if states is None:
            full, partial = float(tiles * req.B), 0.0
        else:
            per_row = req.B / states.shape[0]
            full = float((states == FULL).sum()) * per_row
            partial = float((states == PARTIAL).sum()) * per_row
        tile_flops = 2.0 * req.Hq * bq * bk * (req.Dqk + req.Dv)
        seconds = (full + _PARTIAL_TILE_COST * partial) * tile_flops / rate + _CALL_OVERHEAD_S
        visited = (full + partial) / max(tiles * req.B, 1)
        work = f"{visited:.0%} of tiles ({int(full)} full, {int(partial)} partial)"
        pred = predicate_seconds(req)  # the BlockMask is built from the block map on every call
        if pred:
            seconds += pred
            work += f", mask predicate on every pair per call (~{format_seconds(pred)})"
        if self.is_compiled(req):
            return Estimate(seconds, f"{work}, compiled kernel cached")
        compile_s = (_COMPILE_S if _compiled else _FIRST_COMPILE_S).get(dev, _COMPILE_S["cuda"])
        return Estimate(seconds + compile_s, f"{work}, compile will be paid (~{compile_s:.0f} s)")

    def run(self, req: Request) -> AttentionOutput:
        if req.sinks is not None and req.B * req.Hq * req.Nq > 0:
            return self.run(_with_sink_key(req))
        if req.B * req.Hq * req.Nq == 0 or req.Nk == 0:  # nothing to compile: empty output or no keys
            out = req.q.new_zeros(req.B, req.Hq, req.Nq, req.Dv)
            lse = torch.full((req.B, req.Hq, req.Nq), float("-inf"), device=req.device)
            return AttentionOutput(out, lse)
        problem = _dynamo_problem()
        if problem is not None:
            raise RuntimeError(f"attention: backend 'flex' cannot run: {problem}")
        from torch._dynamo import config as dynamo_config

        block_mask = to_block_mask(req.mask, req.Nq, req.Nk, device=req.device, with_q_blocks=req.requires_grad,
                                   B=req.B, H=req.Hq)
        score_mod = None if req.score_mod is None else _score_mod(req.score_mod, req.Nq, req.Nk)
        want_lse = req.device.type != "cpu"  # CPU has none (declined); CUDA uses it to zero empty rows
        sig = _signature(req)
        with dynamo_config.patch(recompile_limit=_RECOMPILE_LIMIT, accumulated_recompile_limit=_RECOMPILE_LIMIT):
            try:
                result = _compiled_flex()(req.q, req.k, req.v, score_mod=score_mod, block_mask=block_mask,
                                          scale=req.scale, enable_gqa=req.Hq != req.Hkv, **_lse_kwargs(want_lse))
            except Exception as e:
                if sig in _compiled:
                    raise
                raise RuntimeError(
                    f"attention: backend 'flex' failed to compile {req.describe()} with mask={req.mask!r}, "
                    f"score_mod={req.score_mod!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
                    "A mask or modifier given as a function must be traceable by torch.compile (tensor ops, no "
                    "Python branching on values); use backend='tiled' or 'reference' otherwise"
                ) from e
        if sig not in _compiled:
            _compiled.add(sig)
            state_changed()  # this signature's estimate no longer pays compile time
        if not want_lse:  # Flex on CPU returns zeros for a row of NaN scores: the contract wants NaN
            return AttentionOutput(restore_nonfinite(req, result)[0], None)  # type: ignore[arg-type]
        out, aux = result
        lse = getattr(aux, "lse", aux)  # (B, Hq, Nq) float32, natural log
        out = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device),
                          out)
        return AttentionOutput(*restore_nonfinite(req, out, lse))
