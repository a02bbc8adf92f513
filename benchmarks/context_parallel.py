"""Context parallelism on gloo (CPU processes): causal balance, bytes per rank, time per step, and the cost model.

For W = 2 and 4 ranks on this machine, causal attention over one sequence (float32, B=1, 8 query heads,
4 K/V heads, head dim 64), forward and backward, every scheme (``usp`` at W = 4 as 2 x 2):

- agreement: the largest difference of the gathered distributed output from single-process ``qkv.attention``
  on the whole sequence (``max_abs_err``), and bytes each rank sends (``qkv.distributed.CommLog``) against the
  formula of :func:`qkv.costs.context_parallel.layer_time`;
- per-rank work: score elements computed (max / min over ranks) and pairs the mask allows;
- time per step (the slowest rank, median of repeats) against single-process ``qkv.attention`` in the same
  processes, and against the cost model (``predicted / measured`` per repeat; the target, ``BAND``, is met
  when every repeat lands inside it). Every term of the model is measured in the same run, never fitted to the steps:
  the attention rate, the backward/forward ratio and the fixed cost per block of qkv's own block code
  (``qkv.distributed.plan``: a causal-diagonal and a full block of the ring's size, against 16-token blocks for
  the fixed cost), the share of a core each rank gets while all W compute at once (ranks outnumber cores here),
  and gloo's bandwidth and latency;
- PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``) where it
  runs on CPU/gloo; where it does not, the reason it gave.

Published configuration (the defaults): N = 4096, 5 repeats, wall clock (ranks sharing cores is part of what
is measured), 1 torch thread per rank. Expected time on a quiet 2-core machine: not yet measured at this size;
about 5 to 10 minutes by extrapolation from N = 1024.

    python benchmarks/context_parallel.py [--quick] [--repeat R]
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _harness import Suite, parse_args, spread, target, time_interleaved

SCHEMES = ("ring", "zigzag", "stripe", "allgather", "ulysses", "usp")
B, HQ, HKV, D = 1, 8, 4, 64
USP_ULYSSES = 2  # usp at W = 4: Ulysses over pairs, a ring of two
BAND = (0.5, 2.0)  # the target: predicted / measured inside this band for every scheme
TINY = 16  # tokens per side of the blocks that measure the fixed cost per block
N_QUICK, N_PUBLISHED = 256, 4096  # sequence length of --quick and of the published table


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(n: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, n, D, generator=g)
    k = torch.randn(B, HKV, n, D, generator=g)
    v = torch.randn(B, HKV, n, D, generator=g)
    return q, k, v


def _step_time(fn, repeat: int) -> float:
    """Median over repeats of the slowest rank's time for ``fn`` (ranks start together at a barrier)."""
    return statistics.median(_step_times(fn, repeat))


