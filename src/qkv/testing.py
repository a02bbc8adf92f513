"""Error budgets: how qkv decides that a numerical result is right.

A fixed tolerance is either too loose for float64 or too tight for bfloat16. Instead a candidate is
compared with a float64 reference, and its error must be at most ``k`` times the error that a plain
eager computation *in the candidate's own dtype* makes against the same reference, plus a small floor:

    err(candidate, ref64) <= k * err(baseline, ref64) + floor

``k`` is about 2 for float16/bfloat16 and 10 for float32 (README, "Testing discipline"). The floor absorbs the case
where the baseline happens to be nearly exact (tiny sizes, float64 inputs); by default it is a per-dtype
constant times ``max(1, max|reference|)``, so it stays one rounding step of the values compared.

The helper refuses what would make the comparison vacuous: a reference that is not float64 (or holds
NaN), a baseline or candidate of another shape than the reference (no silent broadcasting), and a
baseline whose own error is non-finite or above ``baseline_ceiling`` (a baseline that disagrees in
meaning, say a different mask, would otherwise inflate the allowance until anything passes).

Example:
    >>> import torch
    >>> from qkv.testing import assert_within_budget
    >>> x = torch.randn(8, dtype=torch.float64)
    >>> assert_within_budget(x.float() * 2, x * 2, x.float() * 2).ok
    True
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["Budget", "DEFAULT_K", "DEFAULT_FLOOR", "DEFAULT_BASELINE_CEILING", "max_error", "budget",
           "BatchInvariance", "check_batch_invariance",
           "assert_within_budget"]

DEFAULT_K: dict[torch.dtype, float] = {
    torch.float16: 2.0,
    torch.bfloat16: 2.0,
    torch.float32: 10.0,
    torch.float64: 10.0,
}
DEFAULT_FLOOR: dict[torch.dtype, float] = {
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
    torch.float32: 1e-6,
    torch.float64: 1e-12,
}
#: Largest error a same-dtype baseline may plausibly have, relative to ``max(1, max|reference|)``:
#: far above rounding (a long bf16 reduction stays below a few percent), far below a different meaning.
DEFAULT_BASELINE_CEILING: dict[torch.dtype, float] = {
    torch.float16: 0.25,
    torch.bfloat16: 0.25,
    torch.float32: 1e-2,
    torch.float64: 1e-6,
}


class Budget(NamedTuple):
    """The measured errors and the allowance they were held to."""

    candidate_error: float
    baseline_error: float
    allowed: float
    k: float
    floor: float

    @property
    def ok(self) -> bool:
        return self.candidate_error <= self.allowed

    def __str__(self) -> str:
        ratio = self.candidate_error / self.baseline_error if self.baseline_error > 0 else float("inf")
        return (
            f"candidate err {self.candidate_error:.3e} vs allowed {self.allowed:.3e} "
            f"(= {self.k:g} x baseline err {self.baseline_error:.3e} + floor {self.floor:.1e}; "
            f"candidate/baseline = {ratio:.2f})"
        )


def max_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference, in float64. Positions where both are equal infinities count as 0;
    a NaN in either tensor where the other has none counts as infinite error."""
    a64 = a.detach().to(torch.float64)
    r64 = ref.detach().to(torch.float64)
    a64, r64 = torch.broadcast_tensors(a64, r64)
    same_inf = torch.isinf(a64) & (a64 == r64)
    nan_mismatch = torch.isnan(a64) != torch.isnan(r64)
    if nan_mismatch.any():
        return float("inf")
    diff = (a64 - r64).abs()
    diff = torch.where(same_inf | torch.isnan(a64), torch.zeros_like(diff), diff)
    return float(diff.max()) if diff.numel() else 0.0


