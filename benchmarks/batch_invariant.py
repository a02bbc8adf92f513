"""The cost of ``qkv.attention(..., batch_invariant=True)`` against the default, at decode shapes.

Decode step: ``q`` (B, Hq, 1, D) against a cache of Nk keys. The default is ``backend="auto"``; the
invariant mode (``tiled``, rows one at a time in fixed 256-key tiles) is timed in the same process,
interleaved. Target: at most 1.3x the default (the slowest repeat decides).

    python benchmarks/batch_invariant.py [--quick] [--repeat R] [--threads N]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import qkv  # noqa: E402
from _harness import Suite, median_ms, parse_args, ratio, target, time_interleaved  # noqa: E402


def cases(quick: bool):
    if quick:
        return [(2, 4, 2, 256, 64)]
    return [(1, 32, 8, 4096, 128), (8, 32, 8, 1024, 128), (8, 32, 8, 4096, 128), (32, 32, 8, 4096, 128)]


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    repeat = args.repeat or (2 if args.quick else 7)
    suite = Suite("batch_invariant", "attention(batch_invariant=True) vs the default, one decode step, float32",
                  dtype="float32")
    for B, Hq, Hkv, Nk, D in cases(args.quick):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, Hq, 1, D, generator=g)
        k, v = torch.randn(B, Hkv, Nk, D, generator=g), torch.randn(B, Hkv, Nk, D, generator=g)
        fns = {"default": lambda: qkv.attention(q, k, v),
               "invariant": lambda: qkv.attention(q, k, v, batch_invariant=True)}
        t = time_interleaved(fns, repeat=repeat, samples=True)
        r = ratio(t["invariant"], t["default"])
        suite.add({"B": B, "Hq": Hq, "Hkv": Hkv, "Nk": Nk, "D": D},
                  {"default ms": median_ms(t["default"]), "invariant ms": median_ms(t["invariant"]),
                   "invariant / default": r, "target": target(r, "<=", 1.3) + " (<= 1.3x)"})
    suite.note("Invariant: query rows in fixed-size steps, fixed 256-key tiles (qkv/backends/_invariant.py); "
               "default: backend='auto'. Both timed interleaved in one process.")
    suite.finish()


if __name__ == "__main__":
    main()
