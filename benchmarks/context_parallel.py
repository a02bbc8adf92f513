"""Context parallelism on gloo (CPU processes): causal balance, bytes per rank, time per step, and the cost model.

For W = 2 and 4 ranks on this machine, causal attention over one sequence (float32, B=1, 8 query heads,
4 K/V heads, head dim 64), forward and backward:

- per-rank work: score elements computed (max / min over ranks) and pairs the mask allows, ring vs zigzag vs
  stripe (and the rest);
- bytes each rank sends, measured by ``qkv.distributed.CommLog``, against the formula of
  :func:`qkv.costs.context_parallel.layer_time`;
- time per step (the slowest rank, median of repeats) against single-process ``qkv.attention`` on the whole
  sequence in the same processes, and against the cost model calibrated on this machine (measured attention
  rate, gloo send bandwidth and latency): ``predicted / measured``;
- PyTorch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``) where it
  runs on CPU/gloo; where it does not, the reason it gave.

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

from _harness import Suite, parse_args

SCHEMES = ("ring", "zigzag", "stripe", "allgather", "ulysses")
B, HQ, HKV, D = 1, 8, 4, 64


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
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


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
    rows = {}

    def single():
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        qkv.attention(qs, ks, vs, mask=causal).sum().backward()

    t0 = time.perf_counter()
    single()
    single_s = time.perf_counter() - t0
    rows["single_ms"] = _step_time(single, repeat) * 1e3  # every rank runs it (the same work) at once
    rows["single_first_s"] = single_s
    rows["link"] = _link(repeat)
    for scheme in SCHEMES:
        shards = [cp.shard(t, scheme=scheme) for t in (q, k, v)]

        def step(log=None):
            ql, kl, vl = (t.clone().requires_grad_(True) for t in shards)
            cp.attention(ql, kl, vl, mask=causal, scheme=scheme, log=log, timeout=600).sum().backward()

        log = cp.CommLog()
        step(log)
        rows[scheme] = dict(ms=_step_time(step, repeat) * 1e3, work=log.work, allowed=log.allowed,
                            bytes=log.bytes_by_phase["forward"] + log.bytes_by_phase["backward"])
    rows["torch_cp"] = _torch_cp(n, repeat)
    torch.save(rows, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _calibrated_device(rate: float, link: tuple[float, float]):
    from qkv.costs.context_parallel import Device

    return Device("this-cpu", 0.0, 1e15, rate, rate, link[0], link[1])


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    from qkv.costs.context_parallel import layer_time
    from qkv.costs.presets import ModelPreset

    n = 256 if args.quick else 4096
    repeat = args.repeat or (2 if args.quick else 5)
    shape = ModelPreset(name="bench", num_hidden_layers=1, num_attention_heads=HQ, num_key_value_heads=HKV,
                        head_dim=D, hidden_size=HQ * D)
    suite = Suite("context_parallel", "causal attention over gloo ranks (fwd+bwd, float32): balance, bytes, time",
                  N=n, B=B, Hq=HQ, Hkv=HKV, D=D, dtype="float32", transport="gloo (127.0.0.1)")
    for world in (2, 4):
        with tempfile.TemporaryDirectory() as outdir:
            mp.start_processes(_worker, args=(world, _port(), n, repeat, outdir), nprocs=world, join=True,
                               start_method="spawn")
            ranks = [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        single_ms = ranks[0]["single_ms"]
        # the attention rate of this machine, from the single-process step (3.5 x the causal forward FLOPs)
        rate = 3.5 * 2 * B * HQ * n * n * 2 * D / 2 / (single_ms / 1e3)
        device = _calibrated_device(rate, ranks[0]["link"])
        for scheme in SCHEMES:
            r = [rk[scheme] for rk in ranks]
            work, allowed = [x["work"] for x in r], [x["allowed"] for x in r]
            predicted = layer_time(shape, context=n, world=world, scheme=scheme, device=device, bytes_per_element=4.0,
                                   accumulate_bytes=4.0)
            suite.add({"W": world, "scheme": scheme},
                      {"ms": r[0]["ms"], "single_ms": single_ms, "speedup": single_ms / r[0]["ms"],
                       "work_max/min": max(work) / max(min(work), 1),
                       "allowed_max/min": max(allowed) / max(min(allowed), 1),
                       "MB_sent_rank0": r[0]["bytes"] / 1e6, "MB_formula": predicted.bytes_sent / 1e6,
                       "predicted_ms": predicted.total_s * 1e3,
                       "predicted/measured": predicted.total_s * 1e3 / r[0]["ms"]})
        tcp = ranks[0]["torch_cp"]
        if tcp.get("torch_cp_ms") is not None:
            suite.add({"W": world, "scheme": "torch context_parallel (SDPA is_causal)"},
                      {"ms": tcp["torch_cp_ms"], "single_ms": single_ms, "speedup": single_ms / tcp["torch_cp_ms"]})
        else:
            suite.note(f"W={world}: torch.distributed.tensor.experimental.context_parallel did not run on CPU/gloo: "
                       f"{tcp['torch_cp_error']}")
        bw, lat = ranks[0]["link"]
        suite.note(f"W={world}: calibration: attention {rate / 1e9:.2f} GFLOP/s (single process, fwd+bwd), gloo "
                   f"{bw / 1e9:.2f} GB/s, latency {lat * 1e6:.0f} us")
    suite.finish()


if __name__ == "__main__":
    main()
