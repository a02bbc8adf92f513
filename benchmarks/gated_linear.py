"""Gated rules (Gated DeltaNet, Kimi Delta Attention, Mamba2/SSD): qkv's chunked form against the recurrent loop
and HF transformers' own torch fallbacks on the same inputs.

Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025 (arXiv:2412.06464); Kimi Team, "Kimi Linear", 2025
(arXiv:2510.26692); Dao and Gu, "Transformers are SSMs", ICML 2024 (arXiv:2405.21060).

Run from the repository root::

    python benchmarks/gated_linear.py            # the published run
    python benchmarks/gated_linear.py --quick    # smoke run

Measures, in one process, B=1, H=8, Dk=Dv=128, float32, no autograd, at N = 4096 (``--quick``: 256):

1. prefill, per rule: ``gated_delta_chunked`` with one decay per head (Gated DeltaNet) against HF's
   ``torch_chunk_gated_delta_rule`` (qwen3_next); with one decay per key channel (KDA) against HF's
   ``chunk_kimi_delta_attention`` (kimi_linear); ``gated_linear_chunked`` with one decay per head (SSD) against
   HF's ``mamba2_chunk_scan`` (mamba2, state size 128, one group per head); each also against qkv's own
   recurrent loop. HF gets its layout (B, N, H, D) prepared outside the timing, ``use_qk_l2norm_in_kernel=False``
   and q pre-divided by its internal ``Dk ** -0.5`` so both sides compute the same numbers (checked:
   ``max_abs_diff``).
2. memory: the chunked form's peak allocation at N and 4N (it must grow about 4x: O(N), no (N, N) matrix).
3. targets (issue 27): chunked >= 5x the recurrent form and >= 3x HF's torch chunked reference, per rule.

The delta rules run as they do in an optimized model (``qkv.cpu.optimize``; here ``kernel=qkv.cpu.fused.DELTA``)
without autograd: on CPU that is qkv's compiled kernel
(``qkv/cpu/csrc/gated_delta.cpp``, its own chunk size ``KERNEL_CHUNK_SIZE`` = 16) where it builds, the torch ops
otherwise (chunk 64); the ``path`` and ``C`` columns say which. HF runs its default chunk of 64.

The floor: the chunked algorithm's FLOPs (``chunk_flops``) at that chunk size over the measured GEMM rate. Per
token and value head the delta rule needs about ``5 C D + 3 D^2`` multiply-adds (90K at C = 64, 59K at C = 16,
D = 128; the three ``D^2`` state products do not shrink with C), against about ``5 D^2`` element operations for
the recurrent loop; ``hf/floor`` is HF's time over the floor at its own chunk of 64.

Timing: the sides of every ratio run round-robin, every repeat a tuple; ratios are the median and range over the
paired repeats, and a target is met only when the slowest repeat meets it. Published configuration (the
defaults): 1 thread, process CPU time, 5 paired repeats.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from _harness import Suite, gemm_rate, median_ms, parse_args, peak_memory_during, ratio, target, time_interleaved
from qkv.cpu.fused import DELTA
from qkv.linear import (
    DEFAULT_GATED_CHUNK_SIZE,
    gated_delta_recurrent,
    gated_linear_chunked,
    gated_linear_recurrent,
)
from qkv.linear import gated_delta_chunked as _gated_delta_chunked
from qkv.linear.gated_chunk import KERNEL_CHUNK_SIZE
from qkv.linear.gated_chunk import delta_path as _delta_path


def delta_path(*args, **kw):
    """Which path the chunked delta rule takes given qkv's compiled kernel (as ``qkv.cpu.optimize`` gives it)."""
    return _delta_path(*args, kernel=DELTA, **kw)


def gated_delta_chunked(*args, **kw):
    """``qkv.linear.gated_delta_chunked`` with qkv's compiled kernel, as a model ``qkv.cpu.optimize`` saw runs it."""
    return _gated_delta_chunked(*args, kernel=DELTA, **kw)

B, H, D = 1, 8, 128
DTYPE = torch.float32
C = DEFAULT_GATED_CHUNK_SIZE  # the torch ops' chunk and HF's


