"""``qkv.attention``: one operator, one semantics, many backends; and ``qkv.explain``, which says why.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Nq queries, Nk keys, Dqk, Dv head dims.
"""

from __future__ import annotations

import dis
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from . import backends as _backends
from ._layout import from_bhnd, layout_hint, to_bhnd
from ._request import AttentionOutput, PagedKV, Request, build_request
from ._sinks import apply_sinks, without_sinks
from .backends.base import Estimate
from .masks.causal import Causal
from .masks.sequence import Positions

__all__ = ["attention", "explain", "Explanation", "SMALL_PROBLEM", "MAX_PLAUSIBLE_HEADS"]

#: Score elements (B * Hq * Nq * Nk) up to which ``auto`` takes SDPA, when it accepts, without estimating.
SMALL_PROBLEM = 1 << 20


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None, score_mod=None,
              scale: float | None = None, return_lse: bool = False, dropout_p: float = 0.0,
              generator: torch.Generator | None = None, backend: str = "auto", sinks: torch.Tensor | None = None,
              layout: str | None = None, batch_invariant: bool = False, paged: PagedKV | None = None,
              **unexpected):
    """Scaled dot-product attention with masks and score modifiers.

    ``scores = scale * q @ k^T``, then each score modifier in order, then the mask; softmax over keys;
    times ``v``. A query row with no allowed key returns zeros (``lse = -inf``) and zero gradients.

    Args:
        q: (B, Hq, Nq, Dqk) float16/bfloat16/float32/float64.
        k: (B, Hkv, Nk, Dqk), same dtype and device; ``Hq % Hkv == 0`` (query head ``h`` reads kv head
            ``h // (Hq // Hkv)``: MHA, GQA and MQA).
        v: (B, Hkv, Nk, Dv); ``Dv`` may differ from ``Dqk``.
        mask: a :mod:`qkv.masks` mask (which pairs may interact). ``masks.causal()`` is bottom-right
            aligned: query row ``i`` sits at key position ``i + Nk - Nq``::

                Nq=2, Nk=4, causal()       causal(align="top_left")
                      k0 k1 k2 k3               k0 k1 k2 k3
                q0:   x  x  x  .          q0:   x  .  .  .
                q1:   x  x  x  x          q1:   x  x  .  .

        score_mod: a :mod:`qkv.mods` modifier or a list of them, applied in order.
        scale: multiplier on ``q @ k^T``; default ``Dqk ** -0.5``.
        return_lse: also return the log-sum-exp (B, Hq, Nq) as ``AttentionOutput(out, lse)``: float32, float64
            for float64 inputs (so float64 merges and ring steps stay float64 end to end).
        dropout_p: probability of dropping each attention weight (kept ones scaled by ``1/(1-p)``); the
            pattern is a pure function of a seed drawn from ``generator``, so it is reproducible.
        generator: ``torch.Generator`` for the dropout seed.
        backend: ``"auto"`` (fastest backend that honours the request) or a name from
            ``qkv.backends.names()``; a named backend that cannot honour the request raises.
        sinks: (Hq,) float learnable sink logits (GPT-OSS): each joins its head's softmax denominator
            without a value, and the lse includes it (:mod:`qkv._sinks`). Gradients reach them.
        layout: ``"bhnd"`` (the default): q, k, v are (B, H, N, D) as above; ``"bnhd"``: they are (B, N, H, D)
            (FlashAttention's and HF's projection layout), read through views without a transpose copy, and
            ``out`` comes back (B, Nq, Hq, Dv). The lse is (B, Hq, Nq) in both (:mod:`qkv.lse`).
            ``qkv.explain`` states the layout assumed. When ``layout`` is not given and the call looks like
            (B, N, H, D) tensors read as (B, H, N, D) (see :data:`MAX_PLAUSIBLE_HEADS`), a ``UserWarning`` says
            so; passing ``layout="bhnd"`` explicitly states the layout and silences it.
        batch_invariant: each row's ``out`` and ``lse`` are bitwise the same whatever the batch size, the
            other rows, prefill chunking and key splits (:mod:`qkv.backends._invariant`; ``tiled`` and
            ``reference`` take it, the others decline). Slower: rows run in fixed-shape steps.
        paged: :class:`qkv.PagedKV` ``(block_tables, kv_positions, q_positions, window)``: ``k`` and ``v`` are
            block pools (P, Hkv, T, Dqk) and (P, Hkv, T, Dv) of a paged KV cache, and each row attends the slots
            its table names under the causal positions mask (no ``mask``, ``score_mod`` or ``dropout_p``). The
            ``paged`` backend serves it, in place where it can (:mod:`qkv.backends.paged`).

    Returns:
        ``out`` (B, Hq, Nq, Dv) in the input dtype, or ``AttentionOutput(out, lse)`` with ``return_lse``.
        ``out, lse = qkv.attention(q, k, v)`` on a batch of two without ``return_lse=True`` raises
        ``TypeError`` (it would otherwise split the batch into two "results"; other batch sizes fail to unpack).
        Non-finite inputs propagate as in torch; masks never create NaN.

    Example:
        >>> import torch, qkv
        >>> q = torch.randn(2, 8, 16, 64); k = v = torch.randn(2, 2, 16, 64)
        >>> qkv.attention(q, k, v, mask=qkv.masks.causal()).shape
        torch.Size([2, 8, 16, 64])
    """
    if unexpected:
        _refuse_unexpected(unexpected)
    if paged is not None:  # block pools: no layout question, one backend family
        req = build_request(q, k, v, mask=mask, score_mod=score_mod, scale=scale, return_lse=return_lse,
                            dropout_p=dropout_p, sinks=sinks, layout="bhnd" if layout is None else layout,
                            batch_invariant=batch_invariant, paged=paged)
        impl = _choose(req, backend)
        sub = _for_backend(impl, req)
        result = impl.run(sub)
        if sub is not req:
            result = apply_sinks(result.out, result.lse, req.sinks)
        return result if return_lse else result.out
    if layout is None:
        layout = "bhnd"
        req = _build(q, k, v, layout, mask=mask, score_mod=score_mod, scale=scale, return_lse=return_lse,
                     dropout_p=dropout_p, generator=generator, sinks=sinks, batch_invariant=batch_invariant)
        if _looks_transposed(req.q.shape, req.k.shape):
            _warn_transposed(req)
    else:
        req = _build(q, k, v, layout, mask=mask, score_mod=score_mod, scale=scale, return_lse=return_lse,
                     dropout_p=dropout_p, generator=generator, sinks=sinks, batch_invariant=batch_invariant)
    impl = _choose(req, backend)
    sub = _for_backend(impl, req)
    result = impl.run(sub)
    if sub is not req:  # the backend ran without the sinks and returned its lse: fold them in
        result = apply_sinks(result.out, result.lse, req.sinks)
    if layout != "bhnd":
        result = AttentionOutput(from_bhnd(result.out, layout), result.lse)
    if return_lse:
        return result
    # Only a batch of two unpacks without an error; other batch sizes fail in Python's own unpacking.
    if result.out.shape[0] == 2 and not torch.compiler.is_compiling() and _caller_unpacks_two(sys._getframe(1)):
        raise TypeError("attention: `out, lse = qkv.attention(...)` without return_lse=True would split the output "
                        "along the batch dimension; pass return_lse=True to get AttentionOutput(out, lse) (or, to "
                        "split the batch on purpose, out.unbind(0))")
    return result.out