def budget(candidate: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor, *,
           k: float | None = None, floor: float | None = None, baseline_ceiling: float | None = None) -> Budget:
    """Measure ``candidate`` against the float64 ``reference`` with the allowance set by ``baseline``.

    Args:
        candidate: the result under test, any dtype.
        reference: the float64 result of the specification (e.g. the reference backend on
            float64 inputs). Same shape as ``candidate``.
        baseline: a plain eager computation in the candidate's dtype on the same inputs, same shape.
        k: multiplier on the baseline error; defaults by the candidate's dtype (``DEFAULT_K``).
        floor: absolute allowance added; defaults to ``DEFAULT_FLOOR[dtype] * max(1, max|reference|)``.
        baseline_ceiling: the largest absolute error the baseline may have against the reference; defaults
            to ``DEFAULT_BASELINE_CEILING[baseline dtype] * max(1, max|reference|)``. Pass ``math.inf`` to
            turn the check off.

    Raises:
        TypeError: the reference is not float64.
        ValueError: candidate, reference and baseline differ in shape.
        AssertionError: the reference holds NaN, or the baseline's error is non-finite or above the ceiling
            (the allowance it sets would mean nothing).
    """
    if reference.dtype != torch.float64:
        raise TypeError(f"budget: the reference must be float64 (the specification's exact result), got "
                        f"{reference.dtype}; compute it on .double() inputs")
    if candidate.shape != reference.shape:
        raise ValueError(
            f"candidate shape {tuple(candidate.shape)} != reference shape {tuple(reference.shape)}"
        )
    if baseline.shape != reference.shape:
        raise ValueError(f"baseline shape {tuple(baseline.shape)} != reference shape {tuple(reference.shape)}; "
                         "the baseline must be the same computation as the candidate, not a broadcast")
    dtype = candidate.dtype if candidate.dtype in DEFAULT_K else torch.float32
    k = DEFAULT_K[dtype] if k is None else k
    finite = reference[torch.isfinite(reference)].detach()
    scale = max(1.0, float(finite.abs().max()) if finite.numel() else 1.0)
    if floor is None:
        # The floor is one rounding step at the reference's scale: gradients reach |g| >> 1, where a fixed
        # absolute floor would be smaller than a single bf16/fp16 ulp of the values compared.
        floor = DEFAULT_FLOOR[dtype] * scale
    if torch.isnan(reference).any():
        raise AssertionError("budget: the float64 reference contains NaN; a budget against it would pass vacuously")
    cand_err = max_error(candidate, reference)
    base_err = max_error(baseline, reference)
    if not math.isfinite(base_err):
        raise AssertionError(f"budget: the baseline's error is {base_err} (NaN or inf where the reference is finite); "
                             "the allowance would be infinite, so nothing would be tested")
    if baseline_ceiling is None:
        base_dtype = baseline.dtype if baseline.dtype in DEFAULT_BASELINE_CEILING else torch.float32
        baseline_ceiling = DEFAULT_BASELINE_CEILING[base_dtype] * scale
    if base_err > baseline_ceiling:
        raise AssertionError(f"budget: the baseline's own error {base_err:.3e} exceeds its ceiling "
                             f"{baseline_ceiling:.3e}: it disagrees with the reference in meaning, not rounding, "
                             "so the allowance it sets would hide a real error")
    return Budget(cand_err, base_err, k * base_err + floor, k, floor)


def assert_within_budget(candidate: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor, *,
                         k: float | None = None, floor: float | None = None, baseline_ceiling: float | None = None,
                         what: str = "output") -> Budget:
    """Raise ``AssertionError`` with the measured numbers when ``candidate`` exceeds its budget (arguments as
    :func:`budget`)."""
    b = budget(candidate, reference, baseline, k=k, floor=floor, baseline_ceiling=baseline_ceiling)
    if not b.ok:
        raise AssertionError(f"{what}: {b}")
    return b


class BatchInvariance(NamedTuple):
    """What :func:`check_batch_invariance` measured: the largest difference of a row's output (and lse, when
    the callable returns one) between its reference run and each other way of computing it (0.0 = bitwise)."""

    ok: bool
    batch_diff: float  # the row alone vs inside the full batch
    other_diff: float  # the row inside a batch of other rows
    chunk_diff: float | None  # prefilled in query chunks against the key prefix (None: causal not taken)
    input: str

    def describe(self) -> str:
        parts = [f"alone vs batch {self.batch_diff:.3g}", f"other rows {self.other_diff:.3g}"]
        parts.append("chunks n/a (no causal)" if self.chunk_diff is None else f"chunks {self.chunk_diff:.3g}")
        return ("bitwise invariant" if self.ok else "varies") + " (max |diff|: " + ", ".join(parts) + ")"