def chunk_flops(N: int, *, delta: bool, C: int = C) -> float:
    """FLOPs of the chunked algorithm per (batch, head): the delta rule does four C x C x D products (scores,
    UT system, U and W), one C x C x D output product, three D x D state products per token and the C x C
    triangular solve; the gated linear rule two C x C x D and two D x D products per token."""
    per_token = (5 * C * D + 3 * D * D + C * C / 3) if delta else (2 * C * D + 2 * D * D)
    return 2.0 * B * H * N * per_token


def _inputs(N: int, gate: str):
    gen = torch.Generator().manual_seed(N)
    q = torch.randn(B, H, N, D, generator=gen) * D ** -0.5
    k = F.normalize(torch.randn(B, H, N, D, generator=gen), dim=-1)
    v = torch.randn(B, H, N, D, generator=gen)
    shape = (B, H, N) if gate == "head" else (B, H, N, D)
    g = -0.1 * torch.rand(*shape, generator=gen)
    beta = torch.rand(B, H, N, generator=gen)
    return q, k, v, g, beta


def _hf_layout(*ts):
    """(B, H, N, ...) -> HF's (B, N, H, ...), contiguous, outside the timed region."""
    return [t.transpose(1, 2).contiguous() for t in ts]


def _peers(N: int):
    """name -> (rule description, qkv's path, qkv chunked, qkv recurrent, HF peer name, HF call)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    cases = {}
    q, k, v, g, beta = _inputs(N, "head")
    hq, hk, hv, hg, hb = _hf_layout(q * D ** 0.5, k, v, g, beta)
    cases["gated_deltanet"] = (
        "gated delta, decay per head", delta_path(q, k, v, g, beta),
        lambda: gated_delta_chunked(q, k, v, g, beta),
        lambda: gated_delta_recurrent(q, k, v, g, beta),
        "HF torch_chunk_gated_delta_rule",
        lambda: torch_chunk_gated_delta_rule(hq, hk, hv, hg, hb, chunk_size=C, use_qk_l2norm_in_kernel=False)[0],
    )
    qc, kc, vc, gc, bc = _inputs(N, "channel")
    cq, ck, cv, cg, cb = _hf_layout(qc * D ** 0.5, kc, vc, gc, bc)
    cases["kda"] = (
        "gated delta, decay per key channel", delta_path(qc, kc, vc, gc, bc),
        lambda: gated_delta_chunked(qc, kc, vc, gc, bc),
        lambda: gated_delta_recurrent(qc, kc, vc, gc, bc),
        "HF chunk_kimi_delta_attention",
        lambda: chunk_kimi_delta_attention(cq, ck, cv, cg, cb, chunk_size=C, use_qk_l2norm_in_kernel=False)[0],
    )
    # SSD: x = v / dt and dt = 1 give HF's scan x * dt = v and A * dt = g per token.
    A = -torch.ones(H)
    dt = torch.ones(B, N, H)
    sx, sb, sc = _hf_layout(v, k, q)
    g_ssd = (-dt.transpose(1, 2)).contiguous() * 0.1
    A = A * 0.1
    cases["ssd"] = (
        "gated linear, decay per head", "torch ops",
        lambda: gated_linear_chunked(q, k, v, g_ssd),
        lambda: gated_linear_recurrent(q, k, v, g_ssd),
        "HF mamba2_chunk_scan",
        lambda: mamba2_chunk_scan(sx, dt, A, sb, sc, chunk_size=C),
    )
    return cases


def bench_prefill(N: int, rate: float, repeat: int, cpu: bool, ctx: dict, results: dict) -> None:
    suite = Suite("gated_linear_prefill", "causal prefill: qkv chunked vs qkv recurrent vs HF's torch fallback",
                  gemm_gflops=rate / 1e9, **ctx)
    for name, (rule, path, chunked, recurrent, peer, hf) in _peers(N).items():
        with torch.no_grad():
            t = time_interleaved({"chunked": chunked, "recurrent": recurrent, "hf": hf}, warmup=1, repeat=repeat,
                                 cpu=cpu, samples=True)
            ours = chunked().out
            diff_hf = float((hf().transpose(1, 2) - ours).abs().max())
            diff_rec = float((recurrent().out - ours).abs().max())
        c = KERNEL_CHUNK_SIZE if path.startswith("compiled") else C
        floor = chunk_flops(N, delta=name != "ssd", C=c) / rate
        hf_floor = chunk_flops(N, delta=name != "ssd") / rate
        results[name] = {"recurrent": ratio(t["recurrent"], t["chunked"]), "hf": ratio(t["hf"], t["chunked"])}
        suite.add({"layer": name, "rule": rule, "N": N, "path": path, "C": c, "peer": peer}, {
            "chunked_ms": median_ms(t["chunked"]), "floor_ms": floor * 1e3,
            "chunked/floor": median_ms(t["chunked"]) / 1e3 / floor,
            "recurrent_ms": median_ms(t["recurrent"]), "hf_ms": median_ms(t["hf"]),
            "hf/floor": median_ms(t["hf"]) / 1e3 / hf_floor,
            "recurrent/chunked": results[name]["recurrent"], "hf/chunked": results[name]["hf"],
            "max_abs_diff_hf": diff_hf, "max_abs_diff_recurrent": diff_rec,
        })
    suite.note("floor = the chunked algorithm's FLOPs at qkv's chunk C (chunk_flops) / the measured GEMM rate. "
               "hf/chunked and recurrent/chunked: the peer's time over qkv's chunked form, the median of the paired "
               "repeats, then the lowest and highest. max_abs_diff: the same outputs from both sides (HF computes in "
               "float32). hf/floor: HF's time over the floor at its own chunk of 64. path: how qkv's chunked form "
               "ran (the compiled CPU kernel, or torch ops and why).")
    suite.finish()


def bench_memory(N: int, ctx: dict) -> None:
    suite = Suite("gated_linear_memory", "peak memory of the chunked forms: O(N)", **ctx)
    for name, gate, delta in (("gated_deltanet", "head", True), ("kda", "channel", True), ("ssd", "head", False)):
        peaks = {}
        for n in (N, 4 * N):
            q, k, v, g, beta = _inputs(n, gate)
            with torch.no_grad():
                if delta:
                    peaks[n] = peak_memory_during(lambda: gated_delta_chunked(q, k, v, g, beta))
                else:
                    peaks[n] = peak_memory_during(lambda: gated_linear_chunked(q, k, v, g))
        io = B * H * 4 * N * D * 4  # q, k, v and out at N, float32
        suite.add({"layer": name, "N": N}, {"peak_MB_N": peaks[N] / 2**20, "peak_MB_4N": peaks[4 * N] / 2**20,
                                            "growth_4N/N": peaks[4 * N] / max(peaks[N], 1),
                                            "peak/io_bytes": peaks[N] / io})
    suite.note("growth about 4 at 4x the tokens: memory linear in N (a quadratic form would grow 16x). "
               "peak/io_bytes: the peak over the bytes of q, k, v and the output.")
    suite.finish()


def report_targets(ctx: dict, results: dict, N: int) -> None:
    suite = Suite("gated_linear_targets", "issue 27 targets, each met only when the slowest repeat meets it", **ctx)
    for name in ("gated_deltanet", "kda"):
        r = results[name]
        suite.add({"goal": f"{name}: chunked >= 5x recurrent at N={N}"},
                  {"measured": r["recurrent"], "target": target(r["recurrent"], ">=", 5)})
        suite.add({"goal": f"{name}: chunked >= 3x HF's torch chunked at N={N}"},
                  {"measured": r["hf"], "target": target(r["hf"], ">=", 3)})
    suite.note(f"Load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.")
    suite.finish()


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, threads=1, cpu_time=True)
    quick, cpu = args.quick, args.cpu_time
    repeat = args.repeat or (2 if quick else 5)
    N = 256 if quick else 4096
    ctx = {"B": B, "H": H, "Dk": D, "Dv": D, "dtype": str(DTYPE).removeprefix("torch."), "hf_chunk_size": C,
           "peer": "HF transformers torch fallbacks (CPU)", "clock": "process CPU time" if cpu else "wall",
           "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    rate = gemm_rate(DTYPE, cpu=cpu)
    print(f"GEMM rate {rate / 1e9:.1f} GFLOP/s, threads {torch.get_num_threads()}")
    results: dict[str, dict] = {}
    bench_prefill(N, rate, repeat, cpu, ctx, results)
    bench_memory(256 if quick else 1024, ctx)
    report_targets(ctx, results, N)


if __name__ == "__main__":
    main()