_UNPACK, _CACHE = dis.opmap["UNPACK_SEQUENCE"], dis.opmap.get("CACHE", -1)
_unpack_sites: dict[tuple[int, int], tuple] = {}


def _caller_unpacks_two(frame) -> bool:
    """Whether the caller's next instruction unpacks the returned value into exactly two names
    (``out, lse = qkv.attention(...)``). Read from the caller's bytecode once per call site, then cached (keyed
    by the code object's id, which the entry's reference keeps alive): a dict lookup per call, nothing under
    ``torch.compile``."""
    code, at = frame.f_code, frame.f_lasti
    entry = _unpack_sites.get((id(code), at))
    if entry is not None and entry[0] is code:
        return entry[1]
    raw, i = code.co_code, at + 2
    while i < len(raw) and raw[i] == _CACHE:  # inline caches follow a call on Python >= 3.11
        i += 2
    hit = i + 1 < len(raw) and raw[i] == _UNPACK and raw[i + 1] == 2
    if len(_unpack_sites) >= 4096:
        _unpack_sites.clear()
    _unpack_sites[(id(code), at)] = (code, hit)
    return hit


#: More heads than any model a default-layout call is likely to come from has (the largest released models
#: have at most 128 query heads): with a head axis above it and longer than the key axis, a default-layout
#: call is probably (B, N, H, D) read as (B, H, N, D).
MAX_PLAUSIBLE_HEADS = 64


