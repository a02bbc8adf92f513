"""The gather backend: attention that reads only the keys each query lists (``masks.topk``), O(Nq·K) work.

Sparse attention by selection (DeepSeek Sparse Attention, DeepSeek-AI 2025, "DeepSeek-V3.2-Exp"; MoBA, Lu et al.
2025, arXiv:2502.13189) lists for every query row the K keys worth reading. Where K is small against Nk, reading
the listed keys and values and attending over those K columns does ``4·B·Hq·Nq·K·D`` FLOPs instead of
``4·B·Hq·Nq·Nk·D``, with no (Nq, Nk) tensor anywhere. The request's mask must be ``topk(idx)`` or a conjunction
with it (``topk(idx) & causal() & padding(...)``); the other terms, the score modifiers and the sinks are
evaluated at the gathered keys' positions, so the result equals dense masked attention exactly.

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq / Hkv, Hx list heads (Hkv when one list is
shared by the heads, Hq when each query head has its own), c query rows of a chunk, K listed keys, D head dim.

Lists shared by all heads (DSA's indexer picks one set per token) gather each key once per KV head and let its G
query heads read it (GQA without repeating K/V); per-head lists gather per query head. Query rows go in chunks
whose gathered keys fit a few MB; under autograd each chunk is checkpointed (recomputed in the backward), so
training keeps O(Nq·K) memory, and the gradients are exact (plain autograd through the gather, i.e. a
scatter-add into dK and dV).

On CPU, a call that needs no gradient (inference, a decode step) runs qkv's compiled kernel instead
(``qkv/cpu/csrc/gather_attention.cpp``, reached through :mod:`qkv.cpu.ops`): blocks of 64 query rows walk the keys
window by window (4,096 keys), so a key several rows list is read from memory once; per row and window the listed
keys are multiplied with the row's query heads in place (heads in vector lanes where they fill whole vectors,
else copied a tile at a time into a cache-resident buffer for the BLAS torch links), and merged with an online
softmax, so no gathered keys ever travel to memory and back. It takes float32
and float64, lists shared or per head, ``causal()`` terms (either alignment) and sinks; other mask terms, score
modifiers and calls under autograd take the torch ops above, and ``qkv.explain`` says which ran and why.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .._request import AttentionOutput, Request
from ..cpu import ops
from ..masks.base import And, Mask
from ..masks.causal import Causal
from ..masks.topk import TopK
from .base import NOMINAL_FLOPS, Backend, Estimate, format_work

__all__ = ["GatherBackend", "split_selection"]

#: Bytes of gathered keys and values per chunk of query rows. On CPU small enough that the product reads them from
#: cache right after the gather writes them (2 MB: one row of 2,048 listed 128-wide keys and values in float32; 10%
#: faster than 16 MB at N=4096 on the sparse_select inputs); elsewhere larger chunks, fewer launches.
_CHUNK_BYTES = 2 << 20
_CHUNK_BYTES_ACCELERATOR = 16 << 20


def split_selection(mask: Mask | None) -> tuple[TopK | None, list[Mask]]:
    """The ``topk`` term of a conjunction and the other terms: ``(TopK, [rest...])``, or ``(None, [])`` when the
    mask is not ``topk(...)`` nor an ``&`` of terms one of which is (an ``|`` may allow unlisted keys)."""
    terms: list[Mask] = []
    stack = [mask] if mask is not None else []
    while stack:
        m = stack.pop()
        if isinstance(m, And):
            stack += [m.b, m.a]
        else:
            terms.append(m)
    lists = [t for t in terms if isinstance(t, TopK)]
    if not lists:
        return None, []
    first = lists[0]
    return first, [t for t in terms if t is not first]


def _dedup_sorted(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted lists (.., K) and which entries are a listed key seen for the first time (not -1, not a repeat)."""
    srt = idx.sort(dim=-1).values
    first = srt >= 0
    first[..., 1:] &= srt[..., 1:] != srt[..., :-1]
    return srt, first


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, r0: int, req: Request,
           rest: list[Mask], sinks: torch.Tensor | None, acc: torch.dtype):
    """Attention of query rows ``r0 .. r0 + c`` over their listed keys: out (B, Hq, c, Dv), lse (B, Hq, c).

    ``q`` (B, Hq, c, Dqk); ``idx`` (B or 1, Hx, c, K) the rows' lists; ``k``/``v`` the whole (B, Hkv, Nk, D)."""
    B, Hq, c, _ = q.shape
    Hkv, Nk, Nq = k.shape[1], k.shape[2], req.Nq
    per_head = idx.shape[1] > 1
    Hx, G = (Hq, 1) if per_head else (Hkv, Hq // Hkv)
    srt, first = _dedup_sorted(idx.expand(B, -1, -1, -1))  # (B, Hx, c, K)
    # "no key" (-1) sorts first: keep only the columns some row of the chunk fills (early causal rows list
    # fewer than K keys)
    width = int((srt >= 0).sum(-1).max()) if srt.numel() else 0
    if 0 < width < srt.shape[-1]:
        srt, first = srt[..., -width:], first[..., -width:]
    K = srt.shape[-1]
    cols = srt.clamp_min(0)
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    kv_head = (torch.arange(Hx, device=q.device) // (Hq // Hkv) if per_head
               else torch.arange(Hx, device=q.device)).view(1, Hx, 1, 1)
    # One index_select over the flattened (B * Hkv * Nk) rows: a row copy per listed key, several times faster
    # than advanced indexing with three index tensors (whose backward is the same scatter-add).
    flat = ((b * Hkv + kv_head) * Nk + cols).reshape(-1)  # (B * Hx * c * K,)
    k_sel = k.reshape(-1, k.shape[-1]).index_select(0, flat).view(B, Hx, c, K, k.shape[-1]).to(acc)  # (.., Dqk)
    v_sel = v.reshape(-1, v.shape[-1]).index_select(0, flat).view(B, Hx, c, K, v.shape[-1]).to(acc)  # (.., Dv)
    qg = q.to(acc).view(B, Hx, G, c, -1).transpose(2, 3)  # (B, Hx, c, G, Dqk)
    s = req.scale * (qg @ k_sel.transpose(-1, -2))  # (B, Hx, c, G, K)
    # Index tensors of the (B, Hx, c*G, K) score view, for the other mask terms and the score modifiers.
    heads = (torch.arange(Hx, device=q.device).view(Hx, 1, 1) * G
             + torch.arange(G, device=q.device).view(1, 1, G)).expand(Hx, c, G).reshape(1, Hx, c * G, 1)
    rows = (r0 + torch.arange(c, device=q.device)).view(c, 1).expand(c, G).reshape(1, 1, c * G, 1)
    kv_idx = cols.unsqueeze(3).expand(B, Hx, c, G, K).reshape(B, Hx, c * G, K)
    s = s.reshape(B, Hx, c * G, K)
    if req.score_mod is not None:
        s = req.score_mod.apply(s, b, heads, rows, kv_idx, Nq, Nk).to(acc)
    allowed = first.unsqueeze(3).expand(B, Hx, c, G, K).reshape(B, Hx, c * G, K)
    for m in rest:
        allowed = allowed & m.allowed(b, heads, rows, kv_idx, Nq, Nk)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # one more softmax column without a value (qkv._sinks)
        sink = sinks.to(acc)[heads.view(Hx, c * G)].view(1, Hx, c * G, 1).expand(B, Hx, c * G, 1)
        s = torch.cat([s, sink], dim=-1)
    if s.shape[-1] == 0:  # no listed key and no sink: every row is empty
        return (q.new_zeros(B, Hq, c, v.shape[-1], dtype=acc),
                q.new_full((B, Hq, c), float("-inf"), dtype=acc))
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    empty = total == 0  # no allowed key; a NaN total (a NaN or +inf score) is not empty and stays NaN
    safe = torch.where(empty, torch.ones_like(total), total)
    p = e / safe
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(safe)).squeeze(-1)
    if sinks is not None:
        p = p[..., :K]
    out = p.view(B, Hx, c, G, K) @ v_sel  # (B, Hx, c, G, Dv)
    if sinks is not None and K == 0:  # no key column left to carry a NaN total (a NaN sink) into the row
        out = out.masked_fill(total.isnan().view(B, Hx, c, G, 1), float("nan"))
    out = out.transpose(2, 3).reshape(B, Hq, c, -1)
    return out, lse.view(B, Hx, c, G).transpose(2, 3).reshape(B, Hq, c)


