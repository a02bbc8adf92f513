"""The plain attention form (the form qkv.conformance and qkv.testing call any kernel in), and what a given
function accepts of it.

The plain form is qkv's layout and conventions::

    fn(q, k, v, *, causal=False, window=None, sinks=None, softcap=None, scale=None, return_lse=False)
        q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) -> out (B, Hq, Nq, Dv) or (out, lse)

``window=(left, right)`` lets the query at position ``p`` see keys ``p - left .. p + right``; positions are
bottom-right aligned (query row ``i`` at ``i + Nk - Nq``) as in qkv's contract, so a kernel that aligns
top-left shows up as a finding, not as a different request. ``softcap=c`` is ``c * tanh(score / c)`` on the
scaled score, before the mask. ``sinks`` (Hq,) are per-head logits that join the softmax denominator.
The ``lse`` is passed through exactly as the kernel returns it: the battery finds its base and layout.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

__all__ = ["OPTIONS", "PlainFn", "accepted_options", "call", "restrict"]

PlainFn = Callable[..., object]

#: The keywords of the plain form, in the order the battery reports them.
OPTIONS = ("causal", "window", "sinks", "softcap", "scale", "return_lse")


def accepted_options(fn: PlainFn) -> frozenset[str]:
    """The plain-form keywords ``fn`` accepts (every one when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as e:
        raise TypeError(f"conformance: cannot read the signature of {fn!r} ({e}); wrap it in a plain function "
                        f"fn(q, k, v, *, causal=False, ..., return_lse=False)") from None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset(OPTIONS)
    return frozenset(p.name for p in params if p.name in OPTIONS)


def call(fn: PlainFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options):
    """Call ``fn`` with the options it accepts; returns ``(out, lse or None)``. Options left at their default
    are not passed, so a function without them still runs."""
    kw = {name: value for name, value in options.items()
          if value is not None and not (name in ("causal", "return_lse") and value is False)}
    result = fn(q, k, v, **kw)
    if options.get("return_lse"):
        if not isinstance(result, (tuple, list)) or len(result) < 2:
            raise TypeError(f"return_lse=True returned {type(result).__name__}, expected (out, lse)")
        return result[0], result[1]
    if isinstance(result, (tuple, list)):
        return result[0], None
    return result, None


def restrict(fn: PlainFn, options: frozenset[str]) -> PlainFn:
    """``fn`` seen as accepting only ``options`` (a kernel whose lse raises is then checked without it)."""
    def restricted(q, k, v, **kw):
        return fn(q, k, v, **kw)
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("q", "k", "v")]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in OPTIONS if n in options]
    restricted.__signature__ = inspect.Signature(params)
    restricted.__name__ = getattr(fn, "__name__", "fn")
    return restricted