def _looks_transposed(qs, ks) -> bool:
    """The documented rule for a call made without ``layout=``: query and key/value heads agree (in a
    transposed call both are the sequence length), there are more of them than keys and than
    :data:`MAX_PLAUSIBLE_HEADS`, and at least as many queries as keys (so a decode step, Nq = 1 < Nk, or a
    short cache under a normal head count never matches)."""
    return qs[1] == ks[1] and ks[1] > MAX_PLAUSIBLE_HEADS and ks[1] > ks[2] and qs[2] >= ks[2]


def _warn_transposed(req: Request) -> None:
    warnings.warn(f"attention: q, k, v were read as (B, H, N, D) = {tuple(req.q.shape)} ({req.Hq} heads over "
                  f"{req.Nk} keys); if they are (B, N, H, D), pass layout='bnhd'. A model with that many heads "
                  "states its layout with layout='bhnd', which silences this warning", UserWarning, stacklevel=3)


def _build(q, k, v, layout: str, **kw) -> Request:
    """Validate in the caller's layout; a shape error says when the other layout would have fit."""
    q4, k4, v4 = (q, k, v) if layout == "bhnd" else to_bhnd(q, k, v, layout)
    try:
        return build_request(q4, k4, v4, layout=layout, **kw)
    except ValueError as e:
        read = " (q, k, v read as (B, N, H, D) and shown transposed)" if layout == "bnhd" else ""
        raise ValueError(f"{e}{read}{_other_layout_hint(q, k, v, layout, kw)}") from None


#: torch SDPA's (and others') keywords that qkv.attention spells differently, with the qkv spelling.
_OTHER_SPELLINGS = {
    "is_causal": "mask=qkv.masks.causal() (bottom-right aligned; torch's is_causal is "
                 "qkv.masks.causal(align='top_left')), or qkv.sdpa(..., is_causal=True) for torch's signature",
    "attn_mask": "mask=qkv.masks.dense(bool_tensor) for a boolean mask, score_mod=qkv.mods.bias(t) for an additive "
                 "float one, or qkv.sdpa(..., attn_mask=...) for torch's signature",
    "enable_gqa": "nothing: grouped-query attention is on whenever k has fewer heads than q",
    "causal": "mask=qkv.masks.causal()",
    "softmax_scale": "scale=",
    "dropout": "dropout_p=",
    "window_size": "mask=qkv.masks.sliding_window(left, right)",
}


def _refuse_unexpected(unexpected: dict) -> None:
    name = next(iter(unexpected))
    fix = _OTHER_SPELLINGS.get(name)
    hint = f"; use {fix}" if fix else "; see help(qkv.attention) for its arguments"
    raise TypeError(f"attention() got an unexpected keyword argument {name!r}{hint}")


def _other_layout_hint(q, k, v, layout: str, kw: dict) -> str:
    """The layout hint, only when the whole call (masks, modifiers, sinks included) is valid in the other layout:
    a hint the layout cannot act on (a mask of the wrong size, too few ALiBi slopes) would mislead."""
    hint = layout_hint(q, k, v, layout)
    if not hint:
        return ""
    other = "bnhd" if layout == "bhnd" else "bhnd"
    try:
        build_request(*to_bhnd(q, k, v, other), layout=other, **kw)
    except (ValueError, TypeError):
        return ""
    return hint


def _for_backend(impl, req: Request) -> Request:
    """The request a backend sees: sinks go to backends that take them natively; the others run without them
    and return their log-sum-exp, which :func:`qkv._sinks.apply_sinks` merges with the sinks."""
    return req if req.sinks is None or impl.native_sinks else without_sinks(req)


