"""The ``qkv`` command line. Each command group lives in its own module with a ``register(app)``.

Run ``qkv --help`` for the list; every command has ``--help`` with examples.
"""

from __future__ import annotations

import importlib

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
_COMMAND_MODULES: tuple[str, ...] = ("demo", "costs", "bench", "embed", "presets", "plan_cp", "attention", "explore")

_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    for name in _COMMAND_MODULES:
        importlib.import_module(f"qkv.cli.{name}").register(app)
    _registered = True


def main() -> None:
    _register()
    app()