def _step_times(fn, repeat: int) -> list[float]:
    """Every repeat's slowest-rank time for ``fn`` (ranks start together at a barrier), after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return times


def _link(repeat: int) -> tuple[float, float]:
    """gloo bandwidth (bytes/s, from a 4 MB send/receive between ranks 0 and 1) and latency (8-byte message)."""
    rank = dist.get_rank()

    def ping(nbytes):
        x = torch.zeros(nbytes // 4)
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    out = []
    for nbytes in (8, 4 << 20):
        t = _step_time(lambda: ping(nbytes), repeat) / 2
        out.append(t)
    latency = out[0]
    return (4 << 20) / max(out[1] - latency, 1e-9), latency


def _blocks(m: int):
    """Forward and backward of one block of qkv's distributed attention (``m`` queries by ``m`` keys, all heads):
    a causal-diagonal block and a full one (the ring's two kinds), through the scheme-independent block loop."""
    import qkv
    from qkv.distributed.plan import ForwardState, Plan, attend_owner, grad_owner

    q, k, v = _inputs(m)
    causal = qkv.masks.causal()
    fns = {}
    for kind, q_index in (("diagonal", torch.arange(m)), ("full", torch.arange(m, 2 * m))):
        plan = Plan(None, 0, 1, [q_index], [torch.arange(m)], [[slice(0, m)]], [[slice(0, m)]], 0, HQ, 2 * m, 2 * m,
                    causal, None, D ** -0.5, "auto", None)
        state = ForwardState(q, D)
        attend_owner(state, plan, 0, q, k, v)
        do = torch.randn_like(state.out)
        delta = (do * state.out).sum(-1)

        def fwd(plan=plan):
            attend_owner(ForwardState(q, D), plan, 0, q, k, v)

        def bwd(plan=plan, state=state, do=do, delta=delta):
            grad_owner(plan, 0, q, k, v, do, state.lse, delta, None, torch.zeros_like(q), torch.zeros_like(k),
                       torch.zeros_like(v), [])

        fns[f"{kind} fwd"], fns[f"{kind} bwd"] = fwd, bwd
    return fns


def _calibrate(m: int, repeat: int) -> dict:
    """The cost model's terms for qkv's blocks on this machine, measured on rank 0 alone (the others wait at a
    barrier) and then with every rank computing at once (wall clock both: sharing cores is what it measures)."""
    rank = dist.get_rank()
    tiny, block = _blocks(TINY), _blocks(m)
    fns = {**{f"tiny {k}": f for k, f in tiny.items()}, **block}
    alone = None
    dist.barrier()
    if rank == 0:
        alone = time_interleaved(fns, warmup=1, repeat=repeat)
    dist.barrier()
    together = time_interleaved(block, warmup=1, repeat=repeat)
    dist.barrier()
    if rank != 0:
        return {}
    t = {k: alone[k] for k in fns}

    def mean(*names):
        return sum(t[n] for n in names) / len(names)

    overhead = mean("tiny diagonal fwd", "tiny full fwd", "tiny diagonal bwd", "tiny full bwd")
    fwd = max(mean("diagonal fwd", "full fwd") - mean("tiny diagonal fwd", "tiny full fwd"), 1e-9)
    bwd = max(mean("diagonal bwd", "full bwd") - mean("tiny diagonal bwd", "tiny full bwd"), 0.0)
    flops = 2.0 * B * HQ * m * m * (D + D)  # the cost model's count for one m x m block
    share = sum(alone[k] for k in block) / sum(together[k] for k in block)
    return dict(rate=flops / fwd, backward_multiplier=bwd / fwd, block_overhead_s=overhead,
                compute_share=min(share, 1.0))


def _torch_cp(n: int, repeat: int) -> dict:
    """PyTorch's context parallel on the same problem, or why it does not run here."""
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        q, k, v = _inputs(n)

        def step():
            buffers = [t.clone() for t in (q, k, v)]  # sharded in place, restored on exit
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
                qs, ks, vs = (t.detach().requires_grad_(True) for t in buffers)
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                out.sum().backward()

        return dict(torch_cp_ms=_step_time(step, repeat) * 1e3)
    except Exception as e:  # the reason is the result
        return dict(torch_cp_ms=None, torch_cp_error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")


def _worker(rank: int, world: int, port: int, n: int, repeat: int, outdir: str) -> None:
    import qkv
    import qkv.distributed as cp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    q, k, v = _inputs(n)
    causal = qkv.masks.causal()
    usp = cp.usp_groups(ulysses=USP_ULYSSES) if world % USP_ULYSSES == 0 and world > USP_ULYSSES else None
    rows = {}

    def single():
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        qkv.attention(qs, ks, vs, mask=causal).sum().backward()

    reference = qkv.attention(q, k, v, mask=causal)
    rows["single_ms"] = _step_time(single, repeat) * 1e3  # every rank runs it (the same work) at once
    rows["link"] = _link(repeat)
    rows["calibration"] = _calibrate(n // world, repeat)
    for scheme in SCHEMES:
        if scheme == "usp" and usp is None:
            continue
        group = usp if scheme == "usp" else None
        shards = [cp.shard(t, scheme=scheme, group=group) for t in (q, k, v)]

        def step(log=None):
            ql, kl, vl = (t.clone().requires_grad_(True) for t in shards)
            out = cp.attention(ql, kl, vl, mask=causal, scheme=scheme, group=group, log=log, timeout=600)
            out.sum().backward()
            return out

        log = cp.CommLog()
        out = cp.unshard(step(log), scheme=scheme, group=group)
        times = _step_times(step, repeat)
        rows[scheme] = dict(ms=statistics.median(times) * 1e3, times=times, work=log.work, allowed=log.allowed,
                            bytes=log.bytes_by_phase["forward"] + log.bytes_by_phase["backward"],
                            max_abs_err=float((out - reference).abs().max()))
    rows["torch_cp"] = _torch_cp(n, repeat)
    torch.save(rows, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _calibrated_device(cal: dict, link: tuple[float, float]):
    from qkv.costs.context_parallel import Device

    return Device("this-cpu", 0.0, 1e15, cal["rate"], cal["rate"], link[0], link[1],
                  backward_multiplier=cal["backward_multiplier"], block_overhead_s=cal["block_overhead_s"],
                  compute_share=cal["compute_share"], skips_masked_tiles=False)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    from qkv.config import DecoderConfig
    from qkv.config.presets import ModelPreset
    from qkv.costs.context_parallel import layer_time

    n = N_QUICK if args.quick else N_PUBLISHED
    repeat = args.repeat or (2 if args.quick else 5)
    shape = ModelPreset(config=DecoderConfig(name="bench", num_hidden_layers=1, num_attention_heads=HQ,
                                             num_key_value_heads=HKV, head_dim=D, hidden_size=HQ * D,
                                             vocab_size=None, intermediate_size=None))
    suite = Suite("context_parallel", "causal attention over gloo ranks (fwd+bwd, float32): balance, bytes, time",
                  N=n, B=B, Hq=HQ, Hkv=HKV, D=D, dtype="float32", transport="gloo (127.0.0.1)",
                  predicted_over_measured_band=list(BAND), cpu_cores=len(os.sched_getaffinity(0)))
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as outdir:
            mp.start_processes(_worker, args=(world, _port(), n, repeat, outdir), nprocs=world, join=True,
                               start_method="spawn")
            ranks = [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        single_ms = ranks[0]["single_ms"]
        cal = ranks[0]["calibration"]
        device = _calibrated_device(cal, ranks[0]["link"])
        for scheme in SCHEMES:
            if scheme not in ranks[0]:
                continue
            r = [rk[scheme] for rk in ranks]
            work, allowed = [x["work"] for x in r], [x["allowed"] for x in r]
            predicted = layer_time(shape, context=n, world=world, scheme=scheme, device=device, bytes_per_element=4.0,
                                   accumulate_bytes=4.0, check=True, ulysses=USP_ULYSSES)
            # one ratio per repeat; the target is met only when every repeat lands inside the band
            ratio = spread([predicted.total_s / t for t in r[0]["times"]])
            met = target(ratio, ">=", BAND[0]) == "met" and target(ratio, "<=", BAND[1]) == "met"
            suite.add({"W": world, "scheme": scheme},
                      {"ms": r[0]["ms"], "single_ms": single_ms, "speedup": single_ms / r[0]["ms"],
                       "max_abs_err": max(x["max_abs_err"] for x in r),
                       "work_max/min": max(work) / max(min(work), 1),
                       "allowed_max/min": max(allowed) / max(min(allowed), 1),
                       "MB_sent_rank0": r[0]["bytes"] / 1e6, "MB_formula": predicted.bytes_sent / 1e6,
                       "predicted_ms": predicted.total_s * 1e3, "predicted/measured": ratio,
                       "target": "met" if met else "missed"})
        tcp = ranks[0]["torch_cp"]
        if tcp.get("torch_cp_ms") is not None:
            suite.add({"W": world, "scheme": "torch context_parallel (SDPA is_causal)"},
                      {"ms": tcp["torch_cp_ms"], "single_ms": single_ms, "speedup": single_ms / tcp["torch_cp_ms"]})
        else:
            suite.note(f"W={world}: torch.distributed.tensor.experimental.context_parallel did not run on CPU/gloo: "
                       f"{tcp['torch_cp_error']}")
        bw, lat = ranks[0]["link"]
        suite.note(f"W={world}: measured model terms: qkv block attention {cal['rate'] / 1e9:.2f} GFLOP/s, backward "
                   f"{cal['backward_multiplier']:.2f} x forward, {cal['block_overhead_s'] * 1e3:.2f} ms fixed "
                   f"per block and pass, compute share {cal['compute_share']:.2f} per rank ({world} ranks, "
                   f"{len(os.sched_getaffinity(0))} cores), gloo {bw / 1e9:.2f} GB/s, latency {lat * 1e6:.0f} us")
    missed = [f"W={r['W']} {r['scheme']} ([{r['predicted/measured']['min']:.2f}, "
              f"{r['predicted/measured']['max']:.2f}])" for r in suite.rows
              if r.get("target") == "missed"]
    suite.note(f"predicted / measured: target band [{BAND[0]}, {BAND[1]}] for every scheme; "
               + (f"outside it: {', '.join(missed)}" if missed else "every scheme inside it"))
    suite.note("The model assumes (qkv.costs.context_parallel): qkv's blocks score every pair of a block the mask "
               "leaves non-empty; the block rate, backward ratio and fixed cost are those of a causal-diagonal and a "
               "full block of the ring's size (zigzag's blocks are half as long, Ulysses' hold Hq/W heads); ranks "
               "that share cores share the mean rank's work at the measured compute share (an idle ring rank leaves "
               "its core to the busy one); K/V shifts overlap a step's blocks, dK/dV shifts do not; the link terms "
               "are a 4 MB and an 8-byte ping-pong between ranks 0 and 1. Each term is measured in this run, so "
               "load from other processes on the machine moves both sides of the ratio, but not by the same amount.")
    suite.finish()


if __name__ == "__main__":
    main()
