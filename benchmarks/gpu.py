"""GPU suite: qkv's Triton kernels against torch SDPA (flash) and FlexAttention, and the Flex backend's CUDA path.

One command on a CUDA machine (under 8 minutes on an H200 at the published sizes)::

    python benchmarks/gpu.py            # writes benchmarks/out/gpu.json and gpu.md

Sections, each guarded so one failure still reports the others (its error goes into the notes):

1. correctness at full size: the Triton backend's forward and gradients against a float64 SDPA reference
   (computed one head at a time, so one (B, 1, N, N) float64 score matrix exists at once), within the bf16
   error budget set by SDPA in bf16;
2. forward and forward+backward TFLOP/s, bf16, D = 128, N = 8192: causal against SDPA-flash and Flex,
   sliding window 1024 against Flex (SDPA has no window);
3. decode at 32K context over a paged cache, against the memory-bandwidth floor (bytes of K and V over
   the measured copy bandwidth);
4. the Flex backend (``qkv.attention(backend="flex")``) on CUDA: masks, modifiers, lse and gradients
   against the float64 reference;
5. qkv's contract battery (:func:`qkv.conformance.check`: lse, masked rows, causal and window alignment, GQA,
   softcap, sinks, empty keys, dtypes float32 and bfloat16, strided inputs, determinism, batch invariance) on the
   device for the Triton backend, torch SDPA and qkv's SDPA backend: one row per kernel, the checks that differ.

Targets (H200): forward >= 0.9x SDPA-flash TFLOP/s, backward >= 0.8x, window >= 1.0x Flex, decode >= 0.8x
of the bandwidth floor. ``--dry-run`` runs every section's logic at tiny sizes on CPU (Triton's
interpreter, no timings that mean anything) to check the script itself; its correctness rows (``ok``,
``worst_ratio`` of error to budget, the decode error) are checked by ``tests/test_bench_smoke.py``.
``--sections correctness,decode`` runs only the named sections (default: all five). ``--tuned FILE`` first
applies the launch settings that ``benchmarks/gpu_tune.py --best FILE`` measured fastest (recorded in the
context), so one GPU session can sweep and then publish with the winners.

Times are the device's: CUDA events around back-to-back calls, the peers interleaved repeat by repeat, so
each ratio has a range over paired repeats and a target is met only when the slowest repeat meets it. The
decode row also gives one synchronised call's latency (the host's launch work included).

    python benchmarks/gpu.py [--dry-run] [--sections correctness,speed,decode,flex_backend,conformance]
                             [--tuned FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

if "--dry-run" in sys.argv:  # the interpreter must be on before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qkv  # noqa: E402
from _harness import Suite, attention_flops, device_time_interleaved, parse_args, ratio, spread, target, time_fn  # noqa: E402
from qkv import masks as M  # noqa: E402
from qkv import mods  # noqa: E402
from qkv.testing import assert_within_budget  # noqa: E402

#: (causal, what) -> the least rate ratio against the peer (SDPA-flash under causal, Flex under the window)
TARGETS = {(True, "fwd"): 0.9, (True, "fwdbwd"): 0.8, (False, "fwd"): 1.0, (False, "fwdbwd"): 1.0}


def _sizes(dry: bool) -> dict:
    if dry:
        return dict(B=1, H=2, Hkv=2, N=48, D=16, window=16, ctx=64, dec_B=2, dec_H=4, dec_Hkv=2, page=16,
                    flex_N=40)
    return dict(B=2, H=16, Hkv=16, N=8192, D=128, window=1024, ctx=32768, dec_B=8, dec_H=32, dec_Hkv=8, page=16,
                flex_N=1024)


def _sdpa_flash():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def _flex_fn():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention, dynamic=False), create_block_mask


def section(suite: Suite, name: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # a failing section is reported, the others still run
        suite.note(f"section {name!r} failed: {type(e).__name__}: {e}")
        traceback.print_exc()


def correctness(suite: Suite, s: dict, dev: str, dtype) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    B, H, N, D = s["B"], s["H"], s["N"], s["D"]
    q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=dtype, generator=g) for _ in range(4))
    for name, mask in (("causal", M.causal()), ("window", M.sliding_window(s["window"] - 1))):
        dense = mask.dense(1, 1, N, N, device=dev)
        ref, g_ref = _reference64(q, k, v, do, dense)
        qb, kb, vb = (t.detach().requires_grad_(True) for t in (q, k, v))
        base = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=dense)
        g_base = torch.autograd.grad(base, (qb, kb, vb), do)
        qt, kt, vt = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = qkv.attention(qt, kt, vt, mask=mask, backend="triton")
        g_out = torch.autograd.grad(out, (qt, kt, vt), do)
        checks = [assert_within_budget(out.detach(), ref.detach(), base.detach(), what=f"{name} out")]
        for n, a, r, b in zip(("dq", "dk", "dv"), g_out, g_ref, g_base):
            checks.append(assert_within_budget(a, r, b, what=f"{name} {n}"))
        suite.add({"section": "correctness", "case": name, "N": N},
                  {"ok": True, "worst_ratio": max(c.candidate_error / max(c.allowed, 1e-30) for c in checks)})


def _reference64(q, k, v, do, dense):
    """Float64 SDPA output and gradients, one head at a time (the heads are independent, Hq = Hkv)."""
    outs, grads = [], ([], [], [])
    for h in range(q.shape[1]):
        xs = [t[:, h:h + 1].detach().double().requires_grad_(True) for t in (q, k, v)]
        o = torch.nn.functional.scaled_dot_product_attention(*xs, attn_mask=dense)
        for acc, g in zip(grads, torch.autograd.grad(o, xs, do[:, h:h + 1].double())):
            acc.append(g)
        outs.append(o.detach())
    return torch.cat(outs, 1), [torch.cat(g, 1) for g in grads]


def speed(suite: Suite, s: dict, dev: str, dtype, repeat: int, dry: bool) -> None:
    B, H, N, D, W = s["B"], s["H"], s["N"], s["D"], s["window"]
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=dtype, generator=g) for _ in range(4))
    flex, create_block_mask = _flex_fn()
    for case, mask in (("causal", M.causal()), (f"window{W}", M.sliding_window(W - 1))):
        causal = case == "causal"

        def mask_mod(b, h, qi, ki, causal=causal):
            return (ki <= qi) if causal else ((ki <= qi) & (qi - ki < W))

        bm = create_block_mask(mask_mod, None, None, N, N, device=dev)
        pairs = W * N - W * (W - 1) // 2  # allowed (query, key) pairs of the window, Nq = Nk = N
        flops = attention_flops(B, H, N, N, D, causal=causal, allowed_fraction=None if causal else pairs / (N * N))
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        runs = {
            "triton": (lambda: qkv.attention(q, k, v, mask=mask, backend="triton"),
                       lambda: torch.autograd.grad(qkv.attention(qg, kg, vg, mask=mask, backend="triton"),
                                                   (qg, kg, vg), do)),
            "flex": (lambda: flex(q, k, v, block_mask=bm),
                     # FlexAttention has no backward on CPU (the dry run): forward only there
                     None if dev == "cpu" else
                     lambda: torch.autograd.grad(flex(qg, kg, vg, block_mask=bm), (qg, kg, vg), do)),
        }
        if causal:
            def sdpa_fwd():
                with _sdpa_flash() if dev == "cuda" else _null():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

            def sdpa_bwd():
                with _sdpa_flash() if dev == "cuda" else _null():
                    o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                return torch.autograd.grad(o, (qg, kg, vg), do)

            runs["sdpa_flash"] = (sdpa_fwd, sdpa_bwd)
        row = {}
        for what, idx, mult in (("fwd", 0, 1.0), ("fwdbwd", 1, 3.5)):
            fns = {}
            for name, pair in runs.items():
                if pair[idx] is None:
                    continue
                try:  # the first call compiles; a failing one is reported and left out of the timing
                    _synced(pair[idx], dev)
                    fns[name] = pair[idx]
                except Exception as e:
                    suite.note(f"{case} {name} {what} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            if not fns:
                continue
            times = device_time_interleaved(fns, warmup=1 if dry else 3, repeat=repeat, number=1 if dry else 3)
            for name, ts in times.items():
                row[f"{name}_{what}_tflops"] = mult * flops / statistics.median(ts) / 1e12
            peer = "sdpa_flash" if causal else "flex"
            if "triton" in times and peer in times:
                r = ratio(times[peer], times["triton"])  # time ratio peer / triton = rate ratio triton / peer
                row[f"{what}_vs_{peer}"] = r
                row[f"{what}_target"] = target(r, ">=", TARGETS[(causal, what)])
        suite.add({"section": "speed", "case": case, "B": B, "H": H, "N": N, "D": D}, row)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _synced(fn, dev):
    out = fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return out


def decode(suite: Suite, s: dict, dev: str, dtype, repeat: int, dry: bool) -> None:
    from qkv.backends.triton.decode import paged_decode

    B, Hq, Hkv, D, T, ctx = s["dec_B"], s["dec_H"], s["dec_Hkv"], s["D"], s["page"], s["ctx"]
    nb = ctx // T
    pool = B * nb + 1
    g = torch.Generator(device=dev).manual_seed(2)
    kp = torch.randn(pool, Hkv, T, D, device=dev, dtype=dtype, generator=g)
    vp = torch.randn(pool, Hkv, T, D, device=dev, dtype=dtype, generator=g)
    tables = torch.randperm(B * nb, device=dev).view(B, nb)
    kpos = torch.arange(ctx, device=dev).expand(B, ctx).contiguous()
    qpos = torch.full((B,), ctx - 1, device=dev)
    q = torch.randn(B, Hq, D, device=dev, dtype=dtype, generator=g)
    big = torch.empty(256 << 20 if not dry else 1 << 20, dtype=torch.uint8, device=dev)
    times = device_time_interleaved({"decode": lambda: paged_decode(q, kp, vp, tables, kpos, qpos),
                                     "copy": big.clone}, warmup=1 if dry else 5, repeat=repeat,
                                    number=1 if dry else 20)
    latency = time_fn(lambda: _synced(lambda: paged_decode(q, kp, vp, tables, kpos, qpos), dev),
                      warmup=1 if dry else 5, repeat=repeat)
    kv_bytes = 2 * B * Hkv * ctx * D * kp.element_size()
    # per repeat: the floor (K and V bytes at the copy's read+write rate of that repeat) over the decode's time
    of_floor = spread([kv_bytes / (2 * big.numel() / tc) / td for td, tc in zip(times["decode"], times["copy"])])
    t = statistics.median(times["decode"])
    floor = kv_bytes / (2 * big.numel() / statistics.median(times["copy"]))
    k_all = kp[tables[:1]].permute(0, 2, 1, 3, 4).reshape(1, Hkv, ctx, D)
    v_all = vp[tables[:1]].permute(0, 2, 1, 3, 4).reshape(1, Hkv, ctx, D)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:1, :, None].float(), k_all.float(), v_all.float(),
                                                           enable_gqa=True)
    out, _ = paged_decode(q[:1], kp, vp, tables[:1], kpos[:1], qpos[:1])
    err = float((out.float() - ref[:, :, 0]).abs().max())
    suite.add({"section": "decode", "case": f"paged ctx{ctx}", "B": B, "H": Hq, "Hkv": Hkv, "D": D},
              {"us": t * 1e6, "latency_us": latency * 1e6, "floor_us": floor * 1e6, "of_floor": of_floor,
               "target": target(of_floor, ">=", 0.8), "GBps": kv_bytes / t / 1e9, "max_err_vs_fp32": err})


def flex_backend(suite: Suite, s: dict, dev: str) -> None:
    """The Flex backend's CUDA path against the float64 reference, forward and backward."""
    N = s["flex_N"]
    g = torch.Generator(device=dev).manual_seed(3)
    cases = {
        "causal": dict(mask=M.causal()),
        "window_gqa": dict(mask=M.sliding_window(63), hkv=1),
        "document": dict(mask=M.document(torch.arange(N, device=dev) // max(1, N // 3))),
        "alibi+softcap": dict(mask=M.causal(), score_mod=[mods.alibi(torch.tensor([0.5, 0.25], device=dev)),
                                                           mods.softcap(20.0)]),
    }
    for name, c in cases.items():
        hkv = c.get("hkv", 2)
        q = torch.randn(1, 2, N, 64, device=dev, generator=g)
        k, v = (torch.randn(1, hkv, N, 64, device=dev, generator=g) for _ in range(2))
        do = torch.randn(1, 2, N, 64, device=dev, generator=g)
        kw = dict(mask=c["mask"], score_mod=c.get("score_mod"))
        try:
            r64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
            ref = qkv.attention(*r64, backend="reference", return_lse=True, **kw)
            g_ref = torch.autograd.grad(ref.out, r64, do.double())
            base_in = [t.detach().requires_grad_(True) for t in (q, k, v)]
            base = qkv.attention(*base_in, backend="reference", return_lse=True, **kw)
            g_base = torch.autograd.grad(base.out, base_in, do)
            want_grad = dev == "cuda"  # Flex on CPU is inference only (declined)
            xs = [t.detach().requires_grad_(want_grad) for t in (q, k, v)]
            with torch.set_grad_enabled(want_grad):
                res = qkv.attention(*xs, backend="flex", return_lse=dev == "cuda", **kw)
            out = res.out if dev == "cuda" else res
            assert_within_budget(out.detach(), ref.out.detach(), base.out.detach(), what=f"flex {name} out")
            if dev == "cuda":
                assert_within_budget(res.lse, ref.lse.detach(), base.lse.detach(), what=f"flex {name} lse",
                                     floor=1e-5)
                for n, a, r, b in zip(("dq", "dk", "dv"), torch.autograd.grad(out, xs, do), g_ref, g_base):
                    assert_within_budget(a, r, b, what=f"flex {name} {n}")
            suite.add({"section": "flex_backend", "case": name, "N": N}, {"ok": True})
        except Exception as e:
            if dev == "cpu" and isinstance(e, ValueError) and "cannot run this request" in str(e):
                # the CPU dry run where qkv refuses the CPU's Flex kernel (torch's AVX2 one): recorded, not failed
                suite.add({"section": "flex_backend", "case": name, "N": N}, {"ok": "declined"})
                suite.note(f"flex backend {name}: declined on this CPU: {str(e).splitlines()[0]}")
                continue
            suite.add({"section": "flex_backend", "case": name, "N": N}, {"ok": False})
            suite.note(f"flex backend {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            traceback.print_exc()


def conformance(suite: Suite, dev: str) -> None:
    """The contract battery on ``dev`` for each kernel (see the module docstring)."""
    from qkv import conformance as C

    for name in ("triton", "sdpa", "qkv-sdpa"):
        try:
            report = C.check(name, device=dev, dtypes=(torch.float32, torch.bfloat16))
            differ = [f"{f.check}: {f.seen}"[:160] for f in report.findings if f.ok is False]
            suite.add({"section": "conformance", "case": name},
                      {"ok": not differ, "checks": len(report.findings),
                       "not_supported": sum(f.ok is None for f in report.findings), "differs": "; ".join(differ)})
        except Exception as e:
            suite.add({"section": "conformance", "case": name}, {"ok": False})
            suite.note(f"conformance {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            traceback.print_exc()


SECTIONS = ("correctness", "speed", "decode", "flex_backend", "conformance")


def _own_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This suite's flags (``--dry-run``, ``--sections``); the rest go to the harness's common parser."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--tuned", default=None)
    own, rest = p.parse_known_args(argv)
    own.sections = [x.strip() for x in own.sections.split(",") if x.strip()]
    unknown = [x for x in own.sections if x not in SECTIONS]
    if unknown or not own.sections:
        p.error(f"--sections: expected a comma-separated subset of {','.join(SECTIONS)}, got {unknown or 'none'}")
    return own, rest


def main(argv=None) -> int:
    own, rest = _own_args(argv if argv is not None else sys.argv[1:])
    dry = own.dry_run
    args = parse_args(__doc__.splitlines()[0] + " Also: --dry-run, --sections (see the module docstring).", rest)
    if not dry and not torch.cuda.is_available():
        why = ("no CUDA device here, nothing measured. Run it on a GPU machine, or pass --dry-run to check the "
               "script's logic on CPU through Triton's interpreter (timings meaningless).")
        print(f"benchmarks/gpu.py: {why}")
        suite = Suite("gpu", "Triton kernels vs SDPA-flash and Flex; Flex backend on CUDA", measured=False)
        suite.note(why)  # an empty table in RESULTS.md that says why, rather than a silently missing section
        suite.finish()
        return 0
    tuned = None
    if own.tuned:
        from gpu_tune import apply_best

        tuned = apply_best(own.tuned)
    dev = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.bfloat16
    s = _sizes(dry)
    repeat = args.repeat or (1 if dry else 10)
    suite = Suite("gpu", "Triton kernels vs SDPA-flash and Flex; Flex backend on CUDA", dry_run=dry,
                  dtype=str(dtype).replace("torch.", ""), sections=own.sections, tuned=tuned)
    runs = {"correctness": lambda: correctness(suite, s, dev, dtype),
            "speed": lambda: speed(suite, s, dev, dtype, repeat, dry),
            "decode": lambda: decode(suite, s, dev, dtype, repeat, dry),
            "flex_backend": lambda: flex_backend(suite, s, dev),
            "conformance": lambda: conformance(suite, dev)}
    for name in SECTIONS:
        if name in own.sections:
            section(suite, name, runs[name])
    if dry:
        suite.note("dry run on CPU through Triton's interpreter: timings are meaningless, sizes tiny")
    suite.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
