"""``qkv memory``, ``qkv flops`` and ``qkv compare``: KV-cache and attention-FLOP arithmetic from presets.

All numbers come from :mod:`qkv.costs`; this module only parses, prints and plots (matplotlib is
imported lazily, drawing on an Agg canvas without pyplot).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from qkv.config.config_file import read_json_config
from qkv.config.hf_config import description_dtype
from qkv.costs import (
    DEVICE_GB,
    GB,
    KVMemory,
    ModelPreset,
    format_bytes,
    format_flops,
    get_preset,
    kv_cache_memory,
    model_attention_flops,
    parse_context,
)

__all__ = ["register", "plot_figure", "compare_figure", "context_axis_end", "context_warning", "load_preset",
           "unique_names"]

_PRESET_HELP = "A preset name (llama-3-70b, gemma-3-27b, deepseek-v2, ...) or the path of a HF config.json."
_Context = Annotated[
    str, typer.Option("--context", "-c", help="Tokens per sequence: 131072, 128k (=131,072), 1M, 128000.")
]
_Batch = Annotated[int, typer.Option("--batch", "-b", min=1, help="Sequences in the batch.")]
_Dtype = Annotated[str | None, typer.Option(
    "--dtype", show_default=False,
    help="Cache dtype: fp32 fp16 bf16 fp8 int8 int4 int2. Default: the dtype a config.json declares (its dtype or "
    "torch_dtype), else bf16 (presets: the dtype published checkpoints ship in); the rule of qkv.cache.plan_memory.")]
_Group = Annotated[
    int | None,
    typer.Option("--group-size", min=1, help="int dtypes: count an fp16 scale and zero-point per group."),
]
_Json = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")]


def _one_dtype(models: Sequence[str]) -> str:
    """The default cache dtype of several models (:func:`qkv.config.hf_config.description_dtype`); a
    ``ValueError`` asking for ``--dtype`` when their configs declare different ones."""
    dtypes = {m: description_dtype(m) for m in models}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{m}: {d}" for m, d in dtypes.items())
        raise ValueError(f"the models declare different dtypes ({listed}); pass --dtype to compare them in one")
    return next(iter(dtypes.values()), "bf16")


@contextmanager
def _friendly() -> Iterator[None]:
    """Turn bad input into one line on stderr and exit code 2, never a traceback."""
    try:
        yield
    except (ValueError, OSError, OverflowError, MemoryError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None


#: Bounds on a config file's sizes: far above every released model, low enough that the arithmetic stays instant.
MAX_LAYERS = 10_000
MAX_SIZE = 10**9


def _config_name(path: str) -> str:
    """The name a config file goes by: its ``_name_or_path`` when set, else the file's name (``config.json`` in
    a model folder: the folder's)."""
    if not os.path.exists(path):
        raise ValueError(f"{path!r} does not exist; give a preset name or the path of a HF config.json")
    if os.path.isdir(path):  # a model folder, as the Python API takes it
        inner = os.path.join(path, "config.json")
        if not os.path.isfile(inner):
            raise ValueError(f"{path!r} is a folder without a config.json; give a model folder holding one, the "
                             "path of a HF config.json or a preset name")
        path = inner
    cfg = read_json_config(path)
    _check_sizes(path, cfg)
    given = cfg.get("_name_or_path")
    if isinstance(given, str) and given.strip():
        return given.strip()
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem == "config":
        stem = os.path.basename(os.path.dirname(os.path.abspath(path))) or stem
    return stem


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "n_layers")


def _check_sizes(path: str, cfg: dict) -> None:
    """Refuse absurd sizes before anything is built from them (a layer list of 10^9 entries would not finish)."""
    stack = [cfg]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, (dict, list)):
                stack.append(value)
            elif isinstance(value, int) and not isinstance(value, bool):
                limit = MAX_LAYERS if key in _LAYER_KEYS else MAX_SIZE
                if abs(value) > limit:
                    shown = f"{value:,}" if value.bit_length() < 200 else f"an integer of {len(str(value))} digits"
                    raise ValueError(f"{path!r}: {key} = {shown} is beyond any released model (the CLI takes at most "
                                     f"{limit:,}); check the config")


def load_preset(name_or_path: str) -> ModelPreset:
    """A preset by name, or read from a HF config file and named after it (see :func:`_config_name`), with its
    sizes bounded (``MAX_LAYERS`` layers, ``MAX_SIZE`` for every other integer) so a wrong file fails fast."""
    if not os.path.exists(name_or_path):
        return get_preset(name_or_path)
    name = _config_name(name_or_path)
    preset = get_preset(name_or_path)
    return dataclasses.replace(preset, config=preset.config.replace(name=name))


