"""The ``paged`` backend: attention over a paged KV cache's block pools where the blocks lie (block-pool operands,
``qkv.attention(q, k_pool, v_pool, paged=qkv.PagedKV(block_tables, kv_positions, q_positions, window))``), and
the step's write into the pools (:meth:`PagedBackend.store`). Its paths, which ``qkv.explain`` names with the
reason (:meth:`PagedBackend.path`):

- ``compiled``: qkv's compiled CPU kernels through :mod:`qkv.cpu.ops` (``paged_decode`` for one query per row,
  ``paged_prefill`` for a prompt chunk, ``paged_store`` for the write): CPU, float32/float64, no gradients, the
  kernels built here (``qkv.cpu.ops.unavailable_reason()`` says why not);
- ``triton``: the Triton paged-decode kernel (:func:`qkv.backends.triton.decode.paged_decode`) for one query per
  row on CUDA without gradients;
- ``blocks``: torch ops over each row's live blocks (below), for a one-query step of float32/float64 rows ragged
  enough (:data:`BLOCKS_BELOW_FILL`, :data:`BLOCKS_MIN_SLOTS`) where the compiled kernel cannot run;
- ``view``: torch ops over the rows' gathered view under the positions mask (any dtype, accumulating low
  precisions in float32; gradients flow), everywhere else.

One decode step over a paged KV cache in torch ops: each row reads its own live blocks, with no padding.

The Triton kernel (:func:`qkv.backends.triton.decode.paged_decode`) reads the blocks in place on a GPU. Elsewhere
the cache used to gather every row's blocks into one padded ``(B, H, nb * T, D)`` view (``nb`` the longest
row's block count) and run SDPA over it, so a batch of mixed lengths (continuous batching: rows from a few
tokens to the whole context) copied, then read, padding up to the longest row: on ``benchmarks/vs_vllm.py``'s
request stream that was about twice the live keys.

Here each row reads its table from its first live block to its last (a block is live when one of its slots
holds a key the row's query may see), in spans of whole blocks (:data:`SPAN_TOKENS` keys), gathered without
padding beyond a row's last span, ``(Hkv, n, S * T, D)``; each span's scores are one small GEMM with its row's
query heads ``(G, D) x (D, S * T)`` (GQA without repeating K/V), and the rows' softmax is assembled from the
spans' partial results (split softmax: a maximum and a sum per row, as flash-decoding merges its key splits; Dao
et al. 2023, "Flash-Decoding for long-context inference"), so no ``(B, Hq, nb * T)`` tensor exists.
The result is attention over each row's keys at or before its query's position (within the window when one is
given), equal to SDPA's within float32 rounding; a row with no visible key returns zeros and ``lse = -inf``.

On CPU, with qkv's compiled kernels built (:mod:`qkv.cpu.ops`) and no gradients asked for, the step runs the
compiled paged-decode kernel instead (``qkv/cpu/csrc/paged_decode.cpp``): per row and KV head it walks the row's
table, skips blocks with no visible slot, and reads the visible keys and values from the pools where they lie,
spans of whole blocks merged by an online softmax: no gathered span, no slot lists, no per-span torch ops.

A prompt chunk (several queries per row: :func:`paged_prefill_blocks`) is read the same way by the compiled
prefill kernel (``qkv/cpu/csrc/paged_prefill.cpp``): per row, KV head and tile of queries, the slots some query of
the tile may see, in spans whose score and value products are GEMMs, merged by an online softmax
(FlashAttention's, Dao et al. 2022, arXiv:2205.14135); the keys past a causal tile's last query are never read.
Without the compiled kernels it attends over the gathered view under the positions mask.

Shape legend: B rows, Hq query heads, Hkv KV heads, G = Hq / Hkv, P pool blocks, T tokens per block, NB table
entries per row, S blocks per span, n spans of the step, D / Dv key / value head dims.
"""

from __future__ import annotations

import torch

from .._paged import gather_head_major
from .._request import AttentionOutput, Request
from ..cpu import ops
from .base import NOMINAL_FLOPS, Backend, Estimate, dense_flops

__all__ = ["PagedBackend", "paged_decode_blocks", "paged_prefill_blocks", "blocks_compiled", "gather_head_major",
           "check_paged_args", "BLOCKS_DTYPES", "DECODE_DTYPES", "SPAN_TOKENS", "BLOCKS_BELOW_FILL", "BLOCKS_MIN_SLOTS"]

