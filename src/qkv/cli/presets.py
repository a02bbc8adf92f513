"""``qkv presets``: the model presets of :mod:`qkv.costs`, their shapes, parameter counts and sources."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from qkv.costs import AMBIGUOUS, PRESETS, num_parameters

__all__ = ["register", "presets"]


def _params(p) -> int | None:
    try:
        return num_parameters(p).total
    except ValueError:
        return None


def presets(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")] = False,
    sources: Annotated[bool, typer.Option("--sources", help="Add each preset's source and notes.")] = False,
) -> None:
    """List the model presets that `qkv memory`, `qkv flops` and `qkv compare` accept.

    Each names its version where versions differ (mistral-7b-v0.1 slides over 4096 tokens, v0.3 does
    not) and cites its source.

    Examples:

        qkv presets

        qkv presets --sources

        qkv presets --json
    """
    if as_json:
        rows = []
        for p in PRESETS.values():
            c = p.config
            rows.append({"name": p.name, "attention_kind": p.attention_kind, "layers": c.num_hidden_layers,
                         "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": p.key_head_dim,
                         "hidden_size": c.hidden_size, "sliding_window": c.sliding_window,
                         "max_position_embeddings": p.context_limit,
                         "layer_counts": p.layer_counts, "parameters": _params(p), "source": p.source,
                         "notes": p.notes})
        typer.echo(json.dumps({"presets": rows, "ambiguous": {k: list(v) for k, v in AMBIGUOUS.items()}}, indent=2))
        return
    console = Console(soft_wrap=True)
    table = Table("preset", "kind", "layers", "heads (KV)", "head dim", "d", "window", "max context", "parameters")
    if sources:
        table.add_column("source")
    for p in PRESETS.values():
        n, c = _params(p), p.config
        row = [p.name, p.attention_kind.upper(), str(c.num_hidden_layers),
               f"{c.num_attention_heads} ({c.num_key_value_heads})", str(p.key_head_dim), str(c.hidden_size),
               f"{c.sliding_window:,}" if c.sliding_window else "-",
               f"{p.context_limit:,}" if p.context_limit else "-", f"{n / 1e9:.2f}B" if n else "-"]
        if sources:
            row.append(p.source)
        table.add_row(*row)
    # never cut a cell (names are what users copy): in a pipe or a narrow terminal the table keeps its natural width
    width = max(console.width, console.measure(table, options=console.options.update(width=10_000)).maximum)
    Console(soft_wrap=True, width=width).print(table)
    for name, versions in AMBIGUOUS.items():
        console.print(f"{name}: pick a version, {', '.join(versions)}")


def register(app: typer.Typer) -> None:
    """Add ``presets`` to ``app``."""
    app.command("presets")(presets)
