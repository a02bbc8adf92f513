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

Timed alone with the caches flushed, a small weight's product also pays for Python and torch state that
the flush evicted, so the table understates row blocks on small weights. ``decode_step`` settles those in
place: a one-token decode step of a 4-layer, width-512 Llama-shaped ``qkv.nn.DecoderLM`` (vocabulary 32000)
with the rule as it is (``rule``), against the same step with every weight under ``SMALL_BYTES`` through
``F.linear`` (``small_linear``), paired repeats of 32 steps each.

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
from _harness import Suite, ratio, read_rate  # noqa: E402
from qkv.cpu.skinny import input_major, row_blocks, skinny_blocks, skinny_linear  # noqa: E402

SHAPES = [(32000, 512), (2752, 512), (512, 1376), (4096, 4096), (11008, 4096), (4096, 11008)]  # (N, K)
QUICK_SHAPES = [(2048, 64), (600, 256)]
ROWS = [1, 2, 4, 6, 8]
SMALL_BYTES = 4 << 20


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


def _decode_step(threads_list: list[int], repeat: int, quick: bool) -> None:
    """One-token decode steps with the rule as it is against small weights through ``F.linear`` (table
    ``skinny_decode``)."""
    import qkv.cpu.skinny as skinny
    from qkv.cache import KVCache, Static
    from qkv.nn import DecoderConfig, DecoderLM

    rule = skinny.row_blocks

    def small_linear(rows, n_out, k, threads=None):
        return 1 if n_out * k * 4 < SMALL_BYTES else rule(rows, n_out, k, threads)

    width, vocab = (64, 512) if quick else (512, 32000)
    config = DecoderConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2, intermediate_size=width * 43 // 16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    steps, prompt = (8, 8) if quick else (32, 64)
    suite = Suite("skinny_decode", "decode steps: row blocks on every weight against small weights through F.linear",
                  model=f"Llama-shaped DecoderLM, 4 layers, width {width}, vocabulary {vocab}", steps=steps,
                  prompt=prompt, repeat=repeat, clock="wall", dtype="float32", small_bytes=SMALL_BYTES)
    for threads in threads_list:
        torch.set_num_threads(threads)
        for B in (1, 4):
            ids = torch.randint(0, vocab, (B, prompt))

            def run(choice):
                def go():
                    skinny.row_blocks = choice
                    try:
                        cache = KVCache(model.cache_specs(), storage=Static(prompt + steps))
                        model(ids, cache=cache, logits_to_keep=1)
                        tok = ids[:, -1:]
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            tok = model(tok, cache=cache).logits.argmax(-1)
                        return (time.perf_counter() - t0) / steps
                    finally:
                        skinny.row_blocks = rule
                return go

            with torch.inference_mode():
                run(rule)()
                t: dict[str, list[float]] = {"rule": [], "small_linear": []}
                for _ in range(repeat):
                    for name, choice in (("rule", rule), ("small_linear", small_linear)):
                        t[name].append(run(choice)())
            suite.add({"B": B, "threads": threads}, {
                "rule_us": statistics.median(t["rule"]) * 1e6,
                "small_linear_us": statistics.median(t["small_linear"]) * 1e6,
                "small_linear/rule": ratio(t["small_linear"], t["rule"]),
                "weights_under_small_bytes": sum(1 for p in model.parameters() if p.dim() == 2
                                                 and p.numel() * 4 < SMALL_BYTES)})
            print(f"  decode step B={B} threads={threads}: small_linear/rule "
                  f"{suite.rows[-1]['small_linear/rule']['median']:.2f}")
    suite.note("small_linear/rule > 1: the step is faster with row blocks on the small weights too (every "
               "weight here but the embedding and the LM head is under small_bytes).")
    suite.finish()


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
               "The rule in qkv.cpu.skinny (row blocks for 1-8 rows; with one thread 1-4 rows of K <= 1024; column "
               "blocks of input-major weights for 1-32 rows and several threads) was chosen from this table and its "
               "skinny_decode table.")
    suite.finish()
    _decode_step(threads_list, repeat, args.quick)
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
