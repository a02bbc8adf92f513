"""The products of a decode step, every CPU path on the same weights in one run, weights cold: the table the
product rule (``qkv.cpu.rule``) follows and ``tests/cpu/test_rule.py`` checks it against.

A decode step multiplies one row per sequence by every weight, so it must read every weight from memory once:
the floor is the weight's bytes over the memory read rate (``read_GB_s``: the best of 7 sums over a 256 MB
matrix at the row's thread count). For each weight shape (the products of a width-512 Llama: QKV 768 x 512,
output 512 x 512, gate/up 2752 x 512, down 512 x 1376, a 32000-token LM head; and 7B-sized ones) and 1 to 32
rows, every path multiplies the same values, forced (whatever the rule says):

- ``linear``: ``F.linear`` on the ``nn.Linear`` (standard, ``(N, K)`` row-major) weight, what HF runs;
- ``row_blocks``: ``qkv.cpu.skinny.by_rows`` on that weight, ``max(4, threads)`` row blocks;
- ``columns``: ``qkv.cpu.skinny.by_columns`` on an input-major copy (the blocks ``column_blocks`` would cut);
- ``onednn``: ``qkv.cpu.gemm.prepacked_linear`` on a copy packed once for oneDNN (where this torch runs it).

Before every call a 256 MB buffer is written, which evicts the weight from every cache level (a decode step
reads far more weights than the caches hold). Paths run round-robin, each repeat a set, so every ratio is
per repeat: ``a/b`` is path a's time over path b's (above 1: b is faster), reported as the median and range
over the repeats, for every pair of paths on one layout. ``rule`` (``rule_input_major``) is the path the
rule takes for the standard (input-major) weight, ``rule_no_onednn`` its fallback without oneDNN, and
``fastest`` the path with the lowest median. ``max_abs_diff`` compares every path with ``F.linear`` in
float64. ``tests/cpu/test_rule.py`` refuses a rule that takes a path another measured path beat in every
repeat.

Timed alone with the caches flushed, a small weight's product also pays for Python and torch state that
the flush evicted. ``decode_step`` settles the rule in place: one-token steps of a 4-layer, width-512
Llama-shaped ``qkv.nn.DecoderLM`` (vocabulary 32000) given ``qkv.cpu.optimize`` as it is (``rule``), with
``F.linear`` instead of row blocks on the narrow weights (``narrow_no_row_blocks``), without oneDNN
(``no_onednn``), and with oneDNN on the narrow weights from one row later or earlier than the rule
(``onednn_later``, ``onednn_earlier``), paired repeats of 32 steps each at 1, 2, 3, 4 and 8 rows. The narrow
class is settled here (``qkv.cpu.rule.DECIDED_IN_PLACE``). ``--fit JSON`` prints the row bands a product table
supports, the ones ``qkv.cpu.rule.TABLE`` follows.

``skinny_stream`` (alone with ``--stream``) times the weight-streaming kernel (``qkv_cpu::weight_linear``, which
``qkv.cpu.gemm.linear`` takes for float32 products of up to ``qkv.cpu.rule.STREAM_ROWS`` rows before the table)
against every other path, forced, weights cold, on the products of the Qwen2.5-0.5B and Llama-3.2-1B shapes at 1 to
4 rows; and whole decode steps of a Qwen2.5-0.5B-shaped ``DecoderLM`` (24 layers of width 896, vocabulary 151,936,
random weights) with the streaming kernel and without it (``no_stream/stream``), batch 1 and 2, paired repeats of 16
steps, greedy through ``next_tokens`` (the int8 head screen). ``tests/cpu/test_rule.py`` refuses ``STREAM_ROWS``
where another path beat the stream in every repeat.

``skinny_bf16`` (alone with ``--bf16``) is the same for bfloat16 rows and weights, at 1-4, 8 and 16 rows, against
``F.linear`` and oneDNN's bfloat16 GEMM on a packed copy (``qkv.cpu.rule.BF16_STREAM_ROWS`` follows it); its decode
steps (the same model in bfloat16, batch 1, 2 and 8) add ``stream_16``, the rule before this table (bf16 products
streamed up to 16 rows, the head screened at any row count); its ``head`` rows time a 151,936 x 896 head's greedy
tokens by the int8 screen and by the head's own packed product and argmax, bfloat16 and float32, 1-32 rows
(``qkv.cpu.greedy.SCREEN_ROWS`` follows them).

Published configuration (the defaults): torch's default thread count, then 1 thread; wall clock; 7 paired
repeats. Expected time on a quiet 2-core machine: about 15 minutes (4 of them ``skinny_stream``, 5
``skinny_bf16``).

Usage: ``python benchmarks/skinny.py [--quick] [--stream | --bf16] [--repeat R] [--threads T1,T2]``
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
from _harness import Suite, cold_times, ratio, read_rate  # noqa: E402
from qkv.cpu import rule  # noqa: E402
from qkv.cpu.gemm import PrepackedWeight, onednn_available, prepacked_linear  # noqa: E402
from qkv.cpu.skinny import BLOCK_ONE_ROW, BLOCK_ROWS, ROW_BLOCKS, by_columns, by_rows, input_major  # noqa: E402

SHAPES = [(768, 512), (512, 512), (2752, 512), (512, 1376), (32000, 512), (4096, 4096), (11008, 4096),
          (4096, 11008)]  # (N, K)
QUICK_SHAPES = [(2048, 64), (600, 256)]
ROWS = [1, 2, 4, 6, 8, 12, 16, 24, 32]
QUICK_ROWS = [1, 2, 8, 32]
STREAM_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864), (3072, 2048), (2048, 2048), (16384, 2048),
                 (2048, 8192)]  # Qwen2.5-0.5B's QKV, output, gate/up, down; Llama-3.2-1B's
STREAM_ROWS_MEASURED = [1, 2, 3, 4]
BF16_ROWS_MEASURED = [1, 2, 3, 4, 8, 16]
PAIRS = [("linear", "row_blocks"), ("linear", "onednn"), ("row_blocks", "onednn"), ("linear", "columns"),
         ("columns", "onednn")]


def _paths(x: torch.Tensor, w: torch.Tensor, w_im: torch.Tensor, packed: PrepackedWeight | None, threads: int):
    """Every path for x (rows, K) times w (N, K), forced."""
    rows, n = x.shape[0], w.shape[0]
    col_nb = max(threads, round(n / (BLOCK_ONE_ROW if rows == 1 else BLOCK_ROWS)))
    fns = {"linear": lambda: F.linear(x, w), "row_blocks": lambda: by_rows(x, w, max(ROW_BLOCKS, threads)),
           "columns": lambda: by_columns(x, w_im, col_nb)}
    if packed is not None:
        fns["onednn"] = lambda: prepacked_linear(x, w, None, packed)
    return fns


def _stream_table(shapes, rows_list: list[int], threads_list: list[int], repeat: int, quick: bool,
                  dtype: torch.dtype = torch.float32) -> None:
    """The streaming kernel against the rule's paths, forced, weights cold; then whole decode steps with and
    without it (table ``skinny_stream``; ``skinny_bf16`` for bfloat16 x and weights, with the LM head's screen
    against its product)."""
    from qkv.cpu import ops

    bf16 = dtype == torch.bfloat16
    evict = torch.empty((4 if quick else 64) * 1024 * 1024)
    name = "skinny_bf16" if bf16 else "skinny_stream"
    suite = Suite(name, f"decode-step products in {str(dtype).removeprefix('torch.')}: the weight-streaming kernel "
                  "(qkv_cpu::weight_linear) against F.linear, " + ("" if bf16 else "row blocks and ")
                  + "oneDNN, forced, weights cold; whole decode steps with and without it"
                  + ("; the LM head's int8 screen against its product by rows" if bf16 else ""),
                  threads=threads_list, repeat=repeat, clock="wall", dtype=str(dtype).removeprefix("torch."),
                  onednn=onednn_available(), stream_rows=rule.BF16_STREAM_ROWS if bf16 else rule.STREAM_ROWS)
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
        w64 = w.double()
        packed = PrepackedWeight() if onednn_available() else None
        for threads in threads_list:
            torch.set_num_threads(threads)
            rate = read_rate(threads)
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen).to(dtype)
                with torch.inference_mode():
                    fns = _paths(x, w, w, packed, threads)  # no input-major copy: its column path is not timed here
                    del fns["columns"]
                    if bf16:
                        del fns["row_blocks"]  # float32 only
                    fns["stream"] = lambda x=x: ops.weight_linear(x, w, None, None)
                    truth = F.linear(x.double(), w64)
                    diff = max(float((fn().double() - truth).abs().max()) for fn in fns.values())
                    t = cold_times(fns, repeat, evict)
                med = {c: statistics.median(v) for c, v in t.items()}
                floor = w.numel() * w.element_size() / rate
                results = {f"{c}_us": med[c] * 1e6 for c in t}
                results.update({f"{c}/stream": ratio(t[c], t["stream"]) for c in t if c != "stream"})
                results.update({"fastest": min(med, key=med.get), "read_GB_s": rate / 1e9, "floor_us": floor * 1e6,
                                "stream/floor": med["stream"] / floor, "max_abs_diff": diff})
                suite.add({"N": n, "K": k, "rows": rows, "threads": threads}, results)
                print(f"  {n}x{k} rows={rows} threads={threads}: " + ", ".join(
                    f"{c} {v * 1e6:.0f} us" for c, v in med.items()))
    _stream_steps(suite, threads_list, repeat, quick, dtype)
    if bf16:
        _head_rows(suite, threads_list, repeat, quick)
    suite.note("x/stream > 1: the streaming kernel is faster than path x (per paired repeat: median, lowest, "
               "highest). stream/floor: its median over the weight's bytes at read_GB_s. Decode steps: no_stream "
               "is the same optimized model with the streaming kernel switched off (the product rule's table)."
               + (" stream_16 streams bfloat16 products of up to 16 rows and screens the head at any row count "
                  "(the rule before this table). Head rows: the greedy tokens of a 151,936 x 896 head by the int8 "
                  "screen (HeadScreen.tokens) and by the head's product on a packed copy (oneDNN) and argmax; "
                  "head/screen > 1: the screen is faster." if bf16 else ""))
    suite.finish()


def _head_rows(suite, threads_list: list[int], repeat: int, quick: bool) -> None:
    """The greedy tokens of a Qwen2.5-0.5B-sized head by its screen and by its own product, bf16 and float32."""
    from qkv.cpu.greedy import HeadScreen

    V, K = (4096, 64) if quick else (151936, 896)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        w = (torch.randn(V, K, generator=gen) / K ** 0.5).to(dtype)
        screen, packed = HeadScreen(), PrepackedWeight()
        for threads in threads_list:
            torch.set_num_threads(threads)
            for rows in (1, 2, 4, 8, 16, 32):
                x = torch.randn(rows, K, generator=gen).to(dtype)
                fns = {"screen": lambda x=x: screen.tokens(x, w),
                       "head": lambda x=x: prepacked_linear(x, w, None, packed).argmax(-1)}
                with torch.inference_mode():
                    t = cold_times(fns, repeat, torch.empty(1))
                suite.add({"head": f"{V}x{K}", "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                           "threads": threads},
                          {"screen_ms": statistics.median(t["screen"]) * 1e3,
                           "head_ms": statistics.median(t["head"]) * 1e3,
                           "head/screen": ratio(t["head"], t["screen"])})
                print(f"  head {dtype} rows={rows} threads={threads}: head/screen "
                      f"{suite.rows[-1]['head/screen']['median']:.2f}")


def _stream_steps(suite, threads_list: list[int], repeat: int, quick: bool,
                  dtype: torch.dtype = torch.float32) -> None:
    from qkv.cache import KVCache, Static
    from qkv.cpu import gemm, greedy, optimize
    from qkv.nn import DecoderConfig, DecoderLM

    width, layers, vocab, inter = (64, 2, 512, 256) if quick else (896, 24, 151936, 4864)
    config = DecoderConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=14,
                           num_key_value_heads=2, intermediate_size=inter, tie_word_embeddings=True,
                           qkv_bias=True)
    torch.manual_seed(0)
    model = optimize(DecoderLM(config).eval().to(dtype))
    steps, prompt = (4, 8) if quick else (16, 32)
    streamed, screen_rows = gemm._STREAMED_ROWS, greedy.SCREEN_ROWS
    bf16 = dtype == torch.bfloat16
    variants = ("stream", "no_stream", "stream_16") if bf16 else ("stream", "no_stream")
    for threads in threads_list:
        torch.set_num_threads(threads)
        for B in (1, 2, 8) if bf16 else (1, 2):
            ids = torch.randint(0, vocab, (B, prompt))

            def run(name):
                gemm._STREAMED_ROWS = {"stream": streamed, "no_stream": {},
                                       "stream_16": {**streamed, torch.bfloat16: 16}}[name]
                greedy.SCREEN_ROWS = {dtype: 1 << 30} if name == "stream_16" else screen_rows
                try:
                    cache = KVCache(model.cache_specs(), storage=Static(prompt + steps))
                    model(ids, cache=cache, logits_to_keep=1)
                    tok = ids[:, -1:]
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        tok = model.next_tokens(tok, cache=cache)[:, None]  # greedy, through the head screen
                    return (time.perf_counter() - t0) / steps
                finally:
                    gemm._STREAMED_ROWS, greedy.SCREEN_ROWS = streamed, screen_rows

            with torch.inference_mode():
                for name in variants:
                    run(name)
                t: dict[str, list[float]] = {name: [] for name in variants}
                for _ in range(repeat):
                    for name in t:
                        t[name].append(run(name))
            results = {f"{name}_ms": statistics.median(t[name]) * 1e3 for name in variants}
            results.update({f"{name}/stream": ratio(t[name], t["stream"]) for name in variants if name != "stream"})
            suite.add({"decode_step": f"Qwen2.5-0.5B-shaped, {layers} x {width}, vocabulary {vocab}", "B": B,
                       "threads": threads}, results)
            print(f"  decode step B={B} threads={threads}: no_stream/stream "
                  f"{suite.rows[-1]['no_stream/stream']['median']:.2f}")


def _product_table(shapes, rows_list: list[int], threads_list: list[int], repeat: int, quick: bool) -> None:
    evict = torch.empty((4 if quick else 64) * 1024 * 1024)  # 16 MB quick, 256 MB published
    suite = Suite("skinny", "decode-step products: every CPU path (row blocks, column blocks, oneDNN, F.linear) "
                  "forced, weights cold", threads=threads_list, repeat=repeat, clock="wall", dtype="float32",
                  onednn=onednn_available())
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        w_im = input_major(w)
        w64 = w.double()
        packed = PrepackedWeight() if onednn_available() else None
        for threads in threads_list:
            rate = read_rate(threads)
            torch.set_num_threads(threads)
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen)
                with torch.inference_mode():
                    fns = _paths(x, w, w_im, packed, threads)
                    truth = F.linear(x.double(), w64)
                    diff = max(float((fn().double() - truth).abs().max()) for fn in fns.values())
                    t = cold_times(fns, repeat, evict)
                med = {c: statistics.median(v) for c, v in t.items()}
                floor = w.numel() * w.element_size() / rate
                fastest = min(med, key=med.get)
                results = {f"{c}_us": med[c] * 1e6 for c in t}
                results.update({f"{a}/{b}": ratio(t[a], t[b]) for a, b in PAIRS if a in t and b in t})
                results.update({
                    "shape_class": rule.shape_class(n, k),
                    "rule": rule.choose(rows, n, k, threads=threads, onednn=packed is not None),
                    "rule_no_onednn": rule.choose(rows, n, k, threads=threads, onednn=False),
                    "rule_input_major": rule.choose(rows, n, k, threads=threads, input_major=True,
                                                    onednn=packed is not None),
                    "fastest": fastest, "read_GB_s": rate / 1e9, "floor_us": floor * 1e6,
                    "fastest/floor": med[fastest] / floor, "max_abs_diff": diff})
                row = suite.add({"N": n, "K": k, "rows": rows, "threads": threads}, results)
                print(f"  {n}x{k} rows={rows} threads={threads}: fastest {fastest}, rule {row['rule']} "
                      f"({', '.join(f'{c} {v * 1e6:.0f} us' for c, v in med.items())})")
    suite.note("a/b > 1: path b is faster than path a (per paired repeat: the median, lowest and highest). rule: the "
               "path qkv.cpu.rule.choose takes (oneDNN where it runs); rule_no_onednn: its fallback without "
               "oneDNN; fastest: the lowest median. tests/cpu/test_rule.py checks that no rule decision takes a "
               "path another path beat in every repeat; where it fails after a new run, change "
               "qkv.cpu.rule.TABLE to follow the table.")
    suite.finish()


DECISIONS = {"standard_onednn": ("linear", "row_blocks", "onednn"), "standard": ("linear", "row_blocks"),
             "input_major_onednn": ("linear", "columns", "onednn"), "input_major": ("linear", "columns")}


def _pair_ratio(row: dict, a: str, b: str) -> dict | None:
    """time_a / time_b per repeat ({min, median, max}) from a table row, whichever order it stores."""
    if isinstance(row.get(f"{a}/{b}"), dict):
        return row[f"{a}/{b}"]
    r = row.get(f"{b}/{a}")
    return {"min": 1 / r["max"], "median": 1 / r["median"], "max": 1 / r["min"]} if isinstance(r, dict) else None


def allowed(row: dict, contenders: tuple[str, ...]) -> list[str]:
    """The contenders no other contender beat in every repeat of this cell."""
    ok = []
    for p in contenders:
        if f"{p}_us" not in row:
            continue
        beaten = [o for o in contenders if o != p and (r := _pair_ratio(row, p, o)) is not None and r["min"] > 1]
        if not beaten:
            ok.append(p)
    return ok


def fit(payload: dict) -> dict:
    """Row bands per (thread class, shape class) that follow a skinny table: for each measured row count and
    decision (:data:`DECISIONS`), the path every shape of the class allows, the cheapest by the mean log time
    over the fastest where several do and the previous row count's path is not among them (a conflict, listed,
    where none does: the path losing least); then equal neighbouring row counts merged.

    Returns {(threads, class): [(up_to, {decision: path}), ...], "conflicts": [...]}."""
    import math

    cells: dict = {}
    for row in payload["rows"]:
        key = (rule.thread_class(row["threads"]), rule.shape_class(row["N"], row["K"]))
        cells.setdefault(key, {}).setdefault(row["rows"], []).append(row)
    out: dict = {"conflicts": []}
    for key, per_rows in sorted(cells.items()):
        bands: list = []
        for rows in sorted(per_rows):
            pick = {}
            for decision, contenders in DECISIONS.items():
                group = per_rows[rows]
                present = [c for c in contenders if all(f"{c}_us" in r for r in group)]
                if not present:
                    continue

                def cost(p):
                    return sum(math.log(r[f"{p}_us"] / min(r[f"{c}_us"] for c in present)) for r in group)
                common = [p for p in present if all(p in allowed(r, tuple(present)) for r in group)]
                if not common:
                    out["conflicts"].append(f"{key} rows={rows} {decision}: no path allowed for every shape")
                before = bands[-1][1].get(decision) if bands else None
                pick[decision] = before if before in common else min(common or present, key=cost)
            if bands and bands[-1][1] == pick:
                bands[-1] = (rows, pick)
            else:
                bands.append((rows, pick))
        out[key] = bands
    return out


def _decode_step(threads_list: list[int], repeat: int, quick: bool) -> None:
    """One-token decode steps of an optimized model under the rule and two alternatives (table ``skinny_decode``)."""
    import copy

    from qkv.cache import KVCache, Static
    from qkv.cpu import optimize
    from qkv.nn import DecoderConfig, DecoderLM

    width, vocab = (64, 512) if quick else (512, 32000)
    config = DecoderConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2, intermediate_size=width * 43 // 16, tie_word_embeddings=False)
    torch.manual_seed(0)
    plain = DecoderLM(config).eval()
    models = {"rule": optimize(copy.deepcopy(plain)), "no_onednn": optimize(copy.deepcopy(plain), onednn=False)}
    # the narrow bands are settled on whole steps: the rule against oneDNN one row later / earlier on the narrow
    # weights, no row blocks on them (cold single products favour F.linear there), and no oneDNN at all
    blocks = {t: rule.NARROW_SWITCHES[t][0] for t in (1, 2)}
    first_dnn = {t: rule.NARROW_SWITCHES[t][1] for t in (1, 2)}

    def narrow_table(row_blocks_up_to, onednn_from):
        return {**rule.TABLE, **{(t, "narrow"): rule.switches(row_blocks_up_to(t), onednn_from(t)) for t in (1, 2)}}
    tables = {"rule": rule.TABLE, "no_onednn": rule.TABLE,
              "narrow_no_row_blocks": narrow_table(lambda t: 0, lambda t: first_dnn[t]),
              "onednn_later": narrow_table(lambda t: blocks[t], lambda t: first_dnn[t] + 1),
              "onednn_earlier": narrow_table(lambda t: blocks[t], lambda t: max(1, first_dnn[t] - 1))}
    for name in tables:
        models.setdefault(name, models["rule"])
    steps, prompt = (8, 8) if quick else (32, 64)
    suite = Suite("skinny_decode", "decode steps of an optimized model: the rule against two alternatives",
                  model=f"Llama-shaped DecoderLM, 4 layers, width {width}, vocabulary {vocab}", steps=steps,
                  prompt=prompt, repeat=repeat, clock="wall", dtype="float32", onednn=onednn_available())
    table = rule.TABLE
    for threads in threads_list:
        torch.set_num_threads(threads)
        for B in (1, 2, 3, 4, 8):
            ids = torch.randint(0, vocab, (B, prompt))

            def run(name):
                def go():
                    rule.TABLE = tables[name]
                    try:
                        model = models[name]
                        cache = KVCache(model.cache_specs(), storage=Static(prompt + steps))
                        model(ids, cache=cache, logits_to_keep=1)
                        tok = ids[:, -1:]
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            tok = model(tok, cache=cache).logits.argmax(-1)
                        return (time.perf_counter() - t0) / steps
                    finally:
                        rule.TABLE = table
                return go

            with torch.inference_mode():
                for name in models:
                    run(name)()
                t: dict[str, list[float]] = {name: [] for name in models}
                for _ in range(repeat):
                    for name in models:
                        t[name].append(run(name)())
            suite.add({"B": B, "threads": threads}, {
                **{f"{name}_us": statistics.median(v) * 1e6 for name, v in t.items()},
                "narrow_no_row_blocks/rule": ratio(t["narrow_no_row_blocks"], t["rule"]),
                "no_onednn/rule": ratio(t["no_onednn"], t["rule"]),
                "onednn_later/rule": ratio(t["onednn_later"], t["rule"]),
                "onednn_earlier/rule": ratio(t["onednn_earlier"], t["rule"])})
            print(f"  decode step B={B} threads={threads}: " + ", ".join(
                f"{k} {v['median']:.2f}" for k, v in suite.rows[-1].items() if k.endswith("/rule")))
    suite.note("x/rule > 1: the step is faster under the rule than under x. narrow_no_row_blocks: F.linear instead "
               "of row blocks on the narrow weights (QKV, output and down projections here); no_onednn: "
               "optimize(onednn=False); onednn_later / onednn_earlier: oneDNN from one row later / earlier than "
               "the rule on the narrow weights.")
    suite.finish()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two small shapes, 4 row counts, 3 repeats (a smoke run)")
    p.add_argument("--repeat", type=int, default=None, help="paired repeats per case (default 7; 3 with --quick)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: torch's own, then 1)")
    p.add_argument("--stream", action="store_true", help="only the streaming kernel's table (skinny_stream)")
    p.add_argument("--bf16", action="store_true", help="only the bfloat16 table (skinny_bf16)")
    p.add_argument("--fit", metavar="JSON", default=None,
                   help="print the row bands a skinny.json supports (qkv.cpu.rule.TABLE follows them) and exit")
    args = p.parse_args(argv)
    if args.fit:
        import json

        fitted = fit(json.loads(Path(args.fit).read_text()))
        for key, bands in fitted.items():
            if key != "conflicts":
                text = ", ".join(f"Band({up_to}, " + ", ".join(map(repr, pick.values())) + ")" for up_to, pick in bands)
                print(f"    {key!r}: ({text}{',' if len(bands) == 1 else ''}),".replace("'", '"'))
        print("conflicts:", *fitted["conflicts"], sep="\n  ")
        return
    repeat = args.repeat or (3 if args.quick else 7)
    default_threads = torch.get_num_threads()
    threads_list = ([int(t) for t in args.threads.split(",")] if args.threads
                    else list(dict.fromkeys([default_threads, 1])))
    if not (args.stream or args.bf16):
        _product_table(QUICK_SHAPES if args.quick else SHAPES, QUICK_ROWS if args.quick else ROWS, threads_list,
                       repeat, args.quick)
        _decode_step(threads_list, repeat, args.quick)
    if not args.bf16:
        _stream_table(QUICK_SHAPES if args.quick else STREAM_SHAPES, STREAM_ROWS_MEASURED, threads_list, repeat,
                      args.quick)
    if not args.stream:
        _stream_table(QUICK_SHAPES if args.quick else STREAM_SHAPES, BF16_ROWS_MEASURED, threads_list, repeat,
                      args.quick, torch.bfloat16)
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