def unique_names(models: Sequence[ModelPreset]) -> list[str]:
    """Row labels: each model's name, with `` (2)``, `` (3)``... after repeats, so no row is ever dropped."""
    seen: dict[str, int] = {}
    out = []
    for p in models:
        seen[p.name] = seen.get(p.name, 0) + 1
        out.append(p.name if seen[p.name] == 1 else f"{p.name} ({seen[p.name]})")
    return out


def _describe(p: ModelPreset) -> str:
    c, lat, idx = p.config, p.config.latent, p.config.indexer
    if lat is not None:
        heads = f"{c.num_attention_heads} heads, latent {lat.kv_lora_rank} + rope key {lat.qk_rope_head_dim}"
        if idx is not None:
            heads += f" + indexer key {idx.index_head_dim} (DSA: {idx.index_topk} of the cached tokens per query)"
    else:
        heads = f"{c.num_attention_heads} query heads, {c.num_key_value_heads} KV heads x {p.key_head_dim}"
    layers = ", ".join(f"{n} {kind}" for kind, n in p.layer_counts.items())
    window = f", window {c.sliding_window:,}" if "local" in p.layer_counts else ""
    return f"{p.name} [{p.attention_kind.upper()}]: {c.num_hidden_layers} layers ({layers}{window}), {heads}"


def context_warning(p: ModelPreset, context: int) -> str | None:
    """The one-line warning for a context past the model's ``max_position_embeddings``, or None.

    Example:
        >>> from qkv.costs import PRESETS
        >>> print(context_warning(PRESETS["llama-3-8b"], 32768))
        warning: llama-3-8b: context 32,768 tokens exceeds its max_position_embeddings 8,192; ...
        >>> context_warning(PRESETS["llama-3-8b"], 8192) is None
        True
    """
    limit = p.context_limit
    if limit is None or context <= limit:
        return None
    return (f"warning: {p.name}: context {context:,} tokens exceeds its max_position_embeddings {limit:,}; "
            "the numbers are arithmetic for a length the model was not configured for")


def _warn_context(p: ModelPreset, context: int) -> None:
    line = context_warning(p, context)
    if line is not None:
        typer.echo(line, err=True)


def _fits(m: KVMemory) -> str:
    return "  ".join(f"{g} GB {'yes' if ok else 'no'}" for g, ok in m.fits.items())


def memory(
    preset: Annotated[str, typer.Argument(help=_PRESET_HELP, show_default=False)],
    context: _Context = "128k",
    batch: _Batch = 1,
    dtype: _Dtype = None,
    group_size: _Group = None,
    as_json: _Json = False,
) -> None:
    """KV-cache size of a model: bytes per token, total, per layer kind, and whether it fits in 24/80/141 GB.

    GB are 1e9 bytes (GiB, 2**30, shown beside). Only the cache is counted, not weights or activations.

    Examples:

        qkv memory llama-3-70b --context 128k

        qkv memory llama-70b-mha --context 128000 --dtype fp16

        qkv memory gemma-3-27b --dtype int4 --group-size 64 --json

        qkv memory ./my-model/config.json --batch 8
    """
    with _friendly():
        p = load_preset(preset)
        dtype = dtype or description_dtype(preset)
        kw = dict(context=parse_context(context), batch=batch, dtype=dtype, group_size=group_size)
        m = kv_cache_memory(p, **kw)
        _warn_context(p, m.context)
        mha = kv_cache_memory(p.mha_equivalent(), **kw) if p.attention_kind != "mha" else None
    if as_json:
        out = {**m.as_dict(), "attention_kind": p.attention_kind}
        out["mha_equivalent_total_bytes"] = mha.total_bytes if mha else m.total_bytes
        typer.echo(json.dumps(out, indent=2))
        return
    console = Console(soft_wrap=True)
    console.print(_describe(p))
    console.print(
        f"context {m.context:,} tokens, batch {m.batch}, {m.dtype} ({m.bytes_per_element:g} bytes/element)"
    )
    table = Table("kind", "layers", "cached tokens", "per token, layer", "per layer", "total")
    for g in m.layers:
        table.add_row(
            g.kind, str(g.num_layers), "fixed state" if g.kind == "recurrent" else f"{g.tokens:,}",
            format_bytes(g.bytes_per_token), format_bytes(g.bytes_per_layer), format_bytes(g.total_bytes),
        )
    console.print(table)
    if "recurrent" in m.by_layer_type:
        console.print("recurrent layers keep a fixed state per sequence (convolution inputs and a float32 (Dk, Dv) "
                      "state per head): the same bytes at any context")
    console.print(f"per token (all layers): {format_bytes(m.bytes_per_token)} ({m.bytes_per_token:,.0f} B)")
    console.print(
        f"total: {format_bytes(m.total_bytes)} = {format_bytes(m.total_bytes, binary=True)} "
        f"({m.total_bytes:,} B)"
    )
    console.print(f"fits (KV cache only, GB = 1e9 B): {_fits(m)}")
    if mha:
        ratio = mha.total_bytes / m.total_bytes
        console.print(f"MHA-equivalent: {format_bytes(mha.total_bytes)} ({ratio:.1f}x this cache)")


