"""Few-row products, the GEMMs of a decode step: ``qkv.cpu.skinny.skinny_linear`` against ``F.linear`` on the
same weights, in one run, weights cold.

A decode step multiplies one row per sequence by every weight, so it must read every weight from memory once:
the floor is the weight's bytes over the memory read rate (``read_GB_s``: the best of 7 sums over a 256 MB
matrix at the row's thread count). For each weight shape (a 32000-token LM head, a gate/up and a down
projection of width 512, and 7B-sized ones) and 1, 2, 4 and 8 rows, three contenders multiply the same
values:

- ``linear``: ``F.linear`` on the ``nn.Linear`` (standard, ``(N, K)`` row-major) weight, what HF runs;
- ``rows``: ``skinny_linear`` on that same weight (row blocks where its rule takes them, else ``F.linear``);
- ``input_major``: ``skinny_linear`` on an input-major copy (column blocks where its rule takes them).

Before every call a 256 MB buffer is written, which evicts the weight from every cache level (a decode step
reads far more weights than the caches hold). Contenders run round-robin, each repeat a set, so each
ratio is per repeat: ``linear/rows`` is ``F.linear``'s time over ``skinny_linear``'s on the standard
weight, reported as the median and range over repeats. ``rows_path`` says which path the rule took (so a
row where it is ``F.linear`` shows the rule declining). ``max_abs_diff`` compares both blocked results with
``F.linear`` in float64.

Published configuration (the defaults): torch's default thread count, then 1 thread; wall clock; 7 paired
repeats. Expected time on a quiet 2-core machine: about 2 minutes.

Usage: ``python benchmarks/skinny.py [--quick] [--repeat R] [--threads T1,T2]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Suite, ratio  # noqa: E402
from qkv.cpu.skinny import input_major, row_blocks, skinny_blocks, skinny_linear  # noqa: E402

SHAPES = [(32000, 512), (2752, 512), (512, 1376), (4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K)
QUICK_SHAPES = [(2048, 64), (600, 256)]
ROWS = [1, 2, 4, 8]


def read_rate(threads: int) -> float:
    """Bytes/s at which ``threads`` threads read a 256 MB float32 matrix once (a sum), the best of 7."""
    torch.set_num_threads(threads)
    w = torch.randn(32768, 2048)
    w.sum()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        w.sum()
        times.append(time.perf_counter() - t0)
    return w.numel() * w.element_size() / min(times)


def _cold_times(fns: dict, repeat: int, evict: torch.Tensor) -> dict[str, list[float]]:
    """Seconds per call of each contender, round-robin, the caches flushed before every call."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            evict.add_(1.0)
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def _path(rows: int, n: int, k: int, threads: int, layout: str) -> str:
    if layout == "standard":
        nb = row_blocks(rows, n, k, threads)
        return f"{nb} row blocks" if nb > 1 else "F.linear"
    nb = skinny_blocks(rows, n, threads)
    return f"{nb} column blocks" if nb > 1 else "F.linear"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two small shapes, 3 repeats (a smoke run)")
    p.add_argument("--repeat", type=int, default=None, help="paired repeats per case (default 7; 3 with --quick)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: torch's own, then 1)")
    args = p.parse_args(argv)
    repeat = args.repeat or (3 if args.quick else 7)
    default_threads = torch.get_num_threads()
    threads_list = ([int(t) for t in args.threads.split(",")] if args.threads
                    else list(dict.fromkeys([default_threads, 1])))
    shapes = QUICK_SHAPES if args.quick else SHAPES
    evict = torch.empty((4 if args.quick else 64) * 1024 * 1024)  # 16 MB quick, 256 MB published
    suite = Suite("skinny", "few-row products: skinny_linear (row / column blocks) against F.linear, weights cold",
                  threads=threads_list, repeat=repeat, clock="wall", dtype="float32")
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        w_im = input_major(w)
        w64 = w.double()
        for threads in threads_list:
            rate = read_rate(threads)
            torch.set_num_threads(threads)
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen)
                with torch.inference_mode():
                    truth = F.linear(x.double(), w64)
                    diff = max(float((skinny_linear(x, w) - truth).abs().max()),
                               float((skinny_linear(x, w_im) - truth).abs().max()))
                    t = _cold_times({"linear": lambda: F.linear(x, w), "rows": lambda: skinny_linear(x, w),
                                     "input_major": lambda: skinny_linear(x, w_im)}, repeat, evict)
                med = {c: statistics.median(v) for c, v in t.items()}
                floor = w.numel() * w.element_size() / rate
                row = suite.add({"N": n, "K": k, "rows": rows, "threads": threads}, {
                    "linear_us": med["linear"] * 1e6, "rows_us": med["rows"] * 1e6,
                    "input_major_us": med["input_major"] * 1e6,
                    "linear/rows": ratio(t["linear"], t["rows"]),
                    "linear/input_major": ratio(t["linear"], t["input_major"]),
                    "rows_path": _path(rows, n, k, threads, "standard"),
                    "input_major_path": _path(rows, n, k, threads, "input_major"),
                    "read_GB_s": rate / 1e9, "floor_us": floor * 1e6, "rows/floor": med["rows"] / floor,
                    "linear/floor": med["linear"] / floor, "max_abs_diff": diff})
                print(f"  {n}x{k} rows={rows} threads={threads}: linear/rows {row['linear/rows']['median']:.2f} "
                      f"({row['rows_path']}), linear/input_major {row['linear/input_major']['median']:.2f}")
    torch.set_num_threads(default_threads)
    suite.note("linear/rows > 1: skinny_linear on the standard weight (the decoder's default) is faster than "
               "F.linear; rows/floor: its time over the weight's bytes at the read rate (1 = bound by memory). "
               "The rule in qkv.cpu.skinny (row blocks for 1-4 rows; with one thread only for K <= 1024; column "
               "blocks of input-major weights for 1-32 rows and several threads) was chosen from this table.")
    suite.finish()


if __name__ == "__main__":
    main()
