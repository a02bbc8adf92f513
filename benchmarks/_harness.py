"""Shared benchmark harness: timing, the floor, full context, table and JSON output.

Every suite in this folder measures qkv against a peer on the same inputs in the same process and
reports ratios (absolute CPU times are noisy and only mean something relative to each other).

Usage inside a suite::

    suite = Suite("dense", "qkv.attention(auto) against torch SDPA")
    t_qkv = time_fn(lambda: qkv.attention(q, k, v))
    suite.add({"N": 1024, "causal": True}, {"qkv_ms": t_qkv * 1e3, ...})
    suite.finish()   # prints a table, writes benchmarks/out/dense.json and dense.md

Ratios carry their spread: ``time_interleaved(..., samples=True)`` keeps every repeat, ``ratio(a, b)``
turns two paired sample lists into ``{"median", "min", "max"}`` over the repeats, and ``target(...)``
calls a target met only when the slowest repeat meets it. ``benchmarks/render.py`` reads these fields.

Each suite's command-line defaults are its published configuration (threads, clock, repeats, sizes), so
``python benchmarks/SUITE.py`` and ``make bench`` reproduce the tables in ``RESULTS.md``; ``--quick`` is
the smallest size, which the test suite runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

OUT_DIR = Path(os.environ.get("QKV_BENCH_OUT", Path(__file__).resolve().parent / "out"))


def parse_args(description: str, argv: list[str] | None = None, *, threads: int | None = None,
               cpu_time: bool = False) -> argparse.Namespace:
    """Common flags: ``--quick`` (smoke run), ``--repeat``, ``--threads`` and ``--cpu-time``/``--wall-time``.

    ``threads`` and ``cpu_time`` are the suite's published defaults. ``--threads`` is applied here
    (``torch.set_num_threads``) so every suite honours it alike.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    p.add_argument("--repeat", type=int, default=None, help="timed repeats per case (median is reported)")
    p.add_argument("--threads", type=int, default=threads,
                   help="torch threads " + (f"(default: {threads})" if threads else "(default: torch's own)"))
    clock = p.add_mutually_exclusive_group()
    clock.add_argument("--cpu-time", dest="cpu_time", action="store_true", default=cpu_time,
                       help="time with the process CPU clock (with --threads 1: robust on a shared, loaded machine)"
                       + (" (default)" if cpu_time else ""))
    clock.add_argument("--wall-time", dest="cpu_time", action="store_false",
                       help="time with the wall clock" + ("" if cpu_time else " (default)"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, repeat: int = 7, min_time: float = 0.0) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs.

    ``min_time`` (seconds) keeps repeating until that much time has been spent, for very short calls.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < repeat or spent < min_time:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        if len(times) > 10_000:
            break
    return statistics.median(times)


def cold_times(fns: dict[str, Callable[[], Any]], repeat: int, evict: torch.Tensor) -> dict[str, list[float]]:
    """Seconds per call of each named callable, every repeat (paired across names by index): round-robin after one
    warm-up call each, ``evict`` (a buffer larger than the caches) written before every call, so each call reads
    its operands from memory, as a decode step reads its weights."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            evict.add_(1.0)
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def time_interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeat: int = 7,
                     cpu: bool = False, number: int | dict[str, int] = 1, samples: bool = False) -> dict[str, Any]:
    """Median seconds per call of each named callable, running them round-robin so drift hits all alike.

    ``cpu=True`` reads the process CPU clock instead of the wall clock. ``number`` calls are timed
    together per repeat (for calls of microseconds); a dict gives each name its own count (callables of
    very different lengths). ``samples=True`` returns every repeat's seconds per call (a list per name,
    paired across names by index) instead of the medians.
    """
    clock = time.process_time if cpu else time.perf_counter
    counts = {name: number.get(name, 1) if isinstance(number, dict) else number for name in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(counts[name]):
                fn()
            times[name].append((clock() - t0) / counts[name])
    if samples:
        return times
    return {name: statistics.median(s) for name, s in times.items()}


def device_time_interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int = 2, repeat: int = 7,
                            number: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each named callable on the GPU, every repeat (paired across names by index).

    On CUDA each repeat times ``number`` back-to-back calls between two CUDA events, so the host's launch work
    overlaps the device's and the time is the device's (what a decode loop or a training step sees; one
    synchronised call adds the host's launch latency on top). Elsewhere (a dry run on CPU) it is the wall clock
    of :func:`time_interleaved`.
    """
    if not torch.cuda.is_available():
        return time_interleaved(fns, warmup=warmup, repeat=repeat, number=number, samples=True)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(number):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3 / number)
    return times


