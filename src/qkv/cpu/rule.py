"""The product rule: which kernel multiplies ``rows`` rows by an ``(n_out, k)`` weight on CPU, as one table.

Shape legend: M rows (tokens in the step), K inputs (``k``), N outputs (``n_out``).

Four paths compute the same ``F.linear(x, weight)`` (float32; float64 for the blocked ones):

- ``"row_blocks"``: a standard ``(N, K)`` weight cut into row blocks, one batched GEMM over torch's threads
  (:func:`qkv.cpu.skinny.skinny_linear`);
- ``"columns"``: an input-major weight (``.t()`` contiguous) cut into column blocks (the same function);
- ``"onednn"``: oneDNN on a copy of the weight packed once (:mod:`qkv.cpu.gemm`), where this torch build
  runs it and the caller holds a packed copy;
- ``"linear"``: ``F.linear`` (MKL).

:data:`TABLE` decides, keyed by thread count (1, or 2 meaning two or more) and shape class
(:func:`shape_class`), in three numbers: row blocks for 1 to ``row_blocks_up_to`` rows, column blocks for 1
to ``columns_up_to`` rows, oneDNN from ``onednn_from`` rows on. oneDNN goes first where it is allowed; a
caller without it (no packed copy, a torch build without oneDNN) falls back to the blocks, then to
``F.linear``. Every number follows ``benchmarks/results/skinny.json`` (``benchmarks/skinny.py`` writes it;
``tests/test_cpu_rule.py`` reads it and checks every measured cell against :func:`choose`): a path is never
taken where another measured path was faster in every paired repeat. Where a committed run has not measured
a path yet, the numbers follow the whole-model runs in ``benchmarks/results/generate.json``, and the test
checks them once the table measures it.

Example:
    >>> from qkv.cpu.rule import choose, shape_class
    >>> shape_class(32000, 512), shape_class(512, 1376)
    ('short', 'narrow')
    >>> choose(1, 32000, 512, threads=2), choose(1, 512, 1376, threads=1), choose(32, 512, 1376, threads=2)
    ('row_blocks', 'linear', 'onednn')
    >>> choose(32, 512, 1376, threads=2, onednn=False)
    'linear'
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Literal, NamedTuple

import torch

__all__ = ["Paths", "TABLE", "PATHS", "NARROW_OUTPUTS", "LONG_INPUTS", "DECIDED_IN_PLACE", "shape_class",
           "thread_class", "choose"]

Path = Literal["row_blocks", "columns", "onednn", "linear"]
#: The paths :func:`choose` names.
PATHS: tuple[str, ...] = ("row_blocks", "columns", "onednn", "linear")

NARROW_OUTPUTS = 1024  # fewer outputs than this: "narrow"
LONG_INPUTS = 1024  # more inputs than this (and not narrow): "long", else "short"


class Paths(NamedTuple):
    """One row of :data:`TABLE`: the row counts each path takes (0: never)."""

    row_blocks_up_to: int  # standard weight: row blocks for 1..this many rows
    columns_up_to: int  # input-major weight: column blocks for 1..this many rows
    onednn_from: int  # this many rows and more: oneDNN on a packed copy, where the caller has one


#: (threads: 1, or 2 for two and more; shape class) -> :class:`Paths`. Measured on a 2-core AMD EPYC, MKL,
#: weights cold (``benchmarks/results/skinny.json``, 2026-12-03): row blocks beat ``F.linear`` in every
#: repeat for 1-8 rows of the short and long classes at 2 threads and for 1-4 short rows at one thread, and
#: lose in every repeat for the narrow class (512 x 1376: 0.66-0.84 at 1, 4, 6 and 8 rows; at 2 threads whole
#: decode steps overrule those cells for 1-4 rows, see :data:`DECIDED_IN_PLACE`); column blocks
#: beat it for the wide classes at 2 threads and lose for the narrow one. oneDNN from 8 rows follows
#: ``generate.json`` (Llama-like decode at batch 8: ``use_onednn`` 1.67x the default's tokens/s at 2
#: threads, where the default took row blocks, 1.91x at 1 thread, where it took ``F.linear``; batch 4 split
#: between runs), until ``skinny.json`` measures oneDNN per shape.
TABLE: MappingProxyType[tuple[int, str], Paths] = MappingProxyType({
    (1, "narrow"): Paths(row_blocks_up_to=0, columns_up_to=0, onednn_from=8),
    (1, "short"): Paths(row_blocks_up_to=4, columns_up_to=0, onednn_from=8),
    (1, "long"): Paths(row_blocks_up_to=0, columns_up_to=0, onednn_from=8),
    (2, "narrow"): Paths(row_blocks_up_to=4, columns_up_to=0, onednn_from=8),
    (2, "short"): Paths(row_blocks_up_to=8, columns_up_to=32, onednn_from=8),
    (2, "long"): Paths(row_blocks_up_to=8, columns_up_to=32, onednn_from=8),
})


#: (threads, shape class) whose row-block range is decided by whole decode steps, not by the cells of one weight
#: read cold: small weights stay in cache between a step's products, which a cold single-product timing cannot
#: see. At 2 threads, with the narrow weights (QKV, output, down projections of the width-512 Llama of
#: ``benchmarks/generate.py``) on row blocks instead of ``F.linear``, whole decode steps took 0.74-0.90x the time
#: at batch 1 and 0.61-0.90x at batch 4 in every one of 5 interleaved repeats (2026-12-03), while cold single
#: 512 x 1376 products favoured ``F.linear`` (the cells ``skinny.json`` holds).
DECIDED_IN_PLACE: frozenset[tuple[int, str]] = frozenset({(2, "narrow")})


def shape_class(n_out: int, k: int) -> str:
    """``"narrow"`` (fewer than :data:`NARROW_OUTPUTS` outputs), ``"long"`` (more than :data:`LONG_INPUTS`
    inputs) or ``"short"``."""
    if n_out < NARROW_OUTPUTS:
        return "narrow"
    return "long" if k > LONG_INPUTS else "short"


def thread_class(threads: int | None = None) -> int:
    """The thread key of :data:`TABLE`: 1, or 2 for two threads and more (default: ``torch.get_num_threads()``)."""
    threads = torch.get_num_threads() if threads is None else threads
    return 1 if threads < 2 else 2


def choose(rows: int, n_out: int, k: int, *, threads: int | None = None, input_major: bool = False,
           onednn: bool = True) -> Path:
    """The path (one of :data:`PATHS`) for ``rows`` rows times an ``(n_out, k)`` weight.

    Args:
        rows: rows of the input (tokens in the step); ``n_out``, ``k``: the weight's outputs and inputs.
        threads: torch's thread count (default: ``torch.get_num_threads()``).
        input_major: the weight is stored input-major (column blocks instead of row blocks).
        onednn: the caller can run oneDNN on a packed copy; False falls back as the module notes say.
    """
    if rows < 1:
        return "linear"
    paths = TABLE[thread_class(threads), shape_class(n_out, k)]
    if onednn and 0 < paths.onednn_from <= rows:
        return "onednn"
    if input_major:
        return "columns" if rows <= paths.columns_up_to else "linear"
    return "row_blocks" if rows <= paths.row_blocks_up_to else "linear"
