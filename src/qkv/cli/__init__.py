"""The ``qkv`` command line. Each command group lives in its own module with a ``register(app)``.

Run ``qkv --help`` for the list; every command has ``--help`` with examples.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Annotated

import typer

__all__ = ["app", "main"]

app = typer.Typer(
    name="qkv",
    help="qkv: attention for PyTorch. Cost arithmetic, benchmarks, embeddings and a guided demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

def _version() -> str:
    from qkv import __version__

    try:
        installed = _dist_version("qkv")
    except PackageNotFoundError:
        installed = None
    return __version__ if installed in (None, __version__) else f"{__version__} (installed metadata: {installed})"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"qkv {_version()}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", help="Print qkv's version and exit.",
                                                callback=_show_version, is_eager=True)] = False) -> None:
    """qkv: attention for PyTorch. Cost arithmetic, benchmarks, embeddings and a guided demo."""


def _writes_safely(fn):
    """A command whose output place cannot be written (``--out`` under a read-only or missing root) ends with
    one error line and exit code 2, not a traceback."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            if e.errno is None:
                raise
            where = f" {e.filename!r}" if e.filename else ""
            typer.echo(f"error: cannot write or read{where}: {e.strerror}; choose another place (--out/--output)",
                       err=True)
            raise typer.Exit(code=2) from None

    return run


# Command modules, each exposing register(app). Listed explicitly: a missing one is an error, not a skip.
_COMMAND_MODULES: tuple[str, ...] = ("demo", "costs", "bench", "embed", "presets", "plan_cp", "attention", "explore",
                                     "conform", "doctor")

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
        if info.callback is not None:
            info.callback = _writes_safely(info.callback)
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
