"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention`` whenever the request maps to it.

What maps: no mask, a causal mask (``is_causal=True`` is torch's top-left alignment, so bottom-right
causal with ``Nq != Nk`` is passed as a boolean mask instead), any other mask as a boolean
``attn_mask`` (materialized once, broadcast over heads/batch where the mask allows), additive score
modifiers folded into a float ``attn_mask``, GQA via ``enable_gqa``, ``Dv != Dqk``. What does not:
non-additive modifiers (softcap, user functions), ``return_lse`` (torch's public API does not return
the log-sum-exp) and dropout (torch draws it from its global RNG, so it cannot reproduce qkv's seeded
pattern). Those are declined with the reason.

Sinks (``qkv._sinks``) map as one more key: a zero key (score ``0`` before the bias) with a zero value,
whose additive mask column holds the sink logit ``z[h]``. That costs a K/V copy with one more row and a
materialized float mask, but no log-sum-exp; gradients reach the sinks through the float mask. Where nothing
needs a gradient on the CPU, the sinks are applied after the fact instead: the CPU flash kernel's log-sum-exp
``L`` of each row gives the keys' share ``sigmoid(L - z[h])`` of the softmax (no copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._request import AttentionOutput, Request
from ..masks.causal import Causal
from .base import NOMINAL_FLOPS, Backend, Estimate, dense_flops, format_size, predicate_seconds, restore_nonfinite

__all__ = ["SDPABackend"]

#: Below this many keys torch's CPU kernel reduces a score row within one vector register, where a NaN
#: score is dropped and the row returns zeros like a fully masked one (seen up to 7 keys in float32 with
#: AVX2, reported up to 15 with AVX-512). Only these calls pay the non-finite check.
_CPU_NAN_ROWS_BELOW = 16


def _is_causal_flag(req: Request) -> bool:
    """True when the mask is exactly torch's ``is_causal`` (top-left aligned lower triangle)."""
    m = req.mask
    return type(m) is Causal and (m.align == "top_left" or req.q.shape[2] == req.k.shape[2])


_CACHED_MASK_ELEMENTS = 1 << 20

#: With a materialized mask the CPU kernel still takes the softmax of every pair and reads the mask there:
#: measured (one thread, ``benchmarks/sparse.py`` training rows) at ~1.5 ns per pair at D = 16 for the dense
#: kernel and 0.2-0.9 ns more with a boolean mask, which the FLOP count misses. Counted for masked calls only,
#: where the tiled backend (whose estimate counts its own per-score passes) competes on the same terms.
_CPU_MASKED_PAIR_SECONDS = 1e-9


_BOTTOM_RIGHT: dict[tuple, torch.Tensor] = {}
_BOTTOM_RIGHT_HELD = 32


def _bottom_right_causal(nq: int, nk: int, device: torch.device) -> torch.Tensor:
    """(nq, nk) bool: query row ``i`` sees keys ``j <= i + nk - nq``. Cached (at most 32 held): a decode loop
    asks for the same one in every layer; SDPA only reads it. Built outside inference mode so that a later call
    with autograd may save it for backward."""
    key = (nq, nk, device)
    t = _BOTTOM_RIGHT.get(key)
    if t is None:
        with torch.inference_mode(False):
            t = torch.ones(nq, nk, dtype=torch.bool, device=device).tril_(nk - nq)
        if len(_BOTTOM_RIGHT) >= _BOTTOM_RIGHT_HELD:
            _BOTTOM_RIGHT.clear()
        _BOTTOM_RIGHT[key] = t
    return t


def _mask_tensor(req: Request):
    """The boolean ``attn_mask`` for ``req.mask`` (``None`` when it allows every pair), built cheaply for
    bottom-right causal masks: one query sees every key, and the decode shapes reuse a cached one."""
    m = req.mask
    if type(m) is Causal and m.align == "bottom_right":
        nq, nk = req.q.shape[2], req.k.shape[2]
        if nq == 1 and nk >= 1:
            return None
        # Cache only small masks (at most 32 x 1 MiB held), and never inside a traced graph.
        if nq * nk > _CACHED_MASK_ELEMENTS or torch.compiler.is_compiling():
            return torch.ones(nq, nk, dtype=torch.bool, device=req.q.device).tril_(nk - nq)
        return _bottom_right_causal(nq, nk, req.q.device)
    return m.dense(req.B, req.Hq, req.Nq, req.Nk, device=req.device)


