"""AddressSanitizer run of qkv's compiled CPU kernels: hostile calls through every operator, no memory error allowed.

Builds ``src/qkv/cpu/csrc`` with ``-fsanitize=address`` into its own extensions folder (never the one the tests
use), then runs itself again with the sanitizer's runtime preloaded (``LD_PRELOAD`` of GCC's ``libasan`` and
``libstdc++``: the Python interpreter is not instrumented) and calls every operator of the module directly with
hostile arguments: ids of -1, -7 and past the end, NaN and inf values, zero sizes, strided and expanded views,
mismatched shapes. A call may raise (a refusal is fine); a read or write outside a buffer aborts the run with
AddressSanitizer's report, and the script exits non-zero. Not part of ``make test`` (the instrumented build takes
minutes): ``make asan``.

    python benchmarks/asan.py [--build-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "src" / "qkv" / "cpu" / "csrc"
_CHILD = "QKV_ASAN_CHILD"


def _preload() -> str:
    """GCC's libasan, then libstdc++: the sanitizer's ``__cxa_throw`` interceptor must find the real one already
    loaded, or the first C++ exception (a kernel's refusal) aborts the run (the interpreter itself has no C++)."""
    libs = []
    for name in ("libasan.so", "libstdc++.so.6"):
        path = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True)
        lib = path.stdout.strip()
        if not os.path.isabs(lib) or not os.path.exists(lib):
            raise SystemExit(f"asan: {name} not found (g++ -print-file-name gave {lib!r}); install GCC's sanitizer "
                             "runtime (libasan) and libstdc++")
        libs.append(lib)
    return " ".join(libs)


def _build(build_dir: Path):
    import torch
    from torch.utils import cpp_extension

    from qkv.cpu.build import SOURCES

    cap = torch.backends.cpu.get_cpu_capability()
    vec = (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
            "-DCPU_CAPABILITY_AVX512"] if cap.startswith("AVX512") else
           ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"] if cap == "AVX2" else [])
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address", "-ffp-contract=off", "-fopenmp", *vec]
    # the kernels register torch.library operators (qkv_cpu::<name>), not a Python module: load the library into
    # this process (no other qkv_cpu library is loaded here) and call them as torch.ops.qkv_cpu.<name>
    cpp_extension.load(name="qkv_cpu_kernels_asan", sources=[str(CSRC / s) for s in SOURCES], extra_cflags=flags,
                       extra_ldflags=["-fsanitize=address", "-fopenmp"], build_directory=str(build_dir),
                       verbose=False, is_python_module=False)
    return torch.ops.qkv_cpu