def _decline(impl, req: Request) -> str | None:
    if impl.paged_operands != (req.paged is not None):
        return ("it reads keys and values as (B, Hkv, Nk, D) tensors, not block pools (paged=)" if req.paged is not None
                else "it reads block pools (paged=qkv.PagedKV(...)) only")
    if req.batch_invariant and not impl.batch_invariant:
        return ("batch_invariant=True: its results depend on the batch (kernel choice and reduction order follow "
                "the shapes); backends 'tiled' and 'reference' take it")
    reason = impl.decline(_for_backend(impl, req))
    if reason is not None and req.sinks is not None and not impl.native_sinks:
        return f"sinks are merged from the log-sum-exp, and {reason}"
    return reason


def _choose(req: Request, backend: str):
    if backend != "auto":
        if not isinstance(backend, str):
            raise TypeError(f"attention: backend must be a string, got {type(backend).__name__}")
        impl = _backends.get(backend)
        reason = _decline(impl, req)
        if reason is not None:
            raise ValueError(f"attention: backend {backend!r} cannot run this request: {reason}. "
                             f"Use backend='auto' or see qkv.explain(...) for the backends that can.")
        return impl
    if req.paged is not None:
        return _choose_paged(req)
    # Small problems (decode steps, short sequences): the fused kernel wins and estimating every backend's
    # cost (block maps, compile caches) would cost more than the attention itself. A cached decode step (one query
    # per row under a positions mask) goes to the compiled decode kernel where it runs: it reads the cache in place
    # and builds no mask.
    qs = req.q.shape
    if qs[2] == 1 and type(req.mask) is Positions:
        decode = _backends.get("cpu_decode")
        if _decline(decode, req) is None:
            return decode
    if qs[0] * qs[1] * qs[2] * req.k.shape[2] <= SMALL_PROBLEM:
        sdpa = _backends.get("sdpa")
        if _decline(sdpa, req) is None:
            return sdpa
    key = _decision_key(req)
    held = _decisions if key is not None else _held_for_mask(req)
    if held is not None:
        key = key if key is not None else _mask_decision_key(req)
        hit = held.get(key)
        if hit is not None and (req.score_mod is None or hit[1] is req.score_mod):
            return _backends.get(hit[0])
    best, best_cost, declined = None, float("inf"), {}
    for name in _backends.names():
        impl = _backends.get(name)
        why = _decline(impl, req)
        if why is None:
            cost = impl.estimate(_for_backend(impl, req)).seconds
            if cost < best_cost:
                best, best_cost = impl, cost
        else:
            declined[name] = why
    if best is None:  # e.g. batch_invariant=True on a device no invariant backend runs on (meta)
        raise ValueError("attention: no backend can run this request: "
                         + "; ".join(f"{name}: {why}" for name, why in declined.items())
                         + ". Change the request (device, dtype, options) so one of them can")
    if held is not None:
        if len(held) >= _MAX_DECISIONS:
            held.clear()
        held[key] = (best.name, req.score_mod)  # the modifier is compared by identity on a hit
    return best


_paged_backends: tuple[int, list] = (-1, [])


def _choose_paged(req: Request):
    """auto's choice for block-pool operands: among the backends that read them (listed once per generation of the
    registry), the cheapest that accepts."""
    global _paged_backends
    gen, impls = _paged_backends
    if gen != _backends.generation():
        impls = [b for b in (_backends.get(n) for n in _backends.names()) if b.paged_operands]
        _paged_backends = (_backends.generation(), impls)
    if len(impls) == 1 and _decline(impls[0], req) is None:
        return impls[0]
    best, best_cost, reasons = None, float("inf"), []
    for impl in impls:
        reason = _decline(impl, req)
        if reason is not None:
            reasons.append(f"{impl.name}: {reason}")
            continue
        cost = impl.estimate(_for_backend(impl, req)).seconds
        if cost < best_cost:
            best, best_cost = impl, cost
    if best is None:
        raise ValueError(f"attention: no registered backend reads these block-pool operands ({'; '.join(reasons)}); "
                         f"gather the rows' view and call attention on it")
    return best