#: Keys per GEMM: a row's live blocks are read in spans of this many tokens (whole blocks, at least one), so each
#: score product is (G, D) x (D, SPAN_TOKENS) rather than one block wide; block-wide products ran at about half
#: the rate of 64-key ones on CPU (benchmarks/decode.py's ``paged_cpu`` table measures the path as a whole).
SPAN_TOKENS = 64

#: Dtypes the block path computes in (its softmax runs in the query's dtype): float32 and float64. Lower precisions
#: keep the gathered view and SDPA, which accumulates them in float32.
BLOCKS_DTYPES = (torch.float32, torch.float64)
#: Dtypes of a decode step (one query per row) the compiled kernel takes: those and bfloat16 pools, read in place and
#: computed in float32 (without the kernels a bfloat16 step keeps the gathered view).
DECODE_DTYPES = BLOCKS_DTYPES + (torch.bfloat16,)

#: Without qkv's compiled CPU kernels (which serve every CPU decode step), the block path (:func:`_blocks`) serves a
#: CPU decode step when the step's rows fill at most this share of the padded view, and the view holds at least
#: BLOCKS_MIN_SLOTS slots: on benchmarks/decode.py's ``paged_cpu`` table fuller views go faster padded (one product
#: over long rows beats many span-sized GEMMs) and small ones too (the block path's fixed cost, a few dozen small
#: ops), while a request stream's ragged rows (about half full) go faster by blocks.
BLOCKS_BELOW_FILL = 0.7
BLOCKS_MIN_SLOTS = 8192


