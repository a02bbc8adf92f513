"""``qkv bench``: run the benchmark suites in ``benchmarks/`` by name and gather their results.

Each suite is a script that measures qkv against a peer in one process and writes JSON with the full
context (see ``benchmarks/_harness.py``). This command runs the chosen suites one after another (so
they do not compete for the CPU), shows progress, and writes a combined Markdown table and one PNG
plot per suite next to the JSON, under ``./qkv-bench`` of the directory it is run from (or ``--out``),
never into the source tree. ``make bench`` passes ``--out benchmarks/results`` and renders
``benchmarks/RESULTS.md`` from there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import typer

__all__ = ["register", "SUITES", "find_benchmarks", "summarize", "plot_suite"]

#: Suite name -> script in benchmarks/ (the order ``qkv bench`` runs them in).
SUITES: dict[str, str] = {
    "dense": "dense.py",
    "tiled": "tiled.py",
    "sparse": "sparse.py",
    "sparse_select": "sparse_select.py",
    "linear": "linear.py",
    "gated_linear": "gated_linear.py",
    "mla": "mla.py",
    "decode": "decode.py",
    "embed": "embed.py",
    "generate": "generate.py",
    "skinny": "skinny.py",
    "varlen": "varlen.py",
    "context_parallel": "context_parallel.py",
    "head_pruning": "head_pruning.py",
    "interpret": "interpret.py",
    "gpu": "gpu.py",  # CUDA only: on a machine without one it prints why and writes nothing
    "gqa_conversion": "gqa_conversion.py",
    "quality": "quality.py",
    "mask_export": "mask_export.py",
    "batch_invariant": "batch_invariant.py",
    "engine": "engine.py",
    "compressed": "compressed.py",
    "weights": "weights.py",
    "busy": "busy.py",
}


def find_benchmarks(start: Path | None = None) -> Path:
    """The repository's ``benchmarks/`` folder: next to the installed source tree, else above ``start``."""
    import qkv

    candidates = [Path(qkv.__file__).resolve().parents[2] / "benchmarks"]
    here = (start or Path.cwd()).resolve()
    candidates += [p / "benchmarks" for p in (here, *here.parents)]
    for c in candidates:
        if (c / "_harness.py").is_file():
            return c
    raise FileNotFoundError("qkv bench: no benchmarks/ folder found (it ships with the repository, not the wheel); "
                            "run from a clone of qkv")


def summarize(results: list[dict]) -> str:
    """One Markdown document with a table per suite (from the suites' JSON payloads)."""
    parts = ["# qkv benchmark results", ""]
    for r in results:
        rows = r.get("rows", [])
        parts.append(f"## {r['suite']}: {r.get('description', '')}")
        parts.append("")
        if rows:
            cols = list(dict.fromkeys(c for row in rows for c in row))
            parts.append("| " + " | ".join(cols) + " |")
            parts.append("|" + "---|" * len(cols))
            for row in rows:
                parts.append("| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |")
        ctx = r.get("context", {})
        parts += ["", "Context: " + ", ".join(f"{k}={v}" for k, v in ctx.items()), ""]
        parts += [n for n in r.get("notes", [])] + [""]
    return "\n".join(parts)


def _fmt(v) -> str:
    if isinstance(v, dict) and "median" in v:  # a ratio's spread over the repeats
        return f"{_fmt(v['median'])} [{_fmt(v['min'])}, {_fmt(v['max'])}]"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def plot_suite(result: dict, path: Path) -> Path | None:
    """A grouped bar chart of every ``*_ms`` column per case row (log scale), or None if nothing to plot."""
    rows = result.get("rows", [])
    time_cols = [c for c in dict.fromkeys(c for r in rows for c in r) if c.endswith("_ms")]
    if not rows or not time_cols:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    case_cols = [c for c in rows[0] if not isinstance(rows[0][c], float) and c not in time_cols][:4]
    labels = [" ".join(f"{c}={r.get(c)}" for c in case_cols) for r in rows]
    fig = Figure(figsize=(max(6, 1.2 * len(rows)), 4.5))
    ax = fig.add_subplot()
    width = 0.8 / len(time_cols)
    for i, c in enumerate(time_cols):
        vals = [r.get(c) if isinstance(r.get(c), (int, float)) else 0 for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], vals, width, label=c)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_title(f"{result['suite']}: {result.get('description', '')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def run_suites(names: list[str], *, quick: bool, out: Path, bench_dir: Path) -> list[dict]:
    from rich.progress import Progress

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "QKV_BENCH_OUT": str(out.resolve())}
    results, failed = [], []
    with Progress() as progress:
        task = progress.add_task("benchmarks", total=len(names))
        for name in names:
            progress.update(task, description=f"running {name}")
            cmd = [sys.executable, str(bench_dir / SUITES[name])] + (["--quick"] if quick else [])
            t0, started = time.perf_counter(), time.time() - 1
            proc = subprocess.run(cmd, cwd=bench_dir.parent, env=env, capture_output=True, text=True)
            progress.console.print(proc.stdout[-4000:])
            if proc.returncode != 0:
                failed.append(name)
                progress.console.print(f"[red]{name} failed ({proc.returncode}):[/]\n{proc.stderr[-2000:]}")
            else:
                # A suite writes <name>.json or several <name>_<part>.json tables during this run.
                written = sorted(p for p in out.glob(f"{name}*.json") if p.stat().st_mtime >= started)
                if not written:
                    failed.append(name)
                    progress.console.print(f"[red]{name} wrote no JSON into {out}[/]")
                for path in written:
                    payload = json.loads(path.read_text())
                    payload["wall_s"] = round(time.perf_counter() - t0, 1)  # the whole script, all its tables
                    path.write_text(json.dumps(payload, indent=2, default=str))
                    results.append(payload)
                    png = plot_suite(payload, path.with_name(f"{path.stem}_times.png"))
                    if png:
                        progress.console.print(f"plot: {png}")
            progress.advance(task)
    (out / "summary.md").write_text(summarize(results))
    if failed:
        raise RuntimeError(f"suites failed: {', '.join(failed)}")
    return results


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        suites: list[str] = typer.Argument(None, help=f"suites to run (default: all): {', '.join(SUITES)}"),
        quick: bool = typer.Option(False, "--quick", help="small sizes and few repeats (a smoke run)"),
        out: Path = typer.Option(Path("qkv-bench"), help="output folder (default: ./qkv-bench)"),
    ) -> None:
        """Run benchmark suites and write JSON, a Markdown summary and PNG plots.

        Examples:

            qkv bench                 # every suite

            qkv bench dense sparse    # two suites

            qkv bench --quick linear  # a smoke run
        """
        names = suites or list(SUITES)
        unknown = [n for n in names if n not in SUITES]
        if unknown:
            typer.echo(f"qkv bench: unknown suite(s) {unknown}; known: {', '.join(SUITES)}", err=True)
            raise typer.Exit(2)
        try:
            bench_dir = find_benchmarks()
        except FileNotFoundError as e:
            typer.echo(str(e), err=True)
            raise typer.Exit(2) from None
        missing = [n for n in names if not (bench_dir / SUITES[n]).is_file()]
        if missing:
            typer.echo(f"qkv bench: suite script(s) missing in {bench_dir}: {missing}", err=True)
            raise typer.Exit(2)
        try:
            run_suites(names, quick=quick, out=out.resolve(), bench_dir=bench_dir)
        except RuntimeError as e:
            typer.echo(f"qkv bench: {e}", err=True)
            raise typer.Exit(1) from None