# auto's choice for requests whose cost depends on shapes alone (no mask or a causal one, no modifier):
# a long decode loop asks the same question every layer and step. Keyed on the backends' generation, which
# moves when one is registered or compiles a kernel.
_decisions: dict[tuple, tuple] = {}
_MAX_DECISIONS = 1024
# auto's choice for any other mask, held by the mask object (masks are immutable): estimating costs work that
# grows with the mask (a predicate without an analytic block map is evaluated on every pair), so each mask
# object pays it once per shape. The score modifier, if any, must be the same object for a hit.
_mask_decisions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _held_for_mask(req: Request) -> dict | None:
    if req.mask is None or req.dropout_p > 0:
        return None
    try:
        return _mask_decisions.setdefault(req.mask, {})
    except TypeError:  # a mask that cannot be weakly referenced: no caching
        return None


def _mask_decision_key(req: Request) -> tuple:
    return (_backends.generation(), req.q.shape, req.k.shape, req.v.shape, req.dtype, req.device, req.requires_grad,
            req.return_lse, req.sinks is not None, type(req.score_mod))


def _decision_key(req: Request) -> tuple | None:
    m = req.mask
    if req.score_mod is not None or req.dropout_p > 0 or not (m is None or type(m) is Causal):
        return None
    return (_backends.generation(), None if m is None else m.align, req.q.shape, req.k.shape, req.v.shape,
            req.dtype, req.device, req.requires_grad, req.return_lse, req.batch_invariant)


@dataclass
class Explanation:
    """What ``backend="auto"`` would do with a request, and why."""

    request: str
    chosen: str
    estimates: dict[str, Estimate] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)
    note: str = ""

    def __str__(self) -> str:
        chosen = f"  chosen: {self.chosen}" + (f" ({self.note})" if self.note else "")
        lines = [f"qkv.attention on {self.request}", chosen]
        for name, est in sorted(self.estimates.items(), key=lambda kv: kv[1].seconds):
            tag = "chosen" if name == self.chosen else "other"
            lines.append(f"  {name:<10} {tag:<8} {est}")
        for name, why in self.declined.items():
            lines.append(f"  {name:<10} {'declined':<8} {why}")
        return "\n".join(lines)


def explain(q, k, v, *, mask=None, score_mod=None, scale=None, return_lse=False, dropout_p=0.0,
            generator=None, sinks=None, layout=None, batch_invariant=False, paged=None) -> Explanation:
    """Report the backend ``attention(..., backend="auto")`` would choose and why each other was not. With
    ``paged=`` (block-pool operands, :class:`qkv.PagedKV`) the note names the ``paged`` backend's path and why
    (the compiled kernel through :mod:`qkv.cpu.ops`, Triton, or torch ops with the reason the kernels cannot run).

    Example:
        >>> import torch, qkv
        >>> x = torch.randn(1, 2, 8, 16)
        >>> print(qkv.explain(x, x, x, return_lse=True).chosen != "sdpa")
        True
    """
    layout = "bhnd" if layout is None else layout
    if paged is not None:
        req = build_request(q, k, v, mask=mask, score_mod=score_mod, scale=scale, return_lse=return_lse,
                            dropout_p=dropout_p, sinks=sinks, layout=layout, batch_invariant=batch_invariant,
                            paged=paged)
    else:
        req = _build(q, k, v, layout, mask=mask, score_mod=score_mod, scale=scale, return_lse=return_lse,
                     dropout_p=dropout_p, generator=generator, sinks=sinks, batch_invariant=batch_invariant)
    # Estimates first: a mask without an analytic block map is priced as a first call pays it (the predicate on
    # every pair), before choosing caches what that work found.
    estimates, declined = {}, {}
    for name in _backends.names():
        impl = _backends.get(name)
        reason = _decline(impl, req)
        if reason is None:
            estimates[name] = impl.estimate(_for_backend(impl, req))
        else:
            declined[name] = reason
    chosen = _choose(req, "auto").name
    report = Explanation(request=req.describe() + (f", mask={req.mask!r}" if req.mask is not None else "")
                         + (f", score_mod={req.score_mod!r}" if req.score_mod is not None else ""), chosen=chosen,
                         estimates=estimates, declined=declined)
    if req.B * req.Hq * req.Nq * req.Nk <= SMALL_PROBLEM and chosen == "sdpa":
        report.note = f"small problem (<= {SMALL_PROBLEM:,} score elements): the fused kernel without estimating"
    elif chosen == "cpu_decode":
        report.note = "a cached decode step by positions: the compiled decode kernel without estimating"
    else:
        report.note = _backends.get(chosen).path(_for_backend(_backends.get(chosen), req))
    return report
