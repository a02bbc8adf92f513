"""Decode with narrower weights: float32 against bfloat16 and int8 weights (``qkv.cpu.weights``), products and
whole steps, weights cold (#49).

A decode step reads every weight once, so its floor is the weights' bytes over the memory read rate
(``read_GB_s``, ``_harness.read_rate``): bfloat16 halves the bytes, int8 quarters them. Two tables:

- ``weights``: one product of ``rows`` rows by a weight of a real decode shape (Qwen2.5-0.5B: 896 wide, the
  QKV 1152 x 896, gate/up 9728 x 896, down 896 x 4864; Llama-3.2-1B's 2048 x 2048 and 16384 x 2048), every
  path on the same values, round-robin, a 256 MB buffer written before every call (a step reads far more
  weights than the caches hold): ``f32`` (qkv's float32 product, ``qkv.cpu.gemm.linear``: the product rule),
  ``bf16_torch`` (``F.linear`` on bfloat16 rows and weight, torch's own), ``bf16`` and ``int8``
  (``qkv.cpu.weights.weight_linear``: the compiled kernel). ``a/b`` is a's time over b's per repeat (above 1: b
  faster), the median and range; ``*_floor_us`` the format's bytes over the read rate.
- ``weights_decode``: one-token decode steps (a 64-token prompt, then 16 steps) of a Qwen2.5-0.5B-shaped
  ``qkv.nn.DecoderLM`` cut to 4 layers (full width, the 151,936-token head), ``qkv.cpu.optimize`` applied:
  ``f32`` (its default, the int8 head screen on where it runs), ``f32_no_screen`` (the control row: the float32
  head product), ``bf16`` (the model in bfloat16), ``int8`` (``weights="int8"``: every linear layer but the head),
  paired repeats, greedy tokens from ``next_tokens``; ``bf16/f32 <= 1`` is #49's target for batch 1.

Published configuration (the defaults): torch's default thread count; wall clock; 5 paired repeats. Expected time
on a quiet 2-core machine: about 4 minutes. ``--quick``: small shapes, 2 repeats.

Usage: ``python benchmarks/weights.py [--quick] [--repeat R] [--threads T]``
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Suite, cold_times, parse_args, ratio, read_rate  # noqa: E402
from qkv.cpu import ops, optimize  # noqa: E402
from qkv.cpu.gemm import PrepackedWeight, linear  # noqa: E402
from qkv.cpu.weights import quantize_int8, weight_linear  # noqa: E402

SHAPES = [(1152, 896), (9728, 896), (896, 4864), (2048, 2048), (16384, 2048)]  # (N, K)
QUICK_SHAPES = [(512, 256), (2048, 256)]
ROWS = [1, 4, 16]
PAIRS = [("bf16", "f32"), ("int8", "f32"), ("bf16", "bf16_torch"), ("int8", "bf16")]


def products(shapes, repeat: int, quick: bool) -> None:
    threads = torch.get_num_threads()
    rate = read_rate(threads)
    evict = torch.empty((4 if quick else 64) * 1024 * 1024)
    suite = Suite("weights", "decode products with float32, bfloat16 and int8 weights, weights cold",
                  threads=threads, repeat=repeat, clock="wall", kernels=ops.unavailable_reason() or "on")
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        wb = w.to(torch.bfloat16)
        q, s = quantize_int8(w)
        packed = PrepackedWeight()
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            xb = x.to(torch.bfloat16)
            fns = {"f32": lambda: linear(x, w, None, packed), "bf16_torch": lambda: F.linear(xb, wb),
                   "bf16": lambda: weight_linear(xb, wb), "int8": lambda: weight_linear(x, q, s)}
            with torch.inference_mode():
                t = cold_times(fns, repeat, evict)
            med = {c: statistics.median(v) for c, v in t.items()}
            floors = {"f32": 4, "bf16": 2, "int8": 1}
            results = {f"{c}_us": med[c] * 1e6 for c in t}
            results.update({f"{c}_floor_us": n * k * b / rate * 1e6 for c, b in floors.items()})
            results.update({f"{a}/{b}": ratio(t[a], t[b]) for a, b in PAIRS})
            results["read_GB_s"] = rate / 1e9
            suite.add({"N": n, "K": k, "rows": rows}, results)
            print(f"  {n}x{k} rows={rows}: " + ", ".join(f"{c} {v * 1e6:.0f} us" for c, v in med.items()))
    suite.note("a/b > 1: b is faster (per paired repeat: median [lowest, highest]). *_floor_us: the format's weight "
               "bytes over read_GB_s, the least a product of few rows can take.")
    suite.finish()


def decode(repeat: int, quick: bool) -> None:
    from qkv.cache import KVCache, Static
    from qkv.nn import DecoderConfig, DecoderLM

    if quick:
        cfg = dict(vocab_size=2000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256)
    else:  # Qwen2.5-0.5B's widths, 4 of its 24 layers
        cfg = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=4, num_attention_heads=14,
                   num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True)
    torch.manual_seed(0)
    plain = DecoderLM(DecoderConfig(**cfg)).eval()
    models = {"f32": optimize(copy.deepcopy(plain)), "f32_no_screen": optimize(copy.deepcopy(plain), screen=False),
              "bf16": optimize(copy.deepcopy(plain).to(torch.bfloat16)),
              "int8": optimize(copy.deepcopy(plain), weights="int8")}
    del plain
    prompt, steps = (8, 4) if quick else (64, 16)
    suite = Suite("weights_decode", "decode steps with float32, bfloat16 and int8 weights",
                  model=f"DecoderLM {cfg}", prompt=prompt, steps=steps, threads=torch.get_num_threads(),
                  repeat=repeat, clock="wall", screen=models["f32"].head_screen is not None)
    for B in (1, 4):
        ids = torch.randint(0, cfg["vocab_size"], (B, prompt), generator=torch.Generator().manual_seed(B))

        def run(model):
            def go():
                cache = KVCache(model.cache_specs(), storage=Static(prompt + steps + 1))
                tok = model.next_tokens(ids, cache=cache)[:, None]
                t0 = time.perf_counter()
                for _ in range(steps):
                    tok = model.next_tokens(tok, cache=cache)[:, None]
                return (time.perf_counter() - t0) / steps
            return go

        with torch.inference_mode():
            for m in models.values():
                run(m)()
            t: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(repeat):
                for name, m in models.items():
                    t[name].append(run(m)())
        row = suite.add({"B": B}, {**{f"{n}_ms": statistics.median(v) * 1e3 for n, v in t.items()},
                                   "bf16/f32": ratio(t["bf16"], t["f32"]),
                                   "bf16/f32_no_screen": ratio(t["bf16"], t["f32_no_screen"]),
                                   "int8/f32": ratio(t["int8"], t["f32"])})
        print(f"  decode B={B}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_ms")))
    suite.note("a/b < 1: a's step is faster. f32_no_screen is the control row (the float32 head product); bf16 runs "
               "its linear layers through qkv_cpu::weight_linear, its head through the same kernel (a tied bf16 "
               "head gets no int8 screen).")
    suite.finish()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    repeat = args.repeat or (2 if args.quick else 5)
    products(QUICK_SHAPES if args.quick else SHAPES, repeat, args.quick)
    decode(repeat, args.quick)


if __name__ == "__main__":
    main()
