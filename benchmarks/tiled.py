"""Dense attention: the tiled backend against torch SDPA, forward and forward+backward, with peak memory.

The tiled backend is plain PyTorch (matmuls and fused softmax over batched tiles), so on dense problems
its target is to stay within 2x of SDPA's fused kernel while keeping memory O(N). The floor is the
FLOP count over the measured GEMM rate (forward: ``4 B H N^2 D``, half when causal; forward+backward:
3x that, the two forward and four backward matmuls).

Peak memory is the growth of the process's resident-set high-water mark across one call (Linux
``/proc/self/status`` VmHWM after resetting it, with freed heap memory returned first), so it counts
every allocation the call makes, including its outputs and gradients.

Published configuration (the defaults): 1 thread, process CPU time.

    python benchmarks/tiled.py [--quick] [--threads N] [--wall-time]
"""

from __future__ import annotations

import ctypes
import re

import torch
import torch.nn.functional as F

import qkv
from _harness import Suite, attention_flops, gemm_rate, parse_args, time_interleaved


def interleaved(fns, *, warmup: int, repeat: int, cpu: bool) -> dict[str, float]:
    return time_interleaved(fns, warmup=warmup, repeat=repeat, cpu=cpu)


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # pragma: no cover - not glibc
        return None


_LIBC = _libc()


def peak_growth(fn) -> float | None:
    """Bytes the resident-set high-water mark grows while ``fn()`` runs (None off Linux)."""
    try:
        if _LIBC is not None:
            _LIBC.malloc_trim(0)  # return freed heap pages, so reuse shows as growth
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        status = open("/proc/self/status").read()
        before = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
        fn()
        status = open("/proc/self/status").read()
        return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) * 1024 - before
    except (OSError, AttributeError):
        return None


def _cpu_gemm_rate(n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = interleaved({"mm": lambda: torch.mm(a, b)}, warmup=2, repeat=5, cpu=True)["mm"]
    return 2.0 * n**3 / t


def _mib(x: float | None) -> float | str:
    return round(x / 2**20, 1) if x is not None else "n/a"


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, threads=1, cpu_time=True)  # the published configuration
    if args.threads:
        torch.set_num_threads(args.threads)
    B, H, D = 1, 8, 64
    lengths = [256] if args.quick else [1024, 4096, 16384]
    rate = gemm_rate() if not args.cpu_time else _cpu_gemm_rate()
    suite = Suite("tiled", "tiled backend vs torch SDPA, dense, float32", gemm_gflops=round(rate / 1e9, 1),
                  B=B, H=H, D=D, dtype="float32", kernel="tiled (plain PyTorch) vs sdpa (fused C++)", cache=False,
                  clock="process CPU time" if args.cpu_time else "wall")
    torch.manual_seed(0)
    for n in lengths:
        repeat = args.repeat or (2 if args.quick else (1 if n >= 16384 else 3))
        warmup = 1 if n < 16384 else 0
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
                err = float((tiled() - sdpa()).abs().max())  # agreement first: a fast wrong answer is no answer
                mem = {"sdpa": peak_growth(sdpa), "tiled": peak_growth(tiled)}  # also warms up
                fwd = interleaved({"sdpa": sdpa, "tiled": tiled}, warmup=warmup, repeat=repeat, cpu=args.cpu_time)
            mem_fb = {"sdpa": peak_growth(lambda: train(sdpa)), "tiled": peak_growth(lambda: train(tiled))}
            fb = interleaved({"sdpa": lambda: train(sdpa), "tiled": lambda: train(tiled)},
                             warmup=warmup, repeat=repeat, cpu=args.cpu_time)
            floor = attention_flops(B, H, n, n, D, causal=causal) / rate
            ratio, ratio_fb = fwd["tiled"] / fwd["sdpa"], fb["tiled"] / fb["sdpa"]
            suite.add({"N": n, "causal": causal},
                      {"sdpa_ms": fwd["sdpa"] * 1e3, "tiled_ms": fwd["tiled"] * 1e3, "tiled/sdpa": ratio,
                       "floor_ms": floor * 1e3, "tiled/floor": fwd["tiled"] / floor,
                       "fb_sdpa_ms": fb["sdpa"] * 1e3, "fb_tiled_ms": fb["tiled"] * 1e3, "fb tiled/sdpa": ratio_fb,
                       "fb tiled/floor": fb["tiled"] / (3 * floor),
                       "mem_sdpa_MiB": _mib(mem["sdpa"]), "mem_tiled_MiB": _mib(mem["tiled"]),
                       "fb_mem_sdpa_MiB": _mib(mem_fb["sdpa"]), "fb_mem_tiled_MiB": _mib(mem_fb["tiled"]),
                       "max_abs_err": err, "target": "met" if max(ratio, ratio_fb) <= 2.0 else "missed"})
    suite.note("Target: tiled within 2x of SDPA's time, forward and forward+backward (median of interleaved "
               "repeats; one repeat at N=16384). Memory: growth of peak RSS over one call, outputs and "
               "gradients included; one (N, N) float32 score matrix would be 4 N^2 bytes (1 GiB at 16384).")
    suite.finish()


if __name__ == "__main__":
    main()