def paged_decode_blocks(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                        kv_positions: torch.Tensor, q_positions: torch.Tensor, *, scale: float | None = None,
                        window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per row over the row's blocks of a paged cache.

    Args:
        q: (B, Hq, D) the step's queries (float32, float64 or bfloat16: computed in float32, rounded once).
        k_pool: (P, Hkv, T, D) and v_pool (P, Hkv, T, Dv): the layer's block pools, q's dtype and device.
        block_tables: (B, NB) integer block ids per row, any filler block where a row has fewer.
        kv_positions: (B, NB * T) integer position of each slot in table order, ``-1`` where empty.
        q_positions: (B,) integer position of each row's query: a row sees the slots at or before it.
        scale: default ``D ** -0.5``.
        window: keep slots with ``q_pos - kv_pos < window`` (HF ``sliding_window``), or None.

    Returns:
        out (B, Hq, Dv) and lse (B, Hq), both in q's dtype.

    Example:
        >>> import torch
        >>> k_pool, v_pool = torch.randn(2, 4, 1, 2, 8).unbind(0)   # 4 blocks of 2 tokens, one KV head
        >>> q = torch.randn(1, 2, 8)                                 # one row, two query heads
        >>> tables, pos = torch.tensor([[3, 1]]), torch.tensor([[0, 1, 2, -1]])
        >>> out, lse = paged_decode_blocks(q, k_pool, v_pool, tables, pos, torch.tensor([2]))
        >>> k = torch.cat([k_pool[3, 0], k_pool[1, 0, :1]]); v = torch.cat([v_pool[3, 0], v_pool[1, 0, :1]])
        >>> ref = torch.softmax(q[0] @ k.T / 8 ** 0.5, -1) @ v
        >>> torch.allclose(out[0], ref, atol=1e-6)
        True
    """
    check_paged_args("paged_decode_blocks", q, k_pool, v_pool, block_tables, kv_positions, q_positions)
    if q.dtype not in DECODE_DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"paged_decode_blocks: q, k_pool and v_pool must share one of float32/float64/bfloat16, got "
                        f"{q.dtype}, {k_pool.dtype}, {v_pool.dtype}; other precisions go through the gathered view")
    # a profile names the step (qkv::paged_decode_blocks) and counts its work as attention
    return ops.profiled("paged_decode_blocks", _decode_step, q, k_pool, v_pool, block_tables, kv_positions,
                            q_positions, scale, window)


def _decode_step(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window):
    if blocks_compiled(q, k_pool, v_pool) and (window is None or window >= 1):  # the kernel reads <= 0 as none
        return _compiled(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window)
    if q.dtype not in BLOCKS_DTYPES:  # bfloat16 by the torch ops: in float32, as the kernel computes, rounded once
        out, lse = _blocks(q.float(), k_pool.float(), v_pool.float(), block_tables, kv_positions, q_positions, scale,
                           window)
        return out.to(q.dtype), lse.to(q.dtype)
    return _blocks(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window)


def paged_prefill_blocks(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                         kv_positions: torch.Tensor, q_positions: torch.Tensor, *, scale: float | None = None,
                         window: int | None = None, causal: bool = True,
                         sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of several queries per row (a prompt chunk) over the row's blocks of a paged cache.

    Args:
        q: (B, Hq, N, D) the step's queries (float32 or float64), any strides with a unit last one.
        k_pool: (P, Hkv, T, D) and v_pool (P, Hkv, T, Dv): the layer's block pools, q's dtype and device.
        block_tables: (B, NB) integer block ids per row, any filler block where a row has fewer.
        kv_positions: (B, NB * T) integer position of each slot in table order, ``-1`` where empty.
        q_positions: (B, N) integer position of each query, ``-1`` for a padding query (its output is zeros).
        scale: default ``D ** -0.5``.
        window: keep slots with ``q_pos - kv_pos < window`` (HF ``sliding_window``), or None.
        causal: a query sees the slots at or before its position (False: every filled slot).
        sinks: (Hq,) sink logits (GPT-OSS): one more logit in each softmax's denominator, with no value.

    Returns:
        out (B, Hq, N, Dv) and lse (B, Hq, N), both in q's dtype; a query with no visible slot gives zeros and
        ``lse = -inf``.

    On CPU with qkv's compiled kernels built and no gradient asked for, the compiled kernel
    (``qkv/cpu/csrc/paged_prefill.cpp``) reads the visible slots from the pools where they lie, tile by tile of
    queries, and skips the slots no query of a tile may see (past a causal chunk's tile). Elsewhere the rows'
    blocks are gathered into one padded view (:func:`gather_head_major`) and attended in torch ops under the
    positions mask.

    Example:
        >>> import torch
        >>> k_pool, v_pool = torch.randn(2, 4, 1, 2, 8).unbind(0)   # 4 blocks of 2 tokens, one KV head
        >>> q = torch.randn(1, 2, 3, 8)                              # one row, two query heads, three queries
        >>> tables, pos = torch.tensor([[3, 1]]), torch.tensor([[0, 1, 2, -1]])
        >>> out, lse = paged_prefill_blocks(q, k_pool, v_pool, tables, pos, torch.tensor([[0, 1, 2]]))
        >>> k = torch.cat([k_pool[3, 0], k_pool[1, 0, :1]]); v = torch.cat([v_pool[3, 0], v_pool[1, 0, :1]])
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(out, ref, atol=1e-6)
        True
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"paged_prefill_blocks: q must be a (B, Hq, N, D) tensor, got "
                         f"{tuple(getattr(q, 'shape', ())) or type(q).__name__}")
    B, Hq, N, D = q.shape
    if not isinstance(q_positions, torch.Tensor) or tuple(q_positions.shape) != (B, N):
        raise ValueError(f"paged_prefill_blocks: q_positions must be (B, N) = ({B}, {N}), got "
                         f"{tuple(getattr(q_positions, 'shape', ())) or type(q_positions).__name__}")
    check_paged_args("paged_prefill_blocks", q[:, :, 0] if N else q.new_empty(B, Hq, D), k_pool, v_pool,
                     block_tables, kv_positions, q_positions[:, 0] if N else q_positions.new_zeros(B))
    if q.dtype not in BLOCKS_DTYPES or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"paged_prefill_blocks: q, k_pool and v_pool must share one of float32/float64, got "
                        f"{q.dtype}, {k_pool.dtype}, {v_pool.dtype}; lower precisions go through the gathered view")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"paged_prefill_blocks: window must be an int >= 1 (keys per query) or None, got {window!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (Hq,)):
        raise ValueError(f"paged_prefill_blocks: sinks must be a ({Hq},) tensor, one logit per query head, got "
                         f"{tuple(getattr(sinks, 'shape', ())) or type(sinks).__name__}")
    scale = D ** -0.5 if scale is None else float(scale)
    # a profile names the step (qkv::paged_prefill_blocks) and counts its work as attention
    return ops.profiled("paged_prefill_blocks", _prefill_step, q, k_pool, v_pool, block_tables, kv_positions,
                            q_positions, scale, window, causal, sinks)


def _prefill_step(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window, causal, sinks):
    if blocks_compiled(q, k_pool, v_pool) and q.stride(-1) == 1:
        try:
            return ops.paged_prefill(q, k_pool, v_pool, _long(block_tables), _long(kv_positions),
                                     _long(q_positions), scale, 0 if window is None else window, bool(causal), sinks)
        except RuntimeError as e:  # the one data-dependent check the kernel makes
            if "outside the pool" not in str(e):
                raise
            raise ValueError(f"paged_prefill_blocks: block_tables name a block outside the pool of "
                             f"{k_pool.shape[0]} blocks ({str(e).splitlines()[0]}); tables "
                             "must hold pool block ids") from None
    return _prefill_view(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window, causal, sinks)


def _prefill_view(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window, causal, sinks):
    """:func:`paged_prefill_blocks` in torch ops: the rows' blocks gathered into one padded view, scores under
    the positions mask, the softmax with its sinks."""
    B, Hq, N, D = q.shape
    Hkv = k_pool.shape[1]
    G = Hq // Hkv
    out_dtype = q.dtype
    if q.dtype not in BLOCKS_DTYPES:  # low precisions accumulate in float32, as SDPA does
        q = q.float()
    if B * block_tables.shape[1] and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < k_pool.shape[0]:
        raise ValueError(f"paged_prefill_blocks: block_tables name a block outside the pool of {k_pool.shape[0]} "
                         f"blocks (ids {int(block_tables.min())} .. {int(block_tables.max())}); tables must hold pool "
                         "block ids")
    k, v = gather_head_major(k_pool, block_tables), gather_head_major(v_pool, block_tables)  # (B, Hkv, S, D)
    k, v = k.to(q.dtype), v.to(q.dtype)
    pos, qpos = kv_positions.view(B, 1, 1, -1), q_positions.view(B, 1, N, 1)
    seen = (pos >= 0) & (qpos >= 0)
    if causal:
        seen &= pos <= qpos
    if window is not None:
        seen &= qpos - pos < window
    s = torch.matmul(q.reshape(B, Hkv, G * N, D), k.transpose(-1, -2)).mul_(scale).view(B, Hq, N, k.shape[2])
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, Hq, 1, 1).expand(B, Hq, N, 1)], -1)
    lse = torch.logsumexp(s, -1).masked_fill(q_positions.view(B, 1, N) < 0, float("-inf"))  # padding: no sink
    alive = lse != float("-inf")  # a NaN score keeps its row NaN
    p = torch.where(alive.unsqueeze(-1), (s - lse.unsqueeze(-1)).exp(), 0.0)
    if sinks is not None:
        p = p[..., :-1]
    out = torch.matmul(p.reshape(B, Hkv, G * N, k.shape[2]), v).view(B, Hq, N, v.shape[-1])
    return out.to(out_dtype), lse


def blocks_compiled(*tensors: torch.Tensor) -> bool:
    """Whether :func:`paged_decode_blocks` runs the compiled kernel for these tensors: all on CPU, none needing a
    gradient, and qkv's CPU kernels built (:func:`qkv.cpu.ops.unavailable_reason` says why not)."""
    if any(t.device.type != "cpu" for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return ops.available()


def _visible(pos: torch.Tensor, qpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Slots holding a key the row's query may see: filled, at or before the query, within the window if any."""
    seen = (pos >= 0) & (pos <= qpos)
    if window is not None:
        seen &= qpos - pos < window
    return seen


def _compiled(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window):
    """:func:`paged_decode_blocks` by the compiled kernel (``qkv/cpu/csrc/paged_decode.cpp``), which reads each
    row's visible slots from the pools where they lie."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q = q if q.stride(-1) == 1 else q.contiguous()  # the kernel reads rows of unit stride
    try:
        return ops.paged_decode(q, k_pool, v_pool, _long(block_tables), _long(kv_positions), _long(q_positions), scale,
                                0 if window is None else int(window), True, None)
    except RuntimeError as e:  # the one data-dependent check the kernel makes
        if "outside the pool" not in str(e):
            raise
        first = str(e).splitlines()[0]
        raise ValueError(f"paged_decode_blocks: block_tables name a block outside the pool of {k_pool.shape[0]} "
                         f"blocks ({first}); tables must hold pool block ids") from None


def _long(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def check_paged_args(fn: str, q, k_pool, v_pool, block_tables, kv_positions, q_positions) -> None:
    """Raise ``ValueError`` (naming ``fn``) unless the arguments of a paged decode step have the ranks and agreeing
    shapes both decode paths take: q (B, Hq, D), pools (P, Hkv, T, D | Dv), tables (B, NB), kv_positions
    (B, NB * T), q_positions (B,), ``Hq % Hkv == 0``."""
    for name, t, dim in (("q", q, 3), ("k_pool", k_pool, 4), ("v_pool", v_pool, 4), ("block_tables", block_tables, 2),
                         ("kv_positions", kv_positions, 2), ("q_positions", q_positions, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dim:
            raise ValueError(f"{fn}: {name} must be a {dim}-D tensor, got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
    B, Hq, D = q.shape
    P, Hkv, T, Dk = k_pool.shape
    NB = block_tables.shape[1]
    if Dk != D or v_pool.shape[:3] != k_pool.shape[:3] or Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{fn}: q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)} "
                         "disagree (need k_pool (P, Hkv, T, D), v_pool (P, Hkv, T, Dv), Hkv >= 1, Hq % Hkv == 0)")
    if block_tables.shape[0] != B or tuple(kv_positions.shape) != (B, NB * T) or q_positions.shape[0] != B:
        raise ValueError(f"{fn}: block_tables {tuple(block_tables.shape)}, kv_positions {tuple(kv_positions.shape)}, "
                         f"q_positions {tuple(q_positions.shape)} must be (B, NB), (B, NB * T) = ({B}, {NB * T}) "
                         "and (B,)")


def _blocks(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window):
    """:func:`paged_decode_blocks` on checked arguments."""
    B, Hq, D = q.shape
    Hkv, T = k_pool.shape[1], k_pool.shape[2]
    NB = block_tables.shape[1]
    Dv, G = v_pool.shape[3], Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    if B * NB and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < k_pool.shape[0]:
        raise ValueError(f"paged_decode_blocks: block_tables name a block outside the pool of {k_pool.shape[0]} "
                         f"blocks (ids {int(block_tables.min())} .. {int(block_tables.max())}); tables must hold pool "
                         "block ids")
    S = max(1, SPAN_TOKENS // T)  # blocks per span
    pad = S - 1  # a row's last span may run past its table: filler entries, no visible slot
    tables = torch.nn.functional.pad(block_tables, (0, pad), value=int(block_tables[0, 0]) if B * NB else 0)
    pos = torch.nn.functional.pad(kv_positions, (0, pad * T), value=-1).view(B, NB + pad, T)
    seen = _visible(pos, q_positions.view(B, 1, 1), window)
    live = seen.any(-1).to(torch.int8)  # (B, NB + pad)
    any_live = live.amax(1) > 0
    first = live.argmax(1)  # a row's first and last live blocks (dead ones between them are masked below)
    last = live.shape[1] - 1 - live.flip(1).argmax(1)
    spans = torch.where(any_live, -(-(last - first + 1) // S), 0)  # (B,)
    rows = torch.repeat_interleave(torch.arange(B, device=q.device), spans)  # (n,) the row of each span
    out = q.new_zeros(Hkv, B, G, Dv)
    lse = q.new_full((Hkv, B, G), float("-inf"))
    if rows.numel() == 0:
        return out.permute(1, 0, 2, 3).reshape(B, Hq, Dv), lse.transpose(0, 1).reshape(B, Hq)
    n = rows.numel()
    ends = spans.cumsum(0)
    j = torch.arange(n, device=q.device) - (ends - spans).index_select(0, rows)  # span index within its row
    slot = (first.index_select(0, rows) + j * S).view(n, 1) + torch.arange(S, device=q.device)  # (n, S)
    ids = tables[rows.view(n, 1), slot]  # (n, S) block ids, row by row
    keep = seen[rows.view(n, 1), slot].view(1, n, 1, S * T)
    kb, vb = (gather_head_major(p, ids.view(n, S)).transpose(0, 1) for p in (k_pool, v_pool))  # (Hkv, n, S*T, D)
    qb = q.view(B, Hkv, G, D).index_select(0, rows).transpose(0, 1)  # (Hkv, n, G, D)
    s = (torch.matmul(qb, kb.transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf"))  # (Hkv, n, G, S * T)
    at = rows.view(1, n, 1).expand(Hkv, n, G)
    row_max = torch.full((Hkv, B, G), float("-inf"), dtype=s.dtype, device=s.device)
    row_max.scatter_reduce_(1, at, s.amax(-1), "amax")  # finite: a row with spans has a visible key
    p = (s - row_max.index_select(1, rows).unsqueeze(-1)).exp()  # masked slots 0; out of place for autograd
    total = q.new_zeros(Hkv, B, G).index_add_(1, rows, p.sum(-1))
    out.index_add_(1, rows, torch.matmul(p, vb))
    alive = total != 0  # a NaN total (a NaN or +inf score) keeps its row NaN: never the empty-row marker
    out = torch.where(alive.unsqueeze(-1), out / total.clamp_min(torch.finfo(q.dtype).tiny).unsqueeze(-1), 0.0)
    lse = torch.where(alive, torch.where(row_max == float("inf"), row_max, row_max + total.log()), lse)
    return out.permute(1, 0, 2, 3).reshape(B, Hq, Dv), lse.transpose(0, 1).reshape(B, Hq)


def _view_sdpa(q, k_pool, v_pool, block_tables, kv_positions, q_positions, scale, window) -> torch.Tensor:
    """The rows' gathered view attended by torch's fused SDPA under the causal positions mask (what the cache did
    before the paged backend existed: on a GPU a prompt chunk takes a flash or memory-efficient kernel, not a
    materialized score matrix). A query with no visible key (padding) gives zeros, not SDPA's NaN."""
    B, Hq, N, D = q.shape
    k, v = gather_head_major(k_pool, block_tables), gather_head_major(v_pool, block_tables)  # (B, Hkv, S, D)
    pos, qpos = kv_positions.view(B, 1, 1, -1), q_positions.view(B, 1, N, 1)
    seen = (pos >= 0) & (qpos >= 0) & (pos <= qpos)
    if window is not None:
        seen &= qpos - pos < window
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale,
                                                           enable_gqa=Hq != k.shape[1])
    return out.masked_fill(~seen.any(-1, keepdim=True), 0.0)  # (B, 1, N, 1): rows with no visible key


#: The last answer of :func:`_ragged`: (the positions, their version counter, the thresholds, the answer). Every layer
#: of a group reads the same positions tensor in a step, so the count and its sync run once per step and group.
_last_ragged: tuple = (None, -1, None, False)


def _ragged(kv_positions: torch.Tensor) -> bool:
    """The view holds at least BLOCKS_MIN_SLOTS slots, at most BLOCKS_BELOW_FILL of them live."""
    global _last_ragged
    last, version, limits, answer = _last_ragged
    if last is kv_positions and version == kv_positions._version and limits == (BLOCKS_MIN_SLOTS, BLOCKS_BELOW_FILL):
        return answer
    n = kv_positions.numel()
    answer = n >= BLOCKS_MIN_SLOTS and int((kv_positions >= 0).sum()) <= BLOCKS_BELOW_FILL * n
    _last_ragged = (kv_positions, kv_positions._version, (BLOCKS_MIN_SLOTS, BLOCKS_BELOW_FILL), answer)
    return answer


class PagedBackend(Backend):
    """Block-pool operands (``paged=``), served in place: compiled CPU kernels, the Triton decode kernel, or torch
    ops by blocks or over the gathered view (see the module notes); every valid paged request has a path."""

    name = "paged"
    paged_operands = True

    def decline(self, req: Request) -> str | None:
        return None

    def _kind(self, req: Request) -> str:
        q, kp, vp = req.q, req.k, req.v
        one = q.shape[2] == 1
        if one:
            from .triton import gpu_decode_ready  # CUDA, no gradients, triton installed

            if gpu_decode_ready(q, kp, vp):
                return "triton"
        if q.device.type == "cuda":
            return "view"
        if (q.dtype not in (DECODE_DTYPES if one else BLOCKS_DTYPES) or (torch.is_grad_enabled() and req.requires_grad)
                or q.device.type != "cpu"):
            return "view"
        if ops.available() and (one or q.stride(-1) == 1):
            return "compiled"
        return "blocks" if one and q.dtype in BLOCKS_DTYPES and _ragged(req.paged.kv_positions) else "view"

    def path(self, req: Request) -> str:
        kind = self._kind(req)
        kernel = "paged_decode" if req.Nq == 1 else "paged_prefill"
        if kind == "compiled":
            return (f"compiled {kernel.replace('_', '-')} kernel (qkv.cpu.ops.{kernel}): CPU, "
                    f"{str(req.dtype).replace('torch.', '')}, no gradients; reads each row's visible slots in place")
        if kind == "triton":
            return "Triton paged-decode kernel (qkv.backends.triton.decode.paged_decode): one query per row on CUDA"
        if req.device.type == "cuda":
            why = ("the Triton kernel takes one query per row" if req.Nq > 1
                   else "the Triton decode kernel cannot run (no triton, gradients or an unsupported dtype)")
        elif req.dtype not in (DECODE_DTYPES if req.Nq == 1 else BLOCKS_DTYPES):
            takes = ("decode kernel takes float32/float64/bfloat16" if req.Nq == 1
                     else "prefill kernel takes float32/float64")
            why = f"the compiled {takes}, got {str(req.dtype).replace('torch.', '')}"
        elif req.requires_grad:
            why = "gradients are asked for and the compiled kernels have no backward"
        elif req.device.type != "cpu":
            why = f"the compiled kernels run on CPU, not {req.device.type}"
        elif ops.unavailable_reason() is not None:
            why = f"qkv's compiled CPU kernels are unavailable ({ops.unavailable_reason()})"
        else:
            why = "the compiled prefill kernel needs q with a unit last stride"
        if kind == "blocks":
            return (f"torch ops by blocks (rows ragged: at most {BLOCKS_BELOW_FILL:.0%} of a view of >= "
                    f"{BLOCKS_MIN_SLOTS} slots live), because {why}")
        return f"torch ops over the gathered view, because {why}"

    def estimate(self, req: Request) -> Estimate:
        seconds = dense_flops(req) / NOMINAL_FLOPS.get(req.device.type, NOMINAL_FLOPS["cpu"]) + 5e-6
        return Estimate(seconds, f"{self._kind(req)} path over the tables' {req.Nk} slots per row")

    def run(self, req: Request) -> AttentionOutput:
        return ops.profiled("paged_attention", self._run, req)

    def _run(self, req: Request) -> AttentionOutput:
        kind = self._kind(req)
        q, kp, vp = req.q, req.k, req.v
        tables, kv_pos, q_pos, window = req.paged
        if kind == "compiled" and q.shape[2] > 1:
            return AttentionOutput(*_prefill_step(q, kp, vp, tables, kv_pos, q_pos, req.scale, window, True, None))
        if kind == "view":
            if not req.return_lse:  # torch's fused SDPA over the view (its lse is not exposed)
                return AttentionOutput(_view_sdpa(q, kp, vp, tables, kv_pos, q_pos, req.scale, window), None)
            return AttentionOutput(*_prefill_view(q, kp, vp, tables, kv_pos, q_pos, req.scale, window, True, None))
        if kind == "triton":
            from .triton.decode import paged_decode

            out, lse = paged_decode(q[:, :, 0], kp, vp, tables, kv_pos, q_pos[:, 0], scale=req.scale, window=window)
        else:  # one query per row: the compiled kernel, or the torch block path
            out, lse = (_compiled if kind == "compiled" else _blocks)(q[:, :, 0], kp, vp, tables, kv_pos, q_pos[:, 0],
                                                                      req.scale, window)
        return AttentionOutput(out.unsqueeze(2), lse.unsqueeze(2) if req.return_lse or req.sinks is not None else None)

    def store(self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              blocks: torch.Tensor, offsets: torch.Tensor, real: torch.Tensor, src: torch.Tensor | None) -> None:
        """Write a step's real tokens into their slots: token ``i`` of the step (``real`` (B, n) True, in row-major
        order) goes to slot ``offsets[i]`` of block ``blocks[i]`` of ``k_pool`` (P, H, T, Dk) and ``v_pool``
        (P, H, T, Dv), from ``k`` (B, H, n, Dk) and ``v`` (B, H, n, Dv). ``src``: the real tokens' flat indices
        ``b * n + t`` (CPU), for the compiled kernel (:func:`qkv.cpu.ops.paged_store`, one call); without it,
        or where that kernel cannot run (another device or dtype, gradients), torch's indexed assignment."""
        if (src is not None and k.device.type == "cpu" and k.dtype == v.dtype == k_pool.dtype == v_pool.dtype
                and k.stride(-1) == 1 and v.stride(-1) == 1
                and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)) and ops.available()):
            ops.paged_store(k_pool, v_pool, k, v, blocks, offsets, src)
        else:
            k_pool[blocks, :, offsets] = k.transpose(1, 2)[real]  # (n_real, H, Dk)
            v_pool[blocks, :, offsets] = v.transpose(1, 2)[real]

