"""Dense attention: the tiled backend against torch SDPA, forward and forward+backward, with peak memory.

The tiled backend is plain PyTorch (matmuls and fused softmax over batched tiles), so on dense problems
its target is to stay within 2x of SDPA's fused kernel while keeping memory O(N). The floor is the
FLOP count over the measured GEMM rate (forward: ``4 B H N^2 D``, half when causal; forward+backward:
3x that, the two forward and four backward matmuls).

Peak memory is the growth of the process's resident-set high-water mark across one call (Linux
``/proc/self/status`` VmHWM after resetting it, with freed heap memory returned first), so it counts
every allocation the call makes, including its outputs and gradients.

Timing: SDPA and tiled run round-robin, every repeat a pair; each ratio is reported as its median and its
range over the repeats, and the target is met only when the slowest repeat meets it. Peak memory is read
during the first timed repeat (its bookkeeping sits outside the clock), and that repeat's outputs give
the agreement.

Published configuration (the defaults): 1 thread, process CPU time (both sides run single-threaded, so
the CPU clock is robust to other processes), 5 paired repeats at every N (one untimed warm-up below
16384). Expected time on a quiet 2-core machine: about 13 minutes (6 with the earlier single repeat at
16384), nearly all of it at N = 16384, where one non-causal repeat (forward and forward+backward, both
sides) takes about 95 s.

    python benchmarks/tiled.py [--quick] [--repeat R] [--threads N] [--wall-time]
"""

from __future__ import annotations

import ctypes
import re
import time

import torch
import torch.nn.functional as F

import qkv
from _harness import Suite, attention_flops, gemm_rate, median_ms, parse_args, ratio, target


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # pragma: no cover - not glibc
        return None


_LIBC = _libc()


def _rss_reset() -> int | None:
    """Reset the resident-set high-water mark to the current RSS and return that RSS (None off Linux)."""
    try:
        if _LIBC is not None:
            _LIBC.malloc_trim(0)  # return freed heap pages, so reuse shows as growth
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
    except (OSError, AttributeError):
        return None


def _hwm() -> int | None:
    try:
        return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
    except (OSError, AttributeError):
        return None


def timed_with_memory(fns, *, warmup: int, repeat: int, cpu: bool):
    """Per-repeat seconds of each callable, round-robin (paired by repeat index), plus each one's peak RSS
    growth and output in the first repeat. The memory bookkeeping runs outside the clock."""
    clock = time.process_time if cpu else time.perf_counter
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    mem, outs = {}, {}
    for r in range(repeat):
        for name, fn in fns.items():
            before = _rss_reset() if r == 0 else None
            t0 = clock()
            out = fn()
            times[name].append(clock() - t0)
            if r == 0:
                peak = _hwm()
                mem[name] = peak - before if peak is not None and before is not None else None
                outs[name] = out
            del out
    return times, mem, outs


def _mib(x: float | None) -> float | str:
    return round(x / 2**20, 1) if x is not None else "n/a"


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, threads=1, cpu_time=True)  # the published configuration
    if args.threads:
        torch.set_num_threads(args.threads)
    B, H, D = 1, 8, 64
    lengths = [256] if args.quick else [1024, 4096, 16384]
    rate = gemm_rate(cpu=args.cpu_time)
    suite = Suite("tiled", "tiled backend vs torch SDPA, dense, float32", gemm_gflops=round(rate / 1e9, 1),
                  B=B, H=H, D=D, dtype="float32", kernel="tiled (plain PyTorch) vs sdpa (fused C++)", cache=False,
                  clock="process CPU time" if args.cpu_time else "wall")
    torch.manual_seed(0)
    for n in lengths:
        repeat = args.repeat or (2 if args.quick else 5)
        warmup = 1 if n < 16384 else 0  # at 16384 one call is many seconds: nothing left to warm
        q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
        dout = torch.randn(B, H, n, D)
        for causal in (False, True):
            mask = qkv.masks.causal() if causal else None

            def sdpa(q=q, k=k, v=v, causal=causal):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def tiled(q=q, k=k, v=v, mask=mask):
                return qkv.attention(q, k, v, mask=mask, backend="tiled")

            def train(fn, q=q, k=k, v=v):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                fn(*leaves).backward(dout)

            with torch.no_grad():
                fwd, mem, outs = timed_with_memory({"sdpa": sdpa, "tiled": tiled}, warmup=warmup, repeat=repeat,
                                                   cpu=args.cpu_time)
            err = float((outs["tiled"] - outs["sdpa"]).abs().max())  # a fast wrong answer is no answer
            del outs
            fb, mem_fb, _ = timed_with_memory({"sdpa": lambda: train(sdpa), "tiled": lambda: train(tiled)},
                                              warmup=warmup, repeat=repeat, cpu=args.cpu_time)
            floor = attention_flops(B, H, n, n, D, causal=causal) / rate
            r, r_fb = ratio(fwd["tiled"], fwd["sdpa"]), ratio(fb["tiled"], fb["sdpa"])
            met = target(r, "<=", 2.0) == "met" and target(r_fb, "<=", 2.0) == "met"
            suite.add({"N": n, "causal": causal},
                      {"sdpa_ms": median_ms(fwd["sdpa"]), "tiled_ms": median_ms(fwd["tiled"]), "tiled/sdpa": r,
                       "floor_ms": floor * 1e3, "tiled/floor": median_ms(fwd["tiled"]) / 1e3 / floor,
                       "fb_sdpa_ms": median_ms(fb["sdpa"]), "fb_tiled_ms": median_ms(fb["tiled"]),
                       "fb tiled/sdpa": r_fb, "fb tiled/floor": median_ms(fb["tiled"]) / 1e3 / (3 * floor),
                       "mem_sdpa_MiB": _mib(mem["sdpa"]), "mem_tiled_MiB": _mib(mem["tiled"]),
                       "fb_mem_sdpa_MiB": _mib(mem_fb["sdpa"]), "fb_mem_tiled_MiB": _mib(mem_fb["tiled"]),
                       "max_abs_err": err, "target": "met" if met else "missed"})
    suite.note("Target: tiled within 2x of SDPA's time, forward and forward+backward, in every paired repeat "
               "(tiled/sdpa: the median, then the lowest and highest repeat). Memory: growth of peak RSS over "
               "one call (the first timed repeat), outputs and gradients included; one (N, N) float32 score "
               "matrix would be 4 N^2 bytes (1 GiB at 16384).")
    suite.finish()


if __name__ == "__main__":
    main()