def _hostile_calls(mod):
    """(name, thunk) for every operator: edge and hostile arguments; each thunk may raise."""
    import torch

    calls = []
    f32, f64 = torch.float32, torch.float64
    for dt in (f32, f64):
        for B, Hq, Hkv, Nq, Nk, D, K in ((1, 2, 1, 5, 9, 8, 3), (2, 8, 1, 70, 300, 16, 64), (1, 2, 2, 0, 4, 8, 2),
                                         (1, 4, 2, 3, 1, 8, 0), (1, 2, 0, 3, 4, 8, 2)):
            q = torch.randn(B, Hq, Nq, D, dtype=dt)
            k = torch.randn(B, max(Hkv, 0), Nk, D, dtype=dt)
            v = torch.randn(B, max(Hkv, 0), Nk, D, dtype=dt)
            for ids in ("random", "minus", "past", "huge"):
                idx = torch.randint(-1, max(Nk, 1), (B, 1, Nq, K))
                if ids != "random" and idx.numel():
                    idx.view(-1)[::3] = {"minus": -7, "past": Nk, "huge": 2**40}[ids]
                for causal, offset in ((False, 0), (True, 0), (True, -10**6), (True, 10**6)):
                    for tile in (1, 256):
                        sinks = torch.full((Hq,), float("nan"), dtype=dt)
                        calls.append((f"gather_attention B{B} Hq{Hq} Hkv{Hkv} Nq{Nq} Nk{Nk} K{K} {ids}",
                                      lambda q=q, k=k, v=v, idx=idx, c=causal, o=offset, s=sinks, t=tile:
                                      mod.gather_attention(q, k, v, idx, 0.3, c, o, s, t)))
        kq = torch.randn(1, 2, 50, 8, dtype=dt)
        qs = torch.randn(1, 2, 100, 8, dtype=dt)[:, :, ::2]
        calls.append(("gather_attention strided q", lambda: mod.gather_attention(
            qs, kq, kq, torch.randint(0, 50, (1, 2, 50, 4)), 1.0, True, 0, None, 16)))
        for N, Dk, Dv, chunk, gate in ((0, 8, 8, 16, "head"), (17, 0, 8, 16, "head"), (17, 8, 0, 4, "chan"),
                                        (33, 16, 8, 1, "chan"), (33, 16, 8, 1000, "head"), (40, 8, 8, 16, "chan")):
            qd = torch.randn(1, 1, N, Dk, dtype=dt)
            vd = torch.randn(1, 2, N, Dv, dtype=dt)
            g = -torch.rand(*((1, 2, N) if gate == "head" else (1, 2, N, Dk)), dtype=dt) * 300
            if g.numel():
                g.view(-1)[::5] = -1e4
            beta = torch.rand(1, 2, N, dtype=dt)
            calls.append((f"gated_delta_chunks N{N} Dk{Dk} Dv{Dv} C{chunk} {gate}", lambda qd=qd, vd=vd, g=g, beta=beta,
                          Dk=Dk, Dv=Dv, chunk=chunk: mod.gated_delta_chunks(
                              qd, qd, vd, g, beta, torch.zeros(1, 2, Dk, Dv, dtype=dt), chunk, 60.0)))
        for Hk, H, Dk, Dv, Kt, Cc_extra in ((1, 2, 8, 4, 4, 0), (2, 2, 4, 4, 2, 0), (0, 2, 4, 4, 2, 0),
                                              (1, 2, 8, 4, 4, 3)):
            Cc = 2 * Hk * Dk + H * Dv + Cc_extra
            calls.append((f"delta_decode Hk{Hk} H{H} extra{Cc_extra}", lambda Hk=Hk, H=H, Dk=Dk, Dv=Dv, Kt=Kt, Cc=Cc:
                          mod.delta_decode(torch.randn(2, Cc, dtype=dt), torch.randn(2, Cc, Kt - 1, dtype=dt),
                                           torch.randn(Cc, Kt, dtype=dt), -torch.rand(2, H, dtype=dt),
                                           torch.rand(2, H, dtype=dt), torch.randn(2, H, Dk, Dv, dtype=dt), Hk,
                                           0.5, 1e-6)))
        for rows, Kx, N, nb in ((1, 64, 100, 4), (3, 0, 10, 2), (2, 16, 0, 3), (1, 16, 5, 64), (1, 16, 5, 0)):
            calls.append((f"rows_linear {rows}x{Kx} N{N} nb{nb}", lambda rows=rows, Kx=Kx, N=N, nb=nb: mod.rows_linear(
                torch.randn(rows, Kx, dtype=dt), torch.randn(N, Kx, dtype=dt), torch.randn(N, dtype=dt), nb)))
        E, d, fdim = 3, 16, 8
        up, down = torch.randn(E, 2 * fdim, d, dtype=dt), torch.randn(E, d, fdim, dtype=dt)
        for ids in ([0, 2], [-1], [E], [2**40], []):
            calls.append((f"moe_token ids {ids}", lambda ids=ids: mod.moe_token(
                torch.randn(1, d, dtype=dt), ids, torch.rand(len(ids)), up, None, down, None, False, 0.0, 0.0, 1, 1)))
        for counts, token in (([1, 0, 2], [0, 1, 1]), ([5, 0, 0], [0, 1, 1]), ([-1, 2, 2], [0, 1, 1]),
                              ([1, 1, 1], [0, 9, 1]), ([1, 1, 1], [0, -5, 1])):
            calls.append((f"moe_grouped counts {counts} token {token}", lambda c=counts, t=token: mod.moe_grouped(
                torch.randn(2, d, dtype=dt), torch.tensor(t), torch.rand(len(t)), c, up, None, down, None, False,
                0.0, 0.0, [1] * E, [1] * E)))
        for shape in ((0, 8), (3, 7), (2, 0), (5, 64)):
            calls.append((f"silu_mul {shape}", lambda shape=shape: mod.silu_mul(torch.randn(*shape, dtype=dt))))
        for N, D, R, cs in ((0, 8, 8, "2d"), (4, 8, 10, "2d"), (4, 8, 4, "3d"), (3, 16, 16, "bad")):
            x = torch.randn(2, 3, N, D, dtype=dt)
            shape = (N, R) if cs == "2d" else (2, N, R) if cs == "3d" else (N + 5, R)
            calls.append((f"rotary N{N} D{D} R{R} {cs}", lambda x=x, shape=shape: mod.rotary(
                x, torch.randn(*shape, dtype=dt), torch.randn(*shape, dtype=dt), False)))
        for rows, dim, wdim in ((0, 8, 8), (3, 0, 0), (3, 8, 5), (2, 100, 100)):
            calls.append((f"rms_norm {rows}x{dim} w{wdim}", lambda rows=rows, dim=dim, wdim=wdim: mod.rms_norm(
                torch.randn(rows, dim, dtype=dt), torch.randn(wdim, dtype=dt), 1e-6, 0.0)))
        for B, Hq, Hkv, S, qp in ((2, 4, 2, 5, 3), (1, 2, 0, 5, 3), (1, 2, 1, 0, 0), (2, 2, 1, 7, 2**40),
                                  (2, 2, 1, 7, -5)):
            calls.append((f"decode_attention B{B} Hkv{Hkv} S{S} qpos{qp}", lambda B=B, Hq=Hq, Hkv=Hkv, S=S, qp=qp:
                          mod.decode_attention(torch.randn(B, Hq, 1, 8, dtype=dt), torch.randn(B, Hkv, S, 8, dtype=dt),
                                               torch.randn(B, Hkv, S, 8, dtype=dt), torch.full((B, 1), qp),
                                               torch.arange(S).expand(B, S), True, 2, None, 0.35)))
        P, H, T = 4, 2, 4
        kp, vp = torch.randn(P, H, T, 8, dtype=dt), torch.randn(P, H, T, 8, dtype=dt)
        for table in ([[0, 1]], [[0, -1]], [[-7, 1]], [[0, P]], [[2**40, 0]]):
            tab = torch.tensor(table)
            pos = torch.arange(2 * T).view(1, -1)
            calls.append((f"paged_decode table {table}", lambda tab=tab, pos=pos: mod.paged_decode(
                torch.randn(1, 4, 8, dtype=dt), kp, vp, tab, pos, torch.tensor([2 * T - 1]), 0.35, 0, True, None)))
            calls.append((f"paged_prefill table {table}", lambda tab=tab, pos=pos: mod.paged_prefill(
                torch.randn(1, 4, 3, 8, dtype=dt), kp, vp, tab, pos, torch.tensor([[5, 6, 2**40]]), 0.35, 3, True,
                torch.zeros(4, dtype=dt))))
        calls.append(("paged_decode zero kv heads", lambda: mod.paged_decode(
            torch.randn(1, 4, 8, dtype=dt), kp[:, :0], vp[:, :0], torch.tensor([[0]]), torch.arange(T).view(1, -1),
            torch.tensor([1]), 0.35, 0, True, None)))
        kb, vb = kp.to(torch.bfloat16), vp.to(torch.bfloat16)  # bfloat16 pools: widened piece by piece
        for table in ([[0, 1]], [[0, P]]):
            tab = torch.tensor(table)
            calls.append((f"paged_decode bf16 table {table}", lambda tab=tab: mod.paged_decode(
                torch.randn(1, 4, 8, dtype=torch.bfloat16), kb, vb, tab, torch.arange(2 * T).view(1, -1),
                torch.tensor([2 * T - 1]), 0.35, 3, True, torch.zeros(4, dtype=torch.bfloat16))))
        calls.append(("decode_attention bf16 long", lambda: mod.decode_attention(
            torch.randn(2, 4, 1, 24, dtype=torch.bfloat16), torch.randn(2, 2, 300, 24, dtype=torch.bfloat16),
            torch.randn(2, 2, 300, 24, dtype=torch.bfloat16), torch.full((2, 1), 299),
            torch.arange(300).expand(2, 300), True, 0, None, 0.2)))
        calls.append(("paged_decode positions far out", lambda: mod.paged_decode(
            torch.randn(1, 4, 8, dtype=dt), kp, vp, torch.tensor([[0]]), torch.tensor([[2**40, -2**40, 3, 4]]),
            torch.tensor([2**41]), 0.35, 1, True, None)))
        for blocks, offsets, src in (([0, 1], [0, 3], [0, 1]), ([-1, 1], [0, 3], [0, 1]), ([0, P], [0, 3], [0, 1]),
                                     ([0, 1], [0, T], [0, 1]), ([0, 1], [0, 3], [0, 9]), ([0, 1], [0, 3], [-1, 1])):
            calls.append((f"paged_store {blocks} {offsets} {src}", lambda b=blocks, o=offsets, s=src: mod.paged_store(
                kp.clone(), vp.clone(), torch.randn(1, H, 2, 8, dtype=dt), torch.randn(1, H, 2, 8, dtype=dt),
                torch.tensor(b), torch.tensor(o), torch.tensor(s))))
    w = torch.randn(300, 64)
    calls.append(("screen_pack", lambda: mod.screen_pack(w)))
    calls.append(("screened_argmax", lambda: mod.screened_argmax(torch.randn(3, 64), w, *mod.screen_pack(w))))
    w16 = w.to(torch.bfloat16)
    for bits, cap in ((8, 0.0), (8, 2.0), (16, 0.0)):  # a bfloat16 head and its rounded logits; 16 is refused
        calls.append((f"screened_argmax bf16 head bits {bits} cap {cap}",
                      lambda bits=bits, cap=cap: mod.screened_argmax(torch.randn(5, 64), w16,
                                                                     *mod.screen_pack(w16.float()), cap, bits)))
    for cap, scale in ((2.0, 1.0), (2.0, 100.0), (30.0, 0.01), (-1.0, 1.0), (float("nan"), 1.0), (float("inf"), 1.0)):
        calls.append((f"screened_argmax cap {cap} x{scale}", lambda cap=cap, scale=scale: mod.screened_argmax(
            torch.randn(9, 64) * scale, w, *mod.screen_pack(w), cap)))
    for rows, K, N, fmt in ((1, 64, 100, "bf16"), (3, 7, 9, "int8"), (8, 300, 100, "bf16"), (11, 33, 7, "int8"),
                            (9, 0, 5, "bf16"), (4, 16, 0, "int8"), (0, 16, 5, "bf16"), (16, 1030, 31, "bf16"),
                            (1, 33, 7, "f32"), (2, 1030, 31, "f32"), (1, 0, 3, "f32"), (1, 4097, 7, "f32"),
                            (2, 4099, 6, "bf16"), (1, 4100, 5, "int8"), (2, 4096, 3, "int8")):
        def wl(rows=rows, K=K, N=N, fmt=fmt):
            x = torch.randn(rows, K)
            if fmt in ("bf16", "f32"):
                w = torch.randn(N, K)
                return mod.weight_linear(x, w.to(torch.bfloat16) if fmt == "bf16" else w, None, torch.randn(N))
            return mod.weight_linear(x, torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N), None)
        calls.append((f"weight_linear {fmt} {rows}x{K} N{N}", wl))
    calls.append(("weight_linear int8 without scale", lambda: mod.weight_linear(
        torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), None, None)))
    return calls