def flops(
    preset: Annotated[str, typer.Argument(help=_PRESET_HELP, show_default=False)],
    context: _Context = "128k",
    batch: _Batch = 1,
    as_json: _Json = False,
) -> None:
    """FLOPs of a model at a context: attention (QK^T and PV) beside the rest, and the crossover length.

    Prefill is the forward pass over a causal prompt of CONTEXT tokens (4*B*H*N*N*D, halved for
    causal); decode is one new token against CONTEXT cached tokens; training is the forward and backward
    passes, 3.5x forward for attention (FlashAttention-2's count) and 3x for the matmuls. Local layers see at
    most their window. For presets with the whole-model shape (`qkv presets` lists them) the table adds
    the projections, feed-forward (active experts) and LM head, and the crossover: the shortest context
    at which attention's FLOPs reach the rest's. Models with DeepSeek Sparse Attention (deepseek-v3.2) add the
    indexer and MLA over the selected latents against dense MLA (both in the latent space), and the context
    from which DSA needs fewer FLOPs.

    Examples:

        qkv flops llama-3-8b --context 8k

        qkv flops gpt-3-175b --context 128k

        qkv flops deepseek-v2 --context 128k --json

        qkv flops deepseek-v3.2 --context 128k
    """
    from qkv.costs import crossover_context, dsa_model_flops, model_flops, score_elements

    with _friendly():
        p = load_preset(preset)
        n = parse_context(context)
        _warn_context(p, n)
        f = model_attention_flops(p, context=n, batch=batch)
        whole = p.whole_model
        m = model_flops(p, context=n, batch=batch) if whole else None
        cross = crossover_context(p) if whole else None
        dsa = dsa_model_flops(p, context=n, batch=batch) if p.config.indexer is not None else None
    scores = score_elements(n)
    if as_json:
        out = {**f._asdict(), "prefill_per_token": f.prefill / f.context, "score_elements_per_head": scores}
        if m is not None:
            for name in ("prefill", "decode", "training"):
                b = getattr(m, name)
                out[f"{name}_breakdown"] = {**b._asdict(), "rest": b.rest, "total": b.total}
            out["crossover_context"] = cross
        if dsa is not None:
            out["dsa"] = {"index_topk": dsa.index_topk, "prefill": dsa.prefill._asdict(),
                          "decode": dsa.decode._asdict(), "crossover_prefill": dsa.crossover_prefill,
                          "crossover_decode": dsa.crossover_decode}
        typer.echo(json.dumps(out, indent=2))
        return
    console = Console(soft_wrap=True)
    console.print(_describe(p))
    console.print(f"context {f.context:,} tokens, batch {f.batch}; one score matrix holds N^2 = {scores:,} "
                  "elements per head and sequence")
    if m is None:
        table = Table("pass", "attention FLOPs", "exact count")
        rows = [
            ("prefill (causal prompt)", f.prefill),
            ("prefill, per prompt token", f.prefill / f.context),
            ("decode, per new token", f.decode),
            ("training (fwd + bwd)", f.training),
        ]
        if f.decode_absorbed is not None:
            rows.append(("decode, MLA absorbed", f.decode_absorbed))
        for name, value in rows:
            table.add_row(name, format_flops(value), f"{value:.4g}")
        console.print(table)
        console.print("(attention only: this preset has no vocab_size/intermediate_size for the rest)")
        _print_dsa(console, dsa)
        return
    table = Table("pass", "attention", "projections", "FFN", "LM head", "total", "attention share")
    for name, b in (("prefill (causal prompt)", m.prefill), ("decode, per new token", m.decode),
                    ("training (fwd + bwd)", m.training)):
        table.add_row(name, format_flops(b.attention), format_flops(b.projections), format_flops(b.ffn),
                      format_flops(b.lm_head), format_flops(b.total), f"{100 * b.attention_share:.1f}%")
    console.print(table)
    if f.decode_absorbed is not None:
        console.print(f"decode attention with MLA absorbed: {format_flops(f.decode_absorbed)}")
    if cross is None:
        console.print("crossover: attention never reaches the rest (every layer slides over a short window)")
    else:
        side = "past" if n >= cross else "below"
        console.print(f"crossover: attention reaches the rest from {cross:,} tokens on ({side} it at {n:,})")
    _print_dsa(console, dsa)


