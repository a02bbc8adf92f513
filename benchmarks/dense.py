"""Dense attention: ``qkv.attention(backend="auto")`` against torch SDPA on the same inputs.

Measures the dispatch overhead qkv adds over the kernel it calls (target: at most 5%), forward only,
float32, causal and not. The floor is the FLOP count over the measured GEMM rate.

    python benchmarks/dense.py [--quick]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import qkv
from _harness import Suite, attention_flops, gemm_rate, parse_args, time_interleaved


def main(argv=None) -> None:
    args = parse_args(__doc__, argv)
    B, H, D = 1, 8, 64
    lengths = [512, 1024] if args.quick else [1024, 4096]
    repeat = args.repeat or (3 if args.quick else 9)
    rate = gemm_rate()
    suite = Suite("dense", "qkv.attention(auto) vs torch SDPA, forward, float32",
                  gemm_gflops=round(rate / 1e9, 1), B=B, H=H, D=D, dtype="float32", kernel="sdpa (auto)",
                  cache=False)
    torch.manual_seed(0)
    for n in lengths:
        q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
        for causal in (False, True):
            mask = qkv.masks.causal() if causal else None
            with torch.no_grad():
                chosen = qkv.explain(q, k, v, mask=mask).chosen
                t = time_interleaved({
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    "qkv": lambda: qkv.attention(q, k, v, mask=mask),
                }, warmup=2, repeat=repeat)
            floor = attention_flops(B, H, n, n, D, causal=causal) / rate
            suite.add({"N": n, "causal": causal, "backend": chosen},
                      {"sdpa_ms": t["sdpa"] * 1e3, "qkv_ms": t["qkv"] * 1e3,
                       "overhead_%": (t["qkv"] / t["sdpa"] - 1) * 100,
                       "floor_ms": floor * 1e3, "sdpa/floor": t["sdpa"] / floor,
                       "target": "met" if t["qkv"] / t["sdpa"] <= 1.05 else "missed"})
    suite.note("Target: qkv overhead over SDPA <= 5% (median of interleaved repeats).")
    suite.finish()


if __name__ == "__main__":
    main()
