"""The ``qkv`` command line. Each command group lives in its own module with a ``register(app)``.

Run ``qkv --help`` for the list; every command has ``--help`` with examples.
"""

from __future__ import annotations

import importlib
import inspect

import typer

__all__ = ["app", "main"]

app = typer.Typer(
    name="qkv",
    help="qkv: attention for PyTorch. Cost arithmetic, benchmarks, embeddings and a guided demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command modules, each exposing register(app). Listed explicitly: a missing one is an error, not a skip.
_COMMAND_MODULES: tuple[str, ...] = ("demo", "costs", "bench", "embed", "presets", "plan_cp", "attention", "explore",
                                     "conform")

_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    for name in _COMMAND_MODULES:
        importlib.import_module(f"qkv.cli.{name}").register(app)
    for info in app.registered_commands:
        if info.help is None and info.callback is not None:
            info.help = _unwrap_help(inspect.getdoc(info.callback) or "")
    _registered = True


def _unwrap_help(doc: str) -> str:
    """A command's docstring as its help: each prose paragraph joined into one line, so the terminal wraps it at
    its own width (typer keeps a docstring's hard line breaks and rich then breaks each of them again);
    paragraphs with an indented line (examples) stay as written."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(
        p if any(line[:1].isspace() for line in p.splitlines()) else " ".join(line.strip() for line in p.splitlines())
        for p in paragraphs
    )


def main() -> None:
    _register()
    app()