def spread(values: list[float]) -> dict[str, float]:
    """``{"median", "min", "max", "n"}`` of per-repeat values: what ``render.py`` prints as a range."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def median_ms(samples: list[float]) -> float:
    """The median of per-repeat seconds, in milliseconds (a time column next to a ratio's range)."""
    return statistics.median(samples) * 1e3


def calls_for(seconds: float, block: float = 2e-3, most: int = 2000) -> int:
    """How many calls of ``seconds`` each to time together so a timed block lasts about ``block`` seconds."""
    return max(1, min(most, int(block / max(seconds, 1e-7))))


def ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """The spread of per-repeat ratios ``num[i] / den[i]`` of two paired sample lists."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio: need paired, non-empty samples, got {len(num)} and {len(den)}")
    return spread([a / b for a, b in zip(num, den)])


def target(value: dict[str, float] | float, op: str, threshold: float) -> str:
    """``"met"`` when every repeat meets ``value op threshold`` (``op`` is ``"<="`` or ``">="``), else
    ``"missed"``: the slowest repeat decides, not the median."""
    if op not in ("<=", ">="):
        raise ValueError(f"target: op must be '<=' or '>=', got {op!r}")
    if isinstance(value, dict):
        worst = value["max"] if op == "<=" else value["min"]
    else:
        worst = value
    ok = worst <= threshold if op == "<=" else worst >= threshold
    return "met" if ok else "missed"


def gemm_rate(dtype: torch.dtype = torch.float32, device: str = "cpu", n: int = 1024, *, cpu: bool = False) -> float:
    """Measured matmul rate in FLOP/s for an n x n x n product: the denominator of the compute floor. ``cpu=True``
    reads the process CPU clock, as a suite timed on that clock must (on a loaded machine the wall-clock rate
    drops and the floor would rise with it)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = time_interleaved({"mm": lambda: torch.mm(a, b)}, warmup=2, repeat=5, cpu=cpu)["mm"]
    return 2.0 * n**3 / t


def attention_flops(B: int, Hq: int, Nq: int, Nk: int, D: int, *, causal: bool = False,
                    allowed_fraction: float | None = None) -> float:
    """Forward attention FLOPs ``4 B Hq Nq Nk D`` (two matmuls), halved when causal, or scaled by
    the allowed fraction of (query, key) pairs for a sparse mask."""
    f = 4.0 * B * Hq * Nq * Nk * D
    if allowed_fraction is not None:
        return f * allowed_fraction
    return f / 2 if causal else f


def _cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), so tables from different hosts are told apart."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def context(**extra: Any) -> dict[str, Any]:
    """The full context a number needs to be read: versions, threads, device, time."""
    ctx: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": "cuda:" + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import qkv

        ctx["qkv"] = getattr(qkv, "__version__", "?")
    except ImportError:  # pragma: no cover - benchmarks always run inside the project
        pass
    ctx.update(extra)
    return ctx


_READ_RATE: dict[int, float] = {}


def read_rate(threads: int) -> float:
    """Bytes/s at which ``threads`` threads read a 256 MB float32 matrix (far larger than any cache) once, by a
    sum over it, the best of 7 (cached per thread count): the memory floor of a step that must read every
    weight once (a matrix-vector product reads slower than a sum; how much slower depends on the BLAS kernel).
    Leaves torch at ``threads`` threads."""
    torch.set_num_threads(threads)
    if threads not in _READ_RATE:
        w = torch.randn(32768, 2048)
        w.sum()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            w.sum()
            times.append(time.perf_counter() - t0)
        _READ_RATE[threads] = w.numel() * w.element_size() / min(times)
    return _READ_RATE[threads]