class SDPABackend(Backend):
    """torch's fused scaled-dot-product attention kernels."""

    name = "sdpa"
    native_sinks = True

    def decline(self, req: Request) -> str | None:
        if req.return_lse:
            return "return_lse=True: torch's public SDPA API does not return the log-sum-exp"
        if req.dropout_p > 0:
            return "dropout: torch SDPA draws dropout from its global RNG and cannot reproduce qkv's seeded pattern"
        if req.score_mod is not None and not req.score_mod.additive:
            return f"score_mod {req.score_mod!r} is not additive; SDPA only takes an additive float mask"
        return None

    def estimate(self, req: Request) -> Estimate:
        rate = NOMINAL_FLOPS.get(req.device.type, NOMINAL_FLOPS["cpu"])
        flops = dense_flops(req)
        if _is_causal_flag(req) and req.score_mod is None and req.sinks is None:
            return Estimate(flops / 2 / rate, "fused kernel, is_causal skips the upper triangle")
        if req.mask is None and req.score_mod is None and req.sinks is None:
            return Estimate(flops / rate, "fused kernel, dense")
        mask_bytes = req.Nq * req.Nk * (4 if req.score_mod is not None or req.sinks is not None else 1) * (
            req.B if (req.mask is not None and req.mask.batch) else 1)
        pairs = req.B * req.Hq * req.Nq * req.Nk
        elem = _CPU_MASKED_PAIR_SECONDS * pairs if req.device.type == "cpu" else 0.0
        return Estimate(flops / rate + elem + mask_bytes / 1e10 + predicate_seconds(req),
                        f"fused kernel over all pairs, materializes a {format_size(mask_bytes)} mask")

    def run(self, req: Request) -> AttentionOutput:
        return AttentionOutput(_nonfinite_rows_again(req, self._attend(req).out), None)  # type: ignore[arg-type]

    def _attend(self, req: Request) -> AttentionOutput:
        if req.sinks is not None:
            return _run_with_sinks(req)
        # Read each attribute once: this runs on every decode step of every layer.
        q, k, mask, mod = req.q, req.k, req.mask, req.score_mod
        nk = k.shape[2]
        attn_mask, is_causal = None, False
        if mod is None:
            if mask is not None:
                if type(mask) is Causal and (mask.align == "top_left" or q.shape[2] == nk):
                    is_causal = True
                else:
                    attn_mask = _mask_tensor(req)
        else:
            bias = mod.dense_bias(req.B, req.Hq, req.Nq, nk, dtype=req.dtype, device=req.device)
            allowed = None if mask is None else _mask_tensor(req)
            if allowed is not None:
                bias = bias.masked_fill(~allowed, float("-inf"))
            attn_mask = bias
        hq, hkv = q.shape[1], k.shape[1]
        if q.shape[2] == 1 and hq != hkv and not is_causal and _foldable(attn_mask, hq):
            out = _decode_grouped(q, k, req.v, attn_mask, req.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, req.v, attn_mask=attn_mask, is_causal=is_causal,
                                                 scale=req.scale, enable_gqa=hq != hkv)
        if nk < _CPU_NAN_ROWS_BELOW and q.is_cpu:
            out = restore_nonfinite(req, out)[0]
        return AttentionOutput(out, None)  # type: ignore[arg-type]


def _nonfinite_rows_again(req: Request, out: torch.Tensor) -> torch.Tensor:
    """``out`` with its NaN rows computed again by the definition, where SDPA's own arithmetic made them NaN.

    SDPA adds its mask to the scores, so a key holding ``inf`` or NaN gives every row a NaN score there, masked or
    not (``inf + -inf``), and a row whose allowed scores are all ``-inf`` (an infinite query or key) gets
    ``exp(-inf + inf)``; the definition gives the first rows their value and the second zeros. Only where the
    output holds NaN (one pass over it) are the scores formed, in the accumulation dtype, and the NaN rows replaced
    by softmax-times-values over the allowed keys (and the sinks); rows that are NaN by the definition stay NaN.
    """
    if out.numel() == 0 or out.device.type == "meta" or not bool(out.isnan().any()):  # meta: shapes, no values
        return out
    acc = torch.float64 if req.dtype == torch.float64 else torch.float32
    B, Hq, Nq, Nk, dev = req.B, req.Hq, req.Nq, req.Nk, req.device
    k = req.k.to(acc).repeat_interleave(req.group, dim=1)  # (B, Hq, Nk, D): head h reads kv head h // group
    v = req.v.to(acc).repeat_interleave(req.group, dim=1)
    s = req.scale * (req.q.to(acc) @ k.transpose(-1, -2))  # (B, Hq, Nq, Nk)
    if req.score_mod is not None:  # additive here (SDPA declines the others)
        s = s + req.score_mod.dense_bias(B, Hq, Nq, Nk, dtype=acc, device=dev)
    if req.mask is not None:
        s = s.masked_fill(~req.mask.dense(B, Hq, Nq, Nk, device=dev), float("-inf"))
    if req.sinks is not None:
        s = torch.cat([s, req.sinks.to(acc).view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)], dim=-1)
    if s.shape[-1] == 0:
        return out.masked_fill(out.isnan(), 0.0)
    m = s.detach().amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    total = e.sum(-1, keepdim=True)
    p = (e / torch.where(total == 0, torch.ones_like(total), total))[..., :Nk]  # all -inf: zeros
    again = (p @ v).to(out.dtype)
    return torch.where(out.isnan().any(-1, keepdim=True), again, out)


