"""``qkv plan-cp``: the longest training context that fits on W devices under context parallelism, and its step
time, from :mod:`qkv.costs.context_parallel` (pure arithmetic; this module parses and prints)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from qkv.cli.costs import load_preset, unique_names
from qkv.costs.context_parallel import H200, PARAMETERS, SCHEMES, plan

__all__ = ["register"]


def plan_cp(
    models: Annotated[list[str] | None, typer.Argument(
        help=f"Presets ({sorted(PARAMETERS)} by default) or HF config.json paths; a preset without a stated "
             f"parameter count is counted from its config (qkv.costs.num_parameters).", show_default=False)] = None,
    scheme: Annotated[str, typer.Option("--scheme", help=f"One of {', '.join(SCHEMES)}.")] = "zigzag",
    max_world: Annotated[int, typer.Option("--max-world", min=1, help="Largest W (powers of two up to it).")] = 1024,
    memory_gb: Annotated[float, typer.Option("--memory-gb", min=1, help="Device memory, GB (1e9 bytes).")] = 141.0,
    hbm_tbps: Annotated[float, typer.Option("--hbm-tbps", min=0.001, help="HBM bandwidth, TB/s.")] = 4.8,
    link_gbps: Annotated[float, typer.Option("--link-gbps", min=0.001, help="Link bandwidth per direction, GB/s.")]
    = 450.0,
    tflops: Annotated[float, typer.Option("--tflops", min=0.001, help="Sustained attention TFLOP/s per device.")]
    = H200.attention_flops_per_s / 1e12,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")] = False,
) -> None:
    """Longest context that fits for training on W=1,2,4,... devices, and the step time there.

    Defaults: H200 (141 GB, 4.8 TB/s, 450 GB/s links). Memory: ZeRO-3 sharded training state (16 bytes per
    parameter, divided among the W devices) and checkpointed activations of the local tokens; see
    qkv.costs.context_parallel.

    Examples:

        qkv plan-cp

        qkv plan-cp llama-3-70b --scheme ring --max-world 256

        qkv plan-cp deepseek-v2 --memory-gb 80 --link-gbps 200 --json
    """
    if scheme not in SCHEMES:
        typer.echo(f"error: --scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}", err=True)
        raise typer.Exit(code=2)
    for flag, value in (("--memory-gb", memory_gb), ("--hbm-tbps", hbm_tbps), ("--link-gbps", link_gbps),
                        ("--tflops", tflops)):
        if not math.isfinite(value):
            typer.echo(f"error: {flag} must be a finite number, got {value}", err=True)
            raise typer.Exit(code=2)
    device = dataclasses.replace(H200, name="custom", memory_bytes=memory_gb * 1e9, hbm_bytes_per_s=hbm_tbps * 1e12,
                                 link_bytes_per_s=link_gbps * 1e9, attention_flops_per_s=tflops * 1e12)
    out = {}
    try:
        presets = [load_preset(name) for name in models or sorted(PARAMETERS)]
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    for name, preset in zip(unique_names(presets), presets, strict=True):
        try:
            rows = plan(preset, device=device, scheme=scheme, max_world=max_world)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=2) from None
        out[name] = [dict(world=r.world, context=r.context, step_s=r.step_s,
                          attention_layer_s=r.layer.total_s if r.layer else None,
                          comm_layer_s=r.layer.comm_s if r.layer else None,
                          bytes_sent_per_rank_layer=r.layer.bytes_sent if r.layer else None) for r in rows]
    if as_json:
        typer.echo(json.dumps(dict(device=dataclasses.asdict(device), scheme=scheme, models=out), indent=2))
        return
    console = Console(soft_wrap=True)
    console.print(f"{scheme} on {memory_gb:g} GB devices, {hbm_tbps:g} TB/s HBM, {link_gbps:g} GB/s links, "
                  f"{tflops:g} TFLOP/s attention; training, bf16, causal")
    for name, rows in out.items():
        table = Table("W", "longest context", "step time", "attention / layer", "comm / layer", "sent / rank, layer",
                      title=name)
        for r in rows:
            if not r["context"]:
                table.add_row(str(r["world"]), "does not fit", "-", "-", "-", "-")
                continue
            table.add_row(str(r["world"]), f"{r['context']:,}", f"{r['step_s']:,.1f} s",
                          f"{r['attention_layer_s']:.3g} s", f"{r['comm_layer_s']:.3g} s",
                          f"{r['bytes_sent_per_rank_layer'] / 1e9:.3g} GB")
        console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``plan-cp`` to ``app``."""
    app.command("plan-cp")(plan_cp)