def peak_rss_during(fn: Callable[[], Any], interval_s: float = 1e-3) -> int:
    """Peak growth of this process's resident memory while ``fn`` runs, in bytes: ``/proc/self/statm`` read every
    ``interval_s`` by a thread (CUDA: the allocator's peak, as :func:`peak_memory_during`). For calls with so many
    ops that the profiler's per-event records (:func:`peak_memory_during`) would themselves fill the memory (a
    gather of one query row at a time over 32K rows); it misses spikes shorter than the interval."""
    import os
    import threading

    if torch.cuda.is_available():
        return peak_memory_during(fn)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    try:  # hand freed heap memory back first, so what fn allocates shows as growth (glibc)
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    base = peak = rss()
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss())
            done.wait(interval_s)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak, rss()) - base


def peak_memory_during(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated by ``fn`` above the allocation at entry (CUDA allocator or CPU profiler)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Walk allocation events in order and track the running total to find the peak. Each event's own
    # allocations only (``self_cpu_memory_usage``): ``cpu_memory_usage`` includes its children's, so an
    # allocation inside ``matmul -> bmm`` would count twice while its free counts once, and the total drifts up.
    current = peak = 0
    events = sorted(
        (e for e in prof.events() if getattr(e, "self_cpu_memory_usage", 0)),
        key=lambda e: e.time_range.start,
    )
    for e in events:
        current += e.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


class Suite:
    """Collects rows of (case, results) and writes them with the context."""

    def __init__(self, name: str, description: str, **ctx: Any) -> None:
        self.name = name
        self.description = description
        self.ctx = context(**ctx)
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def add(self, case: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
        row = {**case, **results}
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)

    def markdown(self) -> str:
        if not self.rows:
            return f"### {self.name}\n\n(no rows)\n"
        cols = list(dict.fromkeys(c for r in self.rows for c in r))
        lines = [f"### {self.name}: {self.description}", "", "| " + " | ".join(cols) + " |",
                 "|" + "---|" * len(cols)]
        for r in self.rows:
            lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
        lines.append("")
        ctx = ", ".join(f"{k}={v}" for k, v in self.ctx.items())
        lines.append(f"Context: {ctx}")
        for n in self.notes:
            lines.append(f"\n{n}")
        return "\n".join(lines) + "\n"

    def print_table(self) -> None:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:  # pragma: no cover
            print(self.markdown())
            return
        cols = list(dict.fromkeys(c for r in self.rows for c in r))
        table = Table(title=f"{self.name}: {self.description}")
        for c in cols:
            table.add_column(str(c), justify="right")
        for r in self.rows:
            table.add_row(*(_fmt(r.get(c, "")) for c in cols))
        console = Console(width=200)
        console.print(table)
        for n in self.notes:
            console.print(n)

    def finish(self) -> Path:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        path = OUT_DIR / f"{self.name}.json"
        payload = {"suite": self.name, "description": self.description, "context": self.ctx,
                   "rows": self.rows, "notes": self.notes}
        path.write_text(json.dumps(payload, indent=2, default=str))
        (OUT_DIR / f"{self.name}.md").write_text(self.markdown())
        self.print_table()
        print(f"wrote {path}")
        return path


def _fmt(v: Any) -> str:
    if isinstance(v, dict) and "median" in v:
        return f"{_fmt(v['median'])} [{_fmt(v['min'])}, {_fmt(v['max'])}]"
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.3f}"
        return f"{v:.3g}"
    return str(v)


#: Op names that multiply by the weights: torch's, and qkv's compiled products (the weight-streaming kernel, row
#: blocks, the head screen, the fused experts).
PRODUCT_OPS = ("linear", "bmm", "addmm", "mm", "baddbmm", "head_screen", "weight_linear", "rows_linear",
               "screened_argmax", "moe_token", "moe_grouped")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention")
