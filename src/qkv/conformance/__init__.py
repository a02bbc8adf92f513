"""``qkv.conformance``: check any attention kernel against qkv's contract.

``check(fn)`` probes the callable's log-sum-exp (base e or 2; (B, H, N), (B, N, H) or varlen layout) and
runs a battery: fully masked rows, causal alignment for Nq < Nk and Nq > Nk, window alignment and
inclusivity, GQA head mapping, softcap order, sinks in the lse, empty key sets, Nq = 1, output and lse
dtypes, non-contiguous inputs, determinism and batch invariance. Expected values come from qkv's float64
reference backend. Each finding names the check (a stable string), what qkv's contract expects, what the
callable did, and a reproducing input.

``fn`` is the plain form ``fn(q, k, v, *, causal=False, window=None, sinks=None, softcap=None, scale=None,
return_lse=False)`` on (B, H, N, D) tensors (:mod:`qkv.plain`); the battery passes only the
keywords ``fn`` accepts and reports the rest as not supported. :mod:`qkv.conformance.adapters` wraps torch
SDPA, FlexAttention, HF's attention functions, qkv's backends, torch's varlen_attn, FlashAttention 2/3/4 and
FlashInfer into that form.

Example:
    >>> import torch
    >>> from qkv import conformance
    >>> def base2(q, k, v, *, return_lse=False):   # a kernel that returns a base-2 lse
    ...     out, lse = torch.nn.functional.scaled_dot_product_attention(q, k, v), None
    ...     s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    ...     return (out, torch.logsumexp(s, -1) / 0.6931471805599453) if return_lse else out
    >>> report = conformance.check(base2, checks=("lse_base",))
    >>> report.finding("lse_base").seen
    '2'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..plain import OPTIONS, accepted_options
from ._battery import CHECKS, Case, run_battery
from ._report import Finding, Report

__all__ = ["check", "Report", "Finding", "Case", "CHECKS", "OPTIONS"]


def check(fn: Callable | str, *, adapter: Callable | None = None, device="cpu",
          dtypes: Sequence[torch.dtype] = (torch.float32,), checks: Sequence[str] | None = None, seed: int = 0,
          name: str | None = None) -> Report:
    """Run the conformance battery on an attention callable.

    Args:
        fn: the plain-form function, a kernel that ``adapter`` wraps into it, or an adapter name from
            :data:`qkv.conformance.adapters.ADAPTERS` (``"sdpa"``, ``"flex"``, ``"hf-eager"``, ``"tiled"``, ...).
        adapter: ``adapter(fn)`` returns the plain form (e.g. ``adapters.flash_attn``); None when ``fn`` is
            already plain.
        device: where the inputs are made.
        dtypes: the dtypes the ``dtype`` check runs; the other checks use float32 when listed (else the first).
        checks: a subset of :data:`CHECKS` (default: all).
        seed: seeds every input (each finding's ``input`` records it).
        name: the report's title (default: the adapter name or the function's name).

    Returns:
        :class:`Report` with ``findings`` (``check``, ``ok``, ``expected``, ``seen``, ``input``), ``table()``
        and ``to_json()``.
    """
    from . import adapters

    if isinstance(fn, str):
        title = name or fn
        plain = adapters.by_name(fn)
    else:
        if not callable(fn):
            raise TypeError(f"check: fn must be callable or an adapter name, got {type(fn).__name__}")
        plain = adapter(fn) if adapter is not None else fn
        title = name or getattr(fn, "__name__", type(fn).__name__)
    dtypes = tuple(dtypes)
    if not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise TypeError(f"check: dtypes must be a non-empty sequence of torch dtypes, got {dtypes!r}")
    if checks is not None:
        checks = (checks,) if isinstance(checks, str) else tuple(checks)  # "values" is one check, not six letters
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise ValueError(f"check: unknown check(s) {', '.join(map(repr, unknown))} in checks; valid: "
                             f"{', '.join(CHECKS)}")
    device = _usable_device(device)
    findings = run_battery(plain, device=device, dtypes=dtypes, seed=seed, checks=checks)
    takes = accepted_options(plain)
    return Report(title, str(device), [str(d).replace("torch.", "") for d in dtypes],
                  [o for o in OPTIONS if o in takes], findings)


def _usable_device(device) -> torch.device:
    """``device`` as a ``torch.device`` where a tensor can be made; ``ValueError`` naming it otherwise, so that no
    battery runs (and reports every check "raised") on a device this torch cannot reach."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"check: device {device!r} is not a torch device ({str(e).splitlines()[0]}); use "
                         f"e.g. 'cpu' or 'cuda:0'") from None
    try:
        torch.empty(0, device=dev)
    except Exception as e:  # noqa: BLE001 - RuntimeError, AssertionError (no CUDA), ModuleNotFoundError (no hpu), ...
        raise ValueError(f"check: device {str(dev)!r} is not available here ({str(e).splitlines()[0][:120]}); "
                         f"run on a machine that has it, or pass device='cpu'") from None
    return dev