def _child(build_dir: Path) -> int:
    import torch

    torch.manual_seed(0)
    mod = _build(build_dir)
    calls = _hostile_calls(mod)
    refused: dict[str, int] = {}
    ran = 0
    for _, thunk in calls:
        try:
            thunk()
            ran += 1
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            kind = type(e).__name__
            refused[kind] = refused.get(kind, 0) + 1
    ops = sorted({n.split()[0] for n, _ in calls})
    print(f"asan: {len(calls)} hostile calls through {len(ops)} operators ({', '.join(ops)}): {ran} ran, "
          f"{sum(refused.values())} refused ({', '.join(f'{n} {k}' for k, n in sorted(refused.items())) or 'none'}); "
          "AddressSanitizer reported no error")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", type=Path, default=HERE.parent / "build" / "asan",
                   help="where the instrumented kernels are built (not the tests' extensions folder)")
    args = p.parse_args(argv)
    if os.environ.get(_CHILD) == "1":
        return _child(args.build_dir)
    env = dict(os.environ, LD_PRELOAD=_preload(), ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1",
               **{_CHILD: "1"})
    started = time.time()
    run = subprocess.run([sys.executable, __file__, "--build-dir", str(args.build_dir)], env=env)
    took = time.time() - started
    if run.returncode != 0:
        print(f"asan: FAILED (exit {run.returncode} after {took:.0f} s): see AddressSanitizer's report above",
              file=sys.stderr)
        return 1
    print(f"asan: clean ({took:.0f} s, build included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