def check_batch_invariance(fn, *, B: int = 8, Hq: int = 4, Hkv: int = 2, N: int = 48, D: int = 32,
                           chunk: int = 16, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0,
                           row: int | None = None) -> BatchInvariance:
    """Measure whether an attention callable gives a row the same bits whatever the rest of the batch.

    ``fn`` takes the plain form ``fn(q, k, v, *, causal=False, return_lse=False)`` in (B, H, N, D) layout
    (see :mod:`qkv.conformance`); only the keywords it accepts are passed. Row ``row`` (default: the last) of
    a batch of ``B`` random rows is computed (1) inside that batch, (2) alone, (3) inside a batch of ``B``
    other rows, and, when ``fn`` takes ``causal``, (4) alone, prefilled in query chunks of ``chunk`` against
    the key prefix.

    Returns:
        :class:`BatchInvariance`; ``ok`` when every way gives bitwise-equal out (and lse).

    Example:
        >>> import torch, qkv
        >>> from qkv.testing import check_batch_invariance
        >>> f = lambda q, k, v, *, causal=False: qkv.attention(q, k, v, backend="tiled", batch_invariant=True,
        ...                                                    mask=qkv.masks.causal() if causal else None)
        >>> check_batch_invariance(f, B=2, N=8, chunk=4).ok
        True
    """
    from .plain import accepted_options, call

    row = B - 1 if row is None else row
    if not isinstance(row, int) or not 0 <= row < B:
        raise ValueError(f"check_batch_invariance: row must be in [0, B={B}), got {row}")
    if chunk <= 0:
        raise ValueError(f"check_batch_invariance: chunk must be positive, got {chunk}")
    takes = accepted_options(fn)
    causal = "causal" in takes
    lse = "return_lse" in takes
    g = torch.Generator().manual_seed(seed)

    def draw():
        return [torch.randn(B, h, N, D, generator=g).to(device=device, dtype=dtype) for h in (Hq, Hkv, Hkv)]

    q, k, v = draw()
    oq, ok_, ov = draw()

    def run(q_, k_, v_):
        out, l_ = call(fn, q_, k_, v_, causal=causal, return_lse=lse)
        return out.detach(), (None if l_ is None else l_.detach())

    def diff(a, b) -> float:
        d = 0.0
        for x, y in zip(a, b):
            if x is None or y is None:
                continue
            if x.shape != y.shape:
                return math.inf
            if not torch.equal(x, y):
                finite = torch.isfinite(x) & torch.isfinite(y)
                d = max(d, float((x[finite].double() - y[finite].double()).abs().max()) if finite.any() else math.inf)
                d = d or math.ldexp(1.0, -1074)  # differing non-finite entries or signed zeros: not bitwise
        return d

    def row_of(res, i, lse_rows=True):
        out, l_ = res
        return out[i:i + 1], (None if l_ is None or l_.dim() != 3 or not lse_rows else l_[i:i + 1])

    full = run(q, k, v)
    ref = row_of(full, row)
    alone = run(q[row:row + 1], k[row:row + 1], v[row:row + 1])
    batch_diff = diff(ref, alone)
    mix = [x.clone() for x in (oq, ok_, ov)]
    for m, x in zip(mix, (q, k, v)):
        m[0] = x[row]
    other_diff = diff(ref, row_of(run(*mix), 0))
    chunk_diff = None
    if causal:
        outs, lses = [], []
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            o, l_ = run(q[row:row + 1, :, s:e], k[row:row + 1, :, :e], v[row:row + 1, :, :e])
            outs.append(o)
            lses.append(l_)
        stitched = (torch.cat(outs, 2), None if lses[0] is None or lses[0].dim() != 3 else torch.cat(lses, 2))
        chunk_diff = diff(ref, stitched)
    ok = batch_diff == 0.0 and other_diff == 0.0 and (chunk_diff in (None, 0.0))
    where = f"B={B} Hq={Hq} Hkv={Hkv} N={N} D={D} {str(dtype).replace('torch.', '')} seed={seed} row={row}"
    return BatchInvariance(ok, batch_diff, other_diff, chunk_diff, where + (f" chunk={chunk}" if causal else ""))
