"""Launch settings of qkv's Triton kernels on a CUDA machine: a sweep that prints (and writes) the fastest.

The tile sizes, warps and stages of the attention kernels (:func:`qkv.backends.triton.attention.tile_sizes`) and
the paged decode kernel's settings (``qkv.backends.triton.decode.DECODE_*``) are chosen for a GPU by measuring,
not by guessing: this script times each candidate on ``benchmarks/gpu.py``'s published shapes (bf16, D = 128,
N = 8192 causal and window 1024, forward and forward+backward; decode at 32K context over 16-token pages) and
writes every timing to ``gpu_tune.json`` in the harness's output folder. A candidate that does not compile
(shared memory) is reported and skipped. Only the settings this sweep measured fastest go into the code.
Times are the device's (CUDA events around back-to-back calls). ``--best FILE`` writes the fastest decode
settings and the forward tiles fastest over both masks together (least summed time relative to each mask's
best) as JSON, which ``benchmarks/gpu.py --tuned FILE`` applies before it measures.

    python benchmarks/gpu_tune.py [--sections fwd,bwd,decode] [--best FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qkv  # noqa: E402
from _harness import Suite, attention_flops, device_time_interleaved  # noqa: E402
from qkv import masks as M  # noqa: E402
from qkv.backends.triton import attention as A  # noqa: E402
from qkv.backends.triton import decode as DEC  # noqa: E402

FWD = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)]
HEAVY_FIRST = (True, False)
BWD = [(64, 64, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (64, 32, 4, 3), (64, 128, 8, 2), (128, 64, 8, 2),
       (32, 32, 4, 3), (64, 64, 8, 3), (128, 128, 8, 1)]
DECODE = list(itertools.product((64, 128), (2, 4, 8), (4,), (2, 3)))
DECODE_NAMES = ("DECODE_TILE_KEYS", "DECODE_WAVES", "DECODE_WARPS", "DECODE_STAGES")  # what a DECODE row sets


def _name(cfg, *, decode: bool = False) -> str:
    if decode:
        return "{} keys/tile, {} programs/SM, {} warps, {} stages".format(*cfg)
    if len(cfg) == 5:
        return "{}x{} tiles, {} warps, {} stages, {}".format(*cfg[:4], "heavy first" if cfg[4] else "in order")
    return "{}x{} tiles, {} warps, {} stages".format(*cfg)


def _device_time(fn, repeat: int, number: int) -> float:
    return statistics.median(device_time_interleaved({"x": fn}, warmup=2, repeat=repeat, number=number)["x"])


def _only(tiles, backward: bool, default):
    """A ``tile_sizes`` that gives ``tiles`` to the forward (or, with ``backward``, to the backward) only."""
    def pick(D, Dv, device, dtype=torch.bfloat16, *, backward_call: bool = False, **kw):
        return tiles if backward_call == backward else default(D, Dv, device, dtype, backward=backward_call)

    def tile_sizes(D, Dv, device, dtype=torch.bfloat16, *, backward: bool = False):
        return pick(D, Dv, device, dtype, backward_call=backward)
    return tile_sizes


def attention_sweep(backward: bool, results: list) -> None:
    B, H, N, D, W = 2, 16, 8192, 128, 1024
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    default, saved_order = A.tile_sizes, A.FWD_HEAVY_FIRST
    for case, mask in (("causal", M.causal()), (f"window{W}", M.sliding_window(W - 1))):
        causal = case == "causal"
        pairs = W * N - W * (W - 1) // 2
        flops = attention_flops(B, H, N, N, D, causal=causal, allowed_fraction=None if causal else pairs / (N * N))
        cfgs = BWD if backward else [(*c, h) for c in FWD for h in HEAVY_FIRST]
        for cfg in cfgs:
            tiles = A.Tiles(*cfg[:4])
            A.tile_sizes = _only(tiles, backward, default)
            A.FWD_HEAVY_FIRST = cfg[4] if len(cfg) == 5 else saved_order
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            if backward:
                def fn():
                    return torch.autograd.grad(qkv.attention(qg, kg, vg, mask=mask, backend="triton"), (qg, kg, vg), do)
                mult = 3.5
            else:
                def fn():
                    return qkv.attention(q, k, v, mask=mask, backend="triton")
                mult = 1.0
            try:
                t = _device_time(fn, repeat=10, number=3)
                row = {"what": "fwdbwd" if backward else "fwd", "case": case, "settings": _name(cfg),
                       "time": f"{t * 1e3:.3f} ms", "rate": f"{mult * flops / t / 1e12:.1f} TFLOP/s",
                       "cfg": list(cfg), "seconds": t}
            except Exception as e:  # out of shared memory and the like: report, go on
                row = {"what": "fwdbwd" if backward else "fwd", "case": case, "settings": _name(cfg),
                       "time": f"{type(e).__name__}: {str(e)[:120]}", "rate": ""}
            print(row, flush=True)
            results.append(row)
    A.tile_sizes, A.FWD_HEAVY_FIRST = default, saved_order


def decode_sweep(results: list) -> None:
    B, Hq, Hkv, D, T, ctx = 8, 32, 8, 128, 16, 32768
    nb = ctx // T
    g = torch.Generator(device="cuda").manual_seed(2)
    kp = torch.randn(B * nb + 1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vp = torch.randn(B * nb + 1, Hkv, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(B * nb, device="cuda").view(B, nb)
    kpos = torch.arange(ctx, device="cuda").expand(B, ctx).contiguous()
    qpos = torch.full((B,), ctx - 1, device="cuda")
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kv_bytes = 2 * B * Hkv * ctx * D * kp.element_size()
    saved = tuple(getattr(DEC, n) for n in DECODE_NAMES)
    for cfg in DECODE:
        for n, x in zip(DECODE_NAMES, cfg):
            setattr(DEC, n, x)
        try:
            t = _device_time(lambda: DEC.paged_decode(q, kp, vp, tables, kpos, qpos), repeat=10, number=20)
            row = {"what": "decode", "case": f"paged ctx{ctx}", "settings": _name(cfg, decode=True),
                   "time": f"{t * 1e6:.1f} us", "rate": f"{kv_bytes / t / 1e9:.0f} GB/s", "cfg": list(cfg),
                   "seconds": t}
        except Exception as e:
            row = {"what": "decode", "case": f"paged ctx{ctx}", "settings": _name(cfg, decode=True),
                   "time": f"{type(e).__name__}: {str(e)[:120]}", "rate": ""}
        print(row, flush=True)
        results.append(row)
    for n, x in zip(DECODE_NAMES, saved):
        setattr(DEC, n, x)


def best(results: list) -> dict:
    """The fastest decode settings, and the forward settings least slow over both masks together."""
    out: dict = {}
    dec = [r for r in results if r["what"] == "decode" and "seconds" in r]
    if dec:
        out["decode"] = dict(zip(DECODE_NAMES, min(dec, key=lambda r: r["seconds"])["cfg"]))
    fwd = [r for r in results if r["what"] == "fwd" and "seconds" in r]
    cases = {r["case"] for r in fwd}
    fastest = {c: min(r["seconds"] for r in fwd if r["case"] == c) for c in cases}
    scores: dict = {}
    for r in fwd:
        scores.setdefault(tuple(r["cfg"]), []).append(r["seconds"] / fastest[r["case"]])
    complete = {c: sum(v) for c, v in scores.items() if len(v) == len(cases)}
    if complete:
        cfg = min(complete, key=complete.get)
        out["forward"] = {"tiles": list(cfg[:4]), "FWD_HEAVY_FIRST": bool(cfg[4])}
    return out


def apply_best(path: str) -> dict:
    """Apply settings written by ``--best`` in this process (gpu.py's shapes, the ones swept): the decode globals,
    the forward's tiles and its tile order. Returns what was applied."""
    chosen = json.loads(Path(path).read_text())
    for n, x in chosen.get("decode", {}).items():
        if n not in DECODE_NAMES:
            raise ValueError(f"apply_best: unknown decode setting {n!r} in {path}")
        setattr(DEC, n, x)
    fwd = chosen.get("forward")
    if fwd:
        A.tile_sizes = _only(A.Tiles(*fwd["tiles"]), False, A.tile_sizes)
        A.FWD_HEAVY_FIRST = bool(fwd["FWD_HEAVY_FIRST"])
    return chosen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default="decode,fwd,bwd")
    p.add_argument("--best", default=None, help="write the fastest settings here (JSON) for gpu.py --tuned")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_tune.py needs a CUDA device")
    results: list = []
    for name in args.sections.split(","):
        if name == "decode":
            decode_sweep(results)
        elif name in ("fwd", "bwd"):
            attention_sweep(name == "bwd", results)
        else:
            raise SystemExit(f"unknown section {name!r}: use decode, fwd, bwd")
    suite = Suite("gpu_tune", "launch settings of the Triton kernels, bf16, D=128 (fastest goes into the code)",
                  dtype="bfloat16")
    for row in results:
        suite.add({k: row[k] for k in ("what", "case", "settings")}, {k: row[k] for k in ("time", "rate")})
    chosen = best(results)
    print("fastest:", chosen, flush=True)
    if args.best:
        with open(args.best, "w") as f:
            json.dump(chosen, f)
    suite.note("Shapes as benchmarks/gpu.py: B=2, H=16, N=8192 (causal; window 1024) for fwd and fwdbwd (fwdbwd "
               "times the backward's settings with the default forward); decode B=8, 32 query / 8 KV heads, 32K "
               "context in 16-token pages. Device time (CUDA events), median of 10 repeats of 3 (attention) or 20 "
               "(decode) back-to-back calls.")
    suite.finish()

if __name__ == "__main__":
    main()