#: Profiler ranges (torch.profiler.record_function) whose ops are attention whatever their names: the paged decode
#: block path's GEMMs and gathers read keys and values, not weights; the compiled decode step's own loops
#: (qkv.cpu.kernels.profiled names them while the profiler records)
ATTENTION_RANGES = ("qkv::paged_decode_blocks", "qkv::paged_prefill_blocks", "qkv::decode_attention")


def _op_categories(prof) -> dict[str, float]:
    """Self CPU seconds of a profiled run by category: products, attention, other torch ops (an op inside one of
    :data:`ATTENTION_RANGES` counts as attention)."""
    out = {"products": 0.0, "attention": 0.0, "other_ops": 0.0}
    for e in prof.events():
        if e.name in ATTENTION_RANGES:
            out["attention"] += e.self_cpu_time_total / 1e6
            continue
        name = e.name.split("::")[-1]
        parent, inside = e.cpu_parent, False
        while parent is not None and not inside:
            inside, parent = parent.name in ATTENTION_RANGES, parent.cpu_parent
        kind = ("attention" if inside or any(a in name for a in ATTENTION_OPS)
                else "products" if name in PRODUCT_OPS or name.startswith("_linear") else "other_ops")
        out[kind] += e.self_cpu_time_total / 1e6
    return out


def stream_breakdown(run_seconds) -> dict[str, float]:
    """Where one whole run goes (ms): ``run_seconds()`` (returning its wall seconds) under torch's profiler, by
    category (``products``, ``attention``, ``other_ops``; ``python``: the wall time no torch op accounts for), as
    ``stream_*_ms``. Indicative, as :func:`step_breakdown`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = run_seconds()
    cats = _op_categories(prof)
    cats["python"] = wall - sum(cats.values())
    return {f"stream_{k}_ms": v * 1e3 for k, v in cats.items()}


def step_breakdown(generate_seconds, n_new: int) -> dict[str, float]:
    """Where one decode step's time goes (ms): ``generate_seconds(n)`` (a generation of ``n`` new tokens,
    returning its wall seconds) run for ``n_new`` and for 1 token under torch's profiler, the difference over
    ``n_new - 1`` steps by category (``products``, ``attention``, ``other_ops``); ``python`` is the wall time no
    torch op accounts for. Indicative: the profiler's own cost lands in the small ops and in Python."""
    from torch.profiler import ProfilerActivity, profile

    runs = []
    for n in (n_new, 1):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = generate_seconds(n)
        runs.append({**_op_categories(prof), "wall": wall})
    per = {k: (runs[0][k] - runs[1][k]) / (n_new - 1) * 1e3 for k in runs[0]}
    per["python"] = per.pop("wall") - per["products"] - per["attention"] - per["other_ops"]
    return {f"step_{k}_ms": v for k, v in per.items()}


def token_agreement(a, b) -> float:
    """Mean over rows of the fraction of a row's greedy tokens before two engines' rows first differ (1.0: equal);
    ``a`` and ``b`` are lists of token lists (or 2-D tensors) of the same rows."""
    rows_a = a.tolist() if isinstance(a, torch.Tensor) else a
    rows_b = b.tolist() if isinstance(b, torch.Tensor) else b
    if len(rows_a) != len(rows_b) or not rows_a:
        raise ValueError(f"token_agreement: need the same non-zero number of rows, got {len(rows_a)} and {len(rows_b)}")

    def prefix(x, y) -> float:
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        return n / max(len(x), 1)

    return statistics.mean(prefix(x, y) for x, y in zip(rows_a, rows_b))


class head_screen_off:
    """Context manager: ``model``'s int8 greedy head screens (``qkv.cpu.greedy.HeadScreen`` in ``head_screen``) set
    aside for the block, so its greedy tokens come from the whole head multiplied in the model's dtype (the
    control row of a suite whose qkv side screens its head); the same screens, already built, go back after."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.held: list[tuple[torch.nn.Module, Any]] = []

    def __enter__(self) -> torch.nn.Module:
        for m in self.model.modules():
            if getattr(m, "head_screen", None) is not None:
                self.held.append((m, m.head_screen))
                m.head_screen = None
        return self.model

    def __exit__(self, *exc) -> None:
        for m, screen in self.held:
            m.head_screen = screen
        self.held.clear()
