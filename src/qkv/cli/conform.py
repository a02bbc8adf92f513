"""``qkv conform``: run the conformance battery (:mod:`qkv.conformance`) on a named kernel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register", "conform"]


def conform(
    names: Annotated[list[str], typer.Argument(help="Adapter names: sdpa, flex, hf-eager, hf-sdpa, reference, "
                                                    "tiled, qkv-sdpa, qkv-flex, triton, tiled-invariant, varlen, "
                                                    "fa2, fa3, fa4, fa2-varlen, flashinfer, flashinfer-ragged.")],
    device: Annotated[str, typer.Option(help="Device for the inputs.")] = "cpu",
    dtypes: Annotated[str, typer.Option(help="Comma-separated dtypes for the dtype check.")] = "float32",
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the reports as JSON here.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of every input.")] = 0,
) -> None:
    """Check attention kernels against qkv's contract: lse base and layout, fully masked rows, causal and
    window alignment, GQA mapping, softcap order, sinks, empty keys, dtypes, determinism, batch invariance.

    Examples:

        qkv conform sdpa hf-eager

        qkv conform tiled --dtypes float32,bfloat16 --json conformance.json
    """
    import torch

    from qkv import conformance
    from qkv.conformance import adapters

    bad = [n for n in names if n not in adapters.ADAPTERS]
    if bad:
        raise typer.BadParameter(f"unknown kernel(s) {', '.join(bad)}; valid: {', '.join(adapters.ADAPTERS)}")
    try:
        dts = [getattr(torch, d.strip()) for d in dtypes.split(",")]
        if not all(isinstance(d, torch.dtype) for d in dts):
            raise AttributeError
    except AttributeError:
        raise typer.BadParameter(f"--dtypes: {dtypes!r} is not a list of torch dtypes (e.g. float32)") from None
    reports = []
    for name in names:
        try:
            report = conformance.check(name, device=device, dtypes=dts, seed=seed)
        except ImportError as e:
            typer.echo(f"{name}: skipped ({e})")
            continue
        except ValueError as e:  # a device this torch cannot reach, ...: one line, exit code 2
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=2) from None
        reports.append(report)
        typer.echo(report.table())
        typer.echo("")
    if json_out is not None:
        json_out.write_text(json.dumps([r.to_dict() for r in reports], indent=1) + "\n")
        typer.echo(f"wrote {json_out}")


def register(app: typer.Typer) -> None:
    app.command("conform")(conform)