class GatherBackend(Backend):
    """Reads only the listed keys of a ``masks.topk`` request: O(B·Hq·Nq·K·D) time, O(B·Hq·Nq·K) memory."""

    name = "gather"
    native_sinks = True

    def decline(self, req: Request) -> str | None:
        sel, _ = split_selection(req.mask)
        if sel is None:
            return ("the mask lists no keys: this path reads only the keys a masks.topk(indices) term lists "
                    "(alone or &-combined with other masks)")
        if req.dropout_p > 0:
            return "attention dropout is not implemented on the gather path"
        return None

    def estimate(self, req: Request) -> Estimate:
        sel, rest = split_selection(req.mask)
        K = sel.indices.shape[-1]
        Hx = req.Hq if sel.indices.shape[1] > 1 else req.Hkv
        flops = 2.0 * req.B * req.Hq * req.Nq * K * (req.Dqk + req.Dv)
        gathered = 4.0 * req.B * Hx * req.Nq * K * (req.Dqk + req.Dv)  # bytes of keys and values read
        rate = NOMINAL_FLOPS.get(req.device.type, NOMINAL_FLOPS["cpu"])
        why_not = _kernel_declines(req, rest)
        what = f"{K} listed keys per row, {format_work(flops)}, gathers {gathered / 1e6:.3g} MB"
        if why_not is None:  # reads the keys in place: product time plus the reads, no copy out and back
            return Estimate(flops / rate + gathered / 2e10 + 5e-5, f"{what} in place (compiled CPU kernel)")
        seconds = flops / (rate / 2) + gathered / 1e10 + 2e-4  # small batched products
        return Estimate(seconds, f"{what} as torch ops ({why_not})")

    def run(self, req: Request) -> AttentionOutput:
        sel, rest = split_selection(req.mask)
        for m in [sel, *rest]:
            m.check(req.B, req.Hq, req.Nq, req.Nk)
        if _kernel_declines(req, rest) is None:
            return _run_kernel(req, sel, rest)
        acc = torch.float64 if req.dtype == torch.float64 else torch.float32
        idx = sel.indices.to(req.device)
        Hx = req.Hq if idx.shape[1] > 1 else req.Hkv
        per_row = req.B * Hx * idx.shape[-1] * (req.Dqk + req.Dv) * torch.finfo(acc).bits // 8
        chunk_bytes = _CHUNK_BYTES if req.device.type == "cpu" else _CHUNK_BYTES_ACCELERATOR
        c = max(1, min(req.Nq, chunk_bytes // max(per_row, 1)))
        outs, lses = [], []
        track = req.requires_grad
        for r0 in range(0, req.Nq, c):
            r1 = min(req.Nq, r0 + c)
            args = (req.q[:, :, r0:r1], req.k, req.v, idx[:, :, r0:r1], r0, req, rest, req.sinks, acc)
            o, lse = checkpoint(_chunk, *args, use_reentrant=False) if track else _chunk(*args)
            outs.append(o)
            lses.append(lse)
        if not outs:  # no query rows
            outs, lses = [req.q.new_zeros(req.B, req.Hq, 0, req.Dv, dtype=acc)], [req.q.new_zeros(req.B, req.Hq, 0,
                                                                                                  dtype=acc)]
        out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
        lse = torch.cat(lses, 2) if len(lses) > 1 else lses[0]
        return AttentionOutput(out.to(req.dtype), lse if acc == torch.float64 else lse.to(torch.float32))


def _kernel_declines(req: Request, rest: list[Mask]) -> str | None:
    """Why the compiled CPU kernel does not take ``req`` (None: it does)."""
    if req.device.type != "cpu":
        return "not a CPU tensor"
    if req.dtype not in (torch.float32, torch.float64):
        return f"dtype {req.dtype} (the kernel takes float32 and float64)"
    if req.requires_grad:
        return "gradients needed (torch ops keep autograd exact)"
    if req.score_mod is not None:
        return "a score modifier"
    other = [m for m in rest if type(m) is not Causal]
    if other:
        return f"mask term {other[0]!r} (the kernel evaluates causal() terms only)"
    return ops.unavailable_reason()


def _run_kernel(req: Request, sel: TopK, rest: list[Mask]) -> AttentionOutput:
    offsets = [m._offset(req.Nq, req.Nk) for m in rest]  # keys past row + offset are dropped; the tightest wins
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (req.q, req.k, req.v))
    idx = sel.indices.to(device=req.device, dtype=torch.int64).contiguous()
    out, lse = ops.gather_attention(q, k, v, idx, float(req.scale), bool(offsets), min(offsets, default=0),
                                    req.sinks, ops.tile_keys(q.element_size(), req.Dqk))
    return AttentionOutput(out, lse if req.dtype == torch.float64 else lse.to(torch.float32))