def _print_dsa(console: Console, dsa) -> None:
    """DeepSeek Sparse Attention beside dense MLA (nothing for other models)."""
    if dsa is None:
        return
    console.print(f"DeepSeek Sparse Attention: each query reads {dsa.index_topk:,} latents; the table above counts "
                  "attention as dense MLA. All layers, MLA in the latent space (absorbed), as DSA's kernels run it:")
    table = Table("pass", "indexer", "sparse MLA", "DSA total", "dense MLA", "DSA / dense")
    for name, f in (("prefill (causal prompt)", dsa.prefill), ("decode, per new token", dsa.decode)):
        table.add_row(name, format_flops(f.indexer), format_flops(f.selected), format_flops(f.sparse),
                      format_flops(f.dense), f"{f.sparse / f.dense:.3g}x")
    console.print(table)
    for name, at in (("prefill", dsa.crossover_prefill), ("decode", dsa.crossover_decode)):
        if at is None:
            console.print(f"DSA {name}: never fewer FLOPs than dense MLA (the indexer costs as much per pair)")
        else:
            side = "past" if dsa.context >= at else "below"
            console.print(f"DSA {name}: fewer FLOPs than dense MLA from {at:,} tokens on ({side} it at "
                          f"{dsa.context:,})")


def context_axis_end(models: Sequence[ModelPreset], context: int) -> int:
    """Where the x axis of ``qkv compare --plot`` ends: the largest of the requested ``context`` and the
    compared models' ``max_position_embeddings`` (models that state none do not count), so the longest
    context any model was configured for, and the one the user asked for, are both on the plot.

    Example:
        >>> from qkv.costs import PRESETS
        >>> context_axis_end([PRESETS["llama-3-8b"], PRESETS["deepseek-v2"]], 4096)
        163840
    """
    return max([context, *(p.context_limit for p in models if p.context_limit)])


def _context_grid(start: int, end: int) -> list[int]:
    """Contexts from ``start`` to ``end`` (both included), 8 per octave, for smooth log-axis curves."""
    octaves = math.log2(end / start)
    steps = max(1, math.ceil(8 * octaves))
    grid = sorted({round(start * 2 ** (octaves * i / steps)) for i in range(steps + 1)})
    grid[-1] = end
    return grid


