"""``qkv.attention``: one operator, one semantics, many backends; and ``qkv.explain``, which says why.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Nq queries, Nk keys, Dqk, Dv head dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import backends as _backends
from ._layout import from_bhnd, layout_hint, to_bhnd
from ._request import AttentionOutput, Request, build_request
from ._sinks import apply_sinks, without_sinks
from .backends.base import Estimate
from .masks.causal import Causal

__all__ = ["attention", "explain", "Explanation", "SMALL_PROBLEM"]

#: Score elements (B * Hq * Nq * Nk) up to which ``auto`` takes SDPA, when it accepts, without estimating.
SMALL_PROBLEM = 1 << 20


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None, score_mod=None,
              scale: float | None = None, return_lse: bool = False, dropout_p: float = 0.0,
              generator: torch.Generator | None = None, backend: str = "auto", sinks: torch.Tensor | None = None,
              layout: str = "bhnd", batch_invariant: bool = False):
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
        return_lse: also return the float32 log-sum-exp (B, Hq, Nq) as ``AttentionOutput(out, lse)``.
        dropout_p: probability of dropping each attention weight (kept ones scaled by ``1/(1-p)``); the
            pattern is a pure function of a seed drawn from ``generator``, so it is reproducible.
        generator: ``torch.Generator`` for the dropout seed.
        backend: ``"auto"`` (fastest backend that honours the request) or a name from
            ``qkv.backends.names()``; a named backend that cannot honour the request raises.
        sinks: (Hq,) float learnable sink logits (GPT-OSS): each joins its head's softmax denominator
            without a value, and the lse includes it (:mod:`qkv._sinks`). Gradients reach them.
        layout: ``"bhnd"`` (default): q, k, v are (B, H, N, D) as above; ``"bnhd"``: they are (B, N, H, D)
            (FlashAttention's and HF's projection layout), read through views without a transpose copy, and
            ``out`` comes back (B, Nq, Hq, Dv). The lse is (B, Hq, Nq) in both (:mod:`qkv.lse`).
            ``qkv.explain`` states the layout assumed.
        batch_invariant: each row's ``out`` and ``lse`` are bitwise the same whatever the batch size, the
            other rows, prefill chunking and key splits (:mod:`qkv.backends._invariant`; ``tiled`` and
            ``reference`` take it, the others decline). Slower: rows run in fixed-shape steps.

    Returns:
        ``out`` (B, Hq, Nq, Dv) in the input dtype, or ``AttentionOutput(out, lse)`` with ``return_lse``.
        Non-finite inputs propagate as in torch; masks never create NaN.

    Example:
        >>> import torch, qkv
        >>> q = torch.randn(2, 8, 16, 64); k = v = torch.randn(2, 2, 16, 64)
        >>> qkv.attention(q, k, v, mask=qkv.masks.causal()).shape
        torch.Size([2, 8, 16, 64])
    """
    req = _build(q, k, v, layout, mask=mask, score_mod=score_mod, scale=scale, return_lse=return_lse,
                 dropout_p=dropout_p, generator=generator, sinks=sinks, batch_invariant=batch_invariant)
    impl = _choose(req, backend)
    sub = _for_backend(impl, req)
    result = impl.run(sub)
    if sub is not req:  # the backend ran without the sinks and returned its lse: fold them in
        result = apply_sinks(result.out, result.lse, req.sinks)
    if layout != "bhnd":
        result = AttentionOutput(from_bhnd(result.out, layout), result.lse)
    return result if return_lse else result.out


def _build(q, k, v, layout: str, **kw) -> Request:
    """Validate in the caller's layout; a shape error says when the other layout would have fit."""
    q4, k4, v4 = (q, k, v) if layout == "bhnd" else to_bhnd(q, k, v, layout)
    try:
        return build_request(q4, k4, v4, layout=layout, **kw)
    except ValueError as e:
        read = " (q, k, v read as (B, N, H, D) and shown transposed)" if layout == "bnhd" else ""
        raise ValueError(f"{e}{read}{layout_hint(q, k, v, layout)}") from None


def _for_backend(impl, req: Request) -> Request:
    """The request a backend sees: sinks go to backends that take them natively; the others run without them
    and return their log-sum-exp, which :func:`qkv._sinks.apply_sinks` merges with the sinks."""
    return req if req.sinks is None or impl.native_sinks else without_sinks(req)


def _decline(impl, req: Request) -> str | None:
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
    # Small problems (decode steps, short sequences): the fused kernel wins and estimating every backend's
    # cost (block maps, compile caches) would cost more than the attention itself.
    qs = req.q.shape
    if qs[0] * qs[1] * qs[2] * req.k.shape[2] <= SMALL_PROBLEM:
        sdpa = _backends.get("sdpa")
        if _decline(sdpa, req) is None:
            return sdpa
    key = _decision_key(req)
    if key is not None:
        name = _decisions.get(key)
        if name is not None:
            return _backends.get(name)
    best, best_cost = None, float("inf")
    for name in _backends.names():
        impl = _backends.get(name)
        if _decline(impl, req) is None:
            cost = impl.estimate(_for_backend(impl, req)).seconds
            if cost < best_cost:
                best, best_cost = impl, cost
    assert best is not None, "the reference backend accepts every valid request"
    if key is not None:
        if len(_decisions) >= _MAX_DECISIONS:
            _decisions.clear()
        _decisions[key] = best.name
    return best


# auto's choice for requests whose cost depends on shapes alone (no mask or a causal one, no modifier):
# a long decode loop asks the same question every layer and step. Keyed on the backends' generation, which
# moves when one is registered or compiles a kernel.
_decisions: dict[tuple, str] = {}
_MAX_DECISIONS = 1024


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
            generator=None, sinks=None, layout="bhnd", batch_invariant=False) -> Explanation:
    """Report the backend ``attention(..., backend="auto")`` would choose and why each other was not.

    Example:
        >>> import torch, qkv
        >>> x = torch.randn(1, 2, 8, 16)
        >>> print(qkv.explain(x, x, x, return_lse=True).chosen != "sdpa")
        True
    """
    req = _build(q, k, v, layout, mask=mask, score_mod=score_mod, scale=scale, return_lse=return_lse,
                 dropout_p=dropout_p, generator=generator, sinks=sinks, batch_invariant=batch_invariant)
    chosen = _choose(req, "auto").name
    report = Explanation(request=req.describe() + (f", mask={req.mask!r}" if req.mask is not None else "")
                         + (f", score_mod={req.score_mod!r}" if req.score_mod is not None else ""), chosen=chosen)
    if req.B * req.Hq * req.Nq * req.Nk <= SMALL_PROBLEM and chosen == "sdpa":
        report.note = f"small problem (<= {SMALL_PROBLEM:,} score elements): the fused kernel without estimating"
    for name in _backends.names():
        impl = _backends.get(name)
        reason = _decline(impl, req)
        if reason is None:
            report.estimates[name] = impl.estimate(_for_backend(impl, req))
        else:
            report.declined[name] = reason
    return report