def _foldable(attn_mask: torch.Tensor | None, hq: int) -> bool:
    """Whether a one-query GQA call can fold each group's query heads into query rows (:func:`_decode_grouped`):
    the mask (if any) is 4-D with one query row and one or ``hq`` heads."""
    return attn_mask is None or (attn_mask.dim() == 4 and attn_mask.shape[2] == 1 and attn_mask.shape[1] in (1, hq))


def _decode_grouped(q, k, v, attn_mask, scale) -> torch.Tensor:
    """One query per row under GQA as attention of ``Hq / Hkv`` query rows per KV head: q (B, Hq, 1, D) ->
    (B, Hkv, G, D) (query head h reads KV head h // G, as ``enable_gqa``), so each KV head's keys are read once
    for its whole group, not once per query head; the same values, measured faster on CPU."""
    B, hq, _, D = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if attn_mask is not None:
        b = attn_mask.shape[0]
        attn_mask = (attn_mask.reshape(b, hkv, g, attn_mask.shape[-1]) if attn_mask.shape[1] == hq
                     else attn_mask)  # (b, 1, 1, Nk) broadcasts over the heads and the folded rows
    out = F.scaled_dot_product_attention(q.reshape(B, hkv, g, D), k, v, attn_mask=attn_mask, scale=scale)
    return out.reshape(B, hq, 1, v.shape[-1])


def _sinks_by_lse(req: Request) -> torch.Tensor | None:
    """Sinks after the fact, where nothing needs a gradient: torch's CPU flash kernel returns each row's
    log-sum-exp ``L`` beside its output, and the sink's share of the softmax leaves the keys ``sigmoid(L - z[h])``
    of it, so ``out * sigmoid(L - z[h])`` is the sink-as-a-key result without copying K, V and a mask one column
    wider (a fully masked row gives zeros either way). Float32/float64 CPU calls without score modifiers, with one
    query per row under GQA (its query heads folded into rows, as :func:`_decode_grouped`); None otherwise."""
    q, k, v, sinks = req.q, req.k, req.v, req.sinks
    hq, hkv, nq = req.Hq, req.Hkv, req.Nq
    if (req.score_mod is not None or not q.is_cpu or q.dtype not in (torch.float32, torch.float64)
            or (hq != hkv and nq != 1) or req.Nk == 0
            or torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks))):
        return None
    bias = None
    if req.mask is not None:
        allowed = req.mask.dense(req.B, hq, nq, req.Nk, device=req.device)  # (B or 1, Hq or 1, Nq, Nk)
        bias = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    B, D = q.shape[0], q.shape[-1]
    if hq != hkv:  # one query: each KV head's query heads as rows
        g = hq // hkv
        q = q.reshape(B, hkv, g, D)
        if bias is not None and bias.shape[1] == hq:
            bias = bias.reshape(bias.shape[0], hkv, g, bias.shape[-1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                          scale=req.scale)
    out, lse = out.reshape(B, hq, nq, v.shape[-1]), lse.reshape(B, hq, nq)
    return out * torch.sigmoid(lse - sinks.to(lse.dtype).view(1, hq, 1)).unsqueeze(-1)


def _run_with_sinks(req: Request) -> AttentionOutput:
    """The sinks as one more key (see the module docstring), or after the fact (:func:`_sinks_by_lse`)."""
    out = _sinks_by_lse(req)
    if out is not None:
        if req.Nk < _CPU_NAN_ROWS_BELOW:
            out = restore_nonfinite(req, out)[0]
        return AttentionOutput(out, None)  # type: ignore[arg-type]
    B, Hq, Nq, Nk = req.B, req.Hq, req.Nq, req.Nk
    dt, dev = req.dtype, req.device
    zk = req.k.new_zeros(B, req.Hkv, 1, req.Dqk)
    zv = req.v.new_zeros(B, req.Hkv, 1, req.Dv)
    k, v = torch.cat([req.k, zk], dim=2), torch.cat([req.v, zv], dim=2)  # (B, Hkv, Nk + 1, D)
    if req.score_mod is not None:
        bias = req.score_mod.dense_bias(B, Hq, Nq, Nk, dtype=dt, device=dev)
    else:
        bias = torch.zeros(1, Hq, Nq, Nk, dtype=dt, device=dev)
    if req.mask is not None:
        bias = bias.masked_fill(~req.mask.dense(B, Hq, Nq, Nk, device=dev), float("-inf"))
    sink = req.sinks.to(dt).view(1, Hq, 1, 1).expand(bias.shape[0], Hq, Nq, 1)
    attn_mask = torch.cat([bias.expand(bias.shape[0], Hq, Nq, Nk), sink], dim=-1)  # (B or 1, Hq, Nq, Nk + 1)
    out = F.scaled_dot_product_attention(req.q, k, v, attn_mask=attn_mask, scale=req.scale,
                                         enable_gqa=req.Hq != req.Hkv)
    return AttentionOutput(out, None)  # type: ignore[arg-type]
