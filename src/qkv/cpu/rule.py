"""The product rule: which kernel multiplies ``rows`` rows by an ``(n_out, k)`` weight on CPU, as one table.

Shape legend: M rows (tokens in the step), K inputs (``k``), N outputs (``n_out``).

Four paths compute the same ``F.linear(x, weight)`` (float32; float64 for the blocked ones):

- ``"row_blocks"``: a standard ``(N, K)`` weight cut into row blocks, one batched GEMM over torch's threads
  (:func:`qkv.cpu.skinny.skinny_linear`);
- ``"columns"``: an input-major weight (``.t()`` contiguous) cut into column blocks (the same function);
- ``"onednn"``: oneDNN on a copy of the weight packed once (:mod:`qkv.cpu.gemm`), where this torch build
  runs it and the caller holds a packed copy;
- ``"linear"``: ``F.linear`` (MKL).

Before the table, a float32 product of at most :data:`STREAM_ROWS` rows (a decode step's one or two sequences)
streams its weight through the compiled ``qkv_cpu::weight_linear`` where it is built (:func:`qkv.cpu.gemm.linear`
decides it; ``benchmarks/skinny.py`` times it as the ``"stream"`` path beside the four): one weight row at a time,
on torch's threads, where MKL's single-row product runs on one thread at about half the memory's rate.

:data:`TABLE` decides, keyed by thread count (1, or 2 meaning two or more) and shape class
(:func:`shape_class`), as row bands (:class:`Band`): for 1 to ``up_to`` rows (after the band before), the
path for each weight layout with and without oneDNN (a caller without a packed copy, a torch build without
oneDNN, ``qkv.cpu.optimize(onednn=False)``). Past the last measured band (32 rows) oneDNN where the last band
takes it, else ``F.linear``.

The bands follow ``benchmarks/results/skinny.json`` (``benchmarks/skinny.py`` writes it; ``python
benchmarks/skinny.py --fit benchmarks/results/skinny.json`` prints the bands it supports, and
``tests/cpu/test_rule.py`` checks every measured cell against :func:`choose`): a path is never taken where
another measured path was faster in every paired repeat. The narrow class is the exception
(:data:`DECIDED_IN_PLACE`): timed alone with the caches flushed a small weight's product pays for what a
whole decode step keeps in cache, so its bands follow whole decode steps (``skinny_decode.json``, checked by
the same test against oneDNN one row earlier and later, no row blocks and no oneDNN).

Example:
    >>> from qkv.cpu.rule import choose, shape_class
    >>> shape_class(32000, 512), shape_class(512, 1376), shape_class(11008, 4096), shape_class(4096, 11008)
    ('short', 'narrow', 'wide', 'long')
    >>> choose(1, 32000, 512, threads=2), choose(8, 512, 1376, threads=1), choose(1, 11008, 4096, threads=1)
    ('linear', 'onednn', 'onednn')
    >>> choose(32, 512, 1376, threads=2, onednn=False)
    'linear'
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Literal, NamedTuple

import torch

__all__ = ["Band", "TABLE", "PATHS", "NARROW_OUTPUTS", "LONG_INPUTS", "MEASURED_ROWS", "STREAM_ROWS",
           "BF16_STREAM_ROWS", "DECIDED_IN_PLACE", "NARROW_SWITCHES", "switches", "shape_class", "thread_class",
           "choose"]

Path = Literal["row_blocks", "columns", "onednn", "linear"]
#: The paths :func:`choose` names.
PATHS: tuple[str, ...] = ("row_blocks", "columns", "onednn", "linear")

NARROW_OUTPUTS = 1024  # fewer outputs than this: "narrow"
LONG_INPUTS = 1024  # more inputs than this (and not narrow): "wide" or "long", else "short"
MEASURED_ROWS = 32  # the bands cover 1 .. this many rows
#: A float32 product of at most this many rows streams its weight through ``qkv_cpu::weight_linear`` where it runs
#: (decided before :data:`TABLE`); from three rows the tiles that reuse each weight vector over rows win.
STREAM_ROWS = 2
#: A bfloat16 product (x and weight in bfloat16) of at most this many rows streams its weight the same way; from
#: three rows oneDNN's bfloat16 GEMM on a copy packed once (``qkv.cpu.gemm.linear``, where oneDNN runs here) is
#: faster (AVX512-BF16 dot products), else ``F.linear``. Checked against ``benchmarks/results/skinny_bf16.json``.
BF16_STREAM_ROWS = 2


class Band(NamedTuple):
    """Rows from the band before's ``up_to`` + 1 to ``up_to``: the path for a standard weight and for an
    input-major one, where oneDNN can run and where it cannot."""

    up_to: int
    standard: Path  # "onednn", "row_blocks" or "linear"
    standard_no_onednn: Path  # "row_blocks" or "linear"
    input_major: Path  # "onednn", "columns" or "linear"
    input_major_no_onednn: Path  # "columns" or "linear"


def switches(row_blocks_up_to: int, onednn_from: int) -> tuple[Band, ...]:
    """Bands for a class decided by two row counts: row blocks (standard weight) for 1 to
    ``row_blocks_up_to`` rows, oneDNN from ``onednn_from`` rows on (where it runs), ``F.linear`` otherwise."""
    bands: list[Band] = []
    for rows in range(1, MEASURED_ROWS + 1):
        blocks = "row_blocks" if rows <= row_blocks_up_to else "linear"
        dnn = rows >= onednn_from
        band = Band(rows, "onednn" if dnn else blocks, blocks, "onednn" if dnn else "linear", "linear")
        if bands and bands[-1][1:] == band[1:]:
            bands[-1] = band
        else:
            bands.append(band)
    return tuple(bands)


#: Thread class -> (row_blocks_up_to, onednn_from) of the narrow class (:func:`switches`), settled on whole
#: decode steps (:data:`DECIDED_IN_PLACE`; ``benchmarks/skinny.py`` times one row either side of them).
NARROW_SWITCHES: MappingProxyType[int, tuple[int, int]] = MappingProxyType({1: (0, 3), 2: (0, 3)})


#: (threads: 1, or 2 for two and more; shape class) -> row bands. The bands of the short, wide and long classes
#: are those ``python benchmarks/skinny.py --fit benchmarks/results/skinny.json`` prints for the committed run
#: (2-core Intel Xeon with AVX-512 and AMX, MKL, weights cold, 2026-12-05: LM head 32000x512, gate/up 2752x512,
#: 4096x4096, 11008x4096, 4096x11008; 1-32 rows): ``F.linear`` for 1-2 rows of the short and long classes (row
#: blocks, which won there on the 2-core AMD EPYC of the table before, ran at about half its speed on this CPU),
#: oneDNN from 3 rows, row blocks only where they won every repeat; between the paths without oneDNN, 10-20%
#: differences flip between runs, so those bands move with each new table. Narrow (QKV 768x512, output 512x512,
#: down 512x1376): whole decode steps of the width-512 Llama (``skinny_decode.json``): ``F.linear`` for 1-2 rows
#: (row blocks lost every repeat at one row and one thread), oneDNN from 3 rows.
TABLE: MappingProxyType[tuple[int, str], tuple[Band, ...]] = MappingProxyType({
    (1, "narrow"): switches(*NARROW_SWITCHES[1]),
    (1, "short"): (Band(1, "linear", "linear", "columns", "columns"),
                   Band(2, "linear", "linear", "linear", "linear"),
                   Band(6, "onednn", "linear", "onednn", "columns"),
                   Band(12, "onednn", "row_blocks", "onednn", "columns"),
                   Band(32, "onednn", "linear", "onednn", "linear")),
    (1, "wide"): (Band(1, "onednn", "linear", "onednn", "linear"),
                  Band(2, "linear", "linear", "linear", "linear"),
                  Band(4, "onednn", "linear", "onednn", "columns"),
                  Band(12, "onednn", "row_blocks", "onednn", "columns"),
                  Band(24, "onednn", "row_blocks", "onednn", "linear"),
                  Band(32, "row_blocks", "row_blocks", "onednn", "linear")),
    (1, "long"): (Band(2, "linear", "linear", "linear", "linear"),
                  Band(12, "onednn", "row_blocks", "onednn", "columns"),
                  Band(32, "row_blocks", "row_blocks", "onednn", "linear")),
    (2, "narrow"): switches(*NARROW_SWITCHES[2]),
    (2, "short"): (Band(2, "linear", "linear", "linear", "linear"),
                   Band(4, "onednn", "linear", "onednn", "columns"),
                   Band(6, "onednn", "linear", "onednn", "linear"),
                   Band(32, "onednn", "row_blocks", "onednn", "columns")),
    (2, "wide"): (Band(6, "onednn", "linear", "onednn", "linear"),
                  Band(12, "onednn", "row_blocks", "onednn", "columns"),
                  Band(32, "onednn", "row_blocks", "onednn", "linear")),
    (2, "long"): (Band(2, "linear", "linear", "linear", "linear"),
                  Band(12, "onednn", "row_blocks", "onednn", "columns"),
                  Band(16, "row_blocks", "row_blocks", "onednn", "linear"),
                  Band(24, "onednn", "row_blocks", "onednn", "linear"),
                  Band(32, "row_blocks", "row_blocks", "onednn", "linear")),
})

#: (threads, shape class) whose bands follow whole decode steps, not the cells of one weight read cold: small
#: weights stay in cache between a step's products, which a cold single-product timing cannot see (cold,
#: ``F.linear`` beats oneDNN on 512 x 512 at 4-32 rows; in whole steps oneDNN from 3 rows is faster).
DECIDED_IN_PLACE: frozenset[tuple[int, str]] = frozenset({(1, "narrow"), (2, "narrow")})


def shape_class(n_out: int, k: int) -> str:
    """``"narrow"`` (fewer than :data:`NARROW_OUTPUTS` outputs), ``"short"`` (at most :data:`LONG_INPUTS`
    inputs), ``"wide"`` (more inputs, at least twice as many outputs: up projections) or ``"long"``."""
    if n_out < NARROW_OUTPUTS:
        return "narrow"
    if k <= LONG_INPUTS:
        return "short"
    return "wide" if n_out >= 2 * k else "long"


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
        onednn: the caller can run oneDNN on a packed copy; False takes the bands' paths without it.
    """
    if rows < 1:
        return "linear"
    global _memo_table
    if _memo_table is not TABLE or len(_memo) > 65536:  # a table swapped in (skinny.py, tests): decide anew
        _memo.clear()
        _memo_table = TABLE
    key = (rows, n_out, k, thread_class(threads), input_major, onednn)
    path = _memo.get(key)
    if path is None:
        path = _memo[key] = _lookup(*key)
    return path


_memo: dict[tuple, Path] = {}  # a decode step asks for every product: the answers for the table in force
_memo_table = None


def _lookup(rows: int, n_out: int, k: int, threads: int, input_major: bool, onednn: bool) -> Path:
    bands = TABLE[threads, shape_class(n_out, k)]
    band = next((b for b in bands if rows <= b.up_to), None)
    if band is None:  # more rows than measured: oneDNN where the last band takes it, else F.linear
        last = bands[-1]
        return "onednn" if onednn and "onednn" in (last.standard, last.input_major) else "linear"
    if input_major:
        return band.input_major if onednn else band.input_major_no_onednn
    return band.standard if onednn else band.standard_no_onednn