def compare_figure(models: Sequence[ModelPreset], context: int, *, batch: int = 1, dtype: str = "bf16",
                   group_size: int | None = None):
    """The figure of ``qkv compare --plot``: each model's KV cache against context.

    The x axis runs from ``min(1024, context, end / 16)`` to ``end``, :func:`context_axis_end`. Each
    model's curve stops at its own ``max_position_embeddings`` (or at ``context`` when the user asked
    for more), so a curve never claims a length its model was not configured for unasked.
    """
    end = context_axis_end(models, context)
    start = max(1, min(1024, context, end // 16))
    grid = _context_grid(start, end)
    curves = {}
    for p in models:
        last = max(p.context_limit or end, context)
        points = sorted({c for c in grid if c < last} | {context, last})
        curves[p.name] = [kv_cache_memory(p, context=c, batch=batch, dtype=dtype, group_size=group_size)
                          for c in points]
    return plot_figure(curves, context, x_range=(start, end))


def plot_figure(memories: Mapping[str, list[KVMemory]], context: int, *, x_range: tuple[int, int] | None = None):
    """A KV-cache-vs-context figure (a matplotlib ``Figure``) from precomputed curves.

    ``x_range`` fixes the x axis (default: from the first point drawn to the larger of the last point
    drawn and ``context``).
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    # Models with the same cache per token draw the same line: distinct styles and sparse markers keep each visible.
    styles = ("-", "--", "-.", ":")
    markers = ("o", "s", "^", "D", "v", "P", "X", "*")
    for i, (name, ms) in enumerate(memories.items()):
        ax.plot([m.context for m in ms], [m.total_bytes / GB for m in ms], label=name,
                linestyle=styles[i % len(styles)], marker=markers[i % len(markers)], markevery=(i % 8, 8),
                markersize=4, linewidth=1.5 + 0.5 * (i % 2))
    if x_range is None:
        x_range = (min(ms[0].context for ms in memories.values()),
                   max(context, *(ms[-1].context for ms in memories.values())))
    for g in DEVICE_GB:
        ax.axhline(g, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{g} GB", (x_range[0], g), xytext=(2, 2), textcoords="offset points", fontsize=8)
    ax.axvline(context, color="black", linestyle=(0, (6, 3)), linewidth=1, label=f"context {context:,} tokens")
    ax.set_xscale("log", base=2)
    if x_range[0] < x_range[1]:
        ax.set_xlim(*x_range)
    ax.set_yscale("log")
    tokens = FuncFormatter(lambda x, _: f"{x:g}" if x < 1024 else f"{x / 1024:g}k" if x < 2**20 else f"{x / 2**20:g}M")
    ax.xaxis.set_major_formatter(tokens)
    first = next(iter(memories.values()))[0]
    ax.set(xlabel="context (tokens, k = 1024)", ylabel="KV cache (GB = 1e9 bytes)",
           title=f"KV cache vs context: batch {first.batch}, {first.dtype}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def compare(
    presets: Annotated[list[str], typer.Argument(help="Presets or config.json paths.", show_default=False)],
    context: _Context = "128k",
    batch: _Batch = 1,
    dtype: _Dtype = None,
    group_size: _Group = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Write a PNG of KV cache vs context (log axes, up to the longest context of "
                     "the models or --context)."),
    ] = None,
    as_json: _Json = False,
) -> None:
    """Compare KV caches side by side at one context, optionally plotting them against context.

    Examples:

        qkv compare llama-70b-mha llama-3-70b deepseek-v2 gemma-3-27b

        qkv compare llama-3-8b mistral-7b-v0.1 --context 32k --dtype fp8 --plot kv.png
    """
    with _friendly():
        dtype = dtype or _one_dtype(presets)
        kw = dict(batch=batch, dtype=dtype, group_size=group_size)
        loaded = [load_preset(name) for name in presets]
        models = dict(zip(unique_names(loaded), loaded, strict=True))
        n = parse_context(context)
        ms = {name: kv_cache_memory(p, context=n, **kw) for name, p in models.items()}
        models = {name: dataclasses.replace(p, config=p.config.replace(name=name)) for name, p in models.items()}
        for p in models.values():
            _warn_context(p, n)
        if plot is not None:
            try:
                fig = compare_figure(list(models.values()), n, **kw)
            except ImportError as e:
                raise ValueError(f"--plot needs matplotlib ({e}); install it with pip install 'qkv[plot]', or "
                                 "drop --plot") from None
            fig.savefig(plot, dpi=120)
    if as_json:
        typer.echo(json.dumps([{**m.as_dict(), "preset": name, "attention_kind": models[name].attention_kind}
                               for name, m in ms.items()], indent=2))
        return
    console = Console(soft_wrap=True)
    console.print(f"context {n:,} tokens, batch {batch}, {dtype}; GB = 1e9 B, KV cache only")
    hybrid = any("recurrent" in m.by_layer_type for m in ms.values())
    table = Table("preset", "kind", "per token", *(("fixed state",) if hybrid else ()), "total", "fits in")
    table.columns[0].no_wrap = True
    for name, m in ms.items():
        p = models[name]
        local = "".join(f" +{p.layer_counts[k]} {k}" for k in ("local", "recurrent") if k in p.layer_counts)
        fits = ", ".join(str(g) for g, ok in m.fits.items() if ok)
        state = (format_bytes(m.by_layer_type.get("recurrent", 0)),) if hybrid else ()
        table.add_row(
            name, p.attention_kind.upper() + local, format_bytes(m.bytes_per_token), *state,
            format_bytes(m.total_bytes), f"{fits} GB" if fits else "none",
        )
    console.print(table)
    if hybrid:
        console.print("fixed state: the recurrent layers' state, the same at any context (per token counts the "
                      "attention layers only)")
    if plot is not None:
        console.print(f"plot written to {plot}")


def register(app: typer.Typer) -> None:
    """Add ``memory``, ``flops`` and ``compare`` to ``app``."""
    app.command("memory")(memory)
    app.command("flops")(flops)
    app.command("compare")(compare)
