"""Every command's ``--help`` at terminal widths 80 and 120: formulas never split across lines, prose fills the
width, example commands stay on one line.

A formula token is a run of non-space characters holding an operator (``= + * / ^ < > ×``): ``4*B*H*N*N*D``,
``2**30``, ``(=131,072)``, ``W=1,2,4,...``, ``O(N^2)``, ``TB/s``. The help text keeps every formula free of
spaces (an operator never touches a space), so the terminal, which breaks lines only at spaces, cannot break
inside one; the rendered help is then checked to hold each formula token whole on one line.
"""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from qkv.cli import _register, app

runner = CliRunner()
WIDTHS = (80, 120)
_OPERATOR = "=+*/^<>×"
_SPACED_OPERATOR = re.compile(rf"(?:^|\s)[{re.escape(_OPERATOR)}]|[{re.escape(_OPERATOR)}](?:\s|$)")
# A shell example: `qkv ...`, `Example: qkv ...` or `cat file | qkv ...` (paths and redirections are not formulas).
_COMMAND_LINE = re.compile(r"^(?:Examples?:\s*)?(?:[^|]*\|\s*)?qkv [a-z]")


def _commands() -> dict[str, typer.main.click.Command]:
    _register()
    root = typer.main.get_command(app)
    return {"": root, **{f"{name} ": cmd for name, cmd in root.commands.items()}}


def _help_texts(cmd) -> dict[str, str]:
    texts = {"help": cmd.help or ""}
    texts.update({f"--{p.name}": p.help for p in cmd.params if getattr(p, "help", None)})
    return texts


def _prose_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not _COMMAND_LINE.match(line.strip())]


def _command_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _COMMAND_LINE.match(line.strip())]


def formula_tokens(text: str) -> list[str]:
    """The formula tokens of a help text's prose (see the module docstring)."""
    return [tok for line in _prose_lines(text) for tok in line.split() if any(c in _OPERATOR for c in tok)]


def _render(prefix: str, width: int) -> list[str]:
    r = runner.invoke(app, [*prefix.split(), "--help"], env={"COLUMNS": str(width), "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    lines = [line.strip().strip("│").strip() for line in r.stdout.splitlines()]
    assert max(len(line) for line in r.stdout.splitlines()) <= width, f"qkv {prefix}--help wider than {width}"
    return lines


COMMANDS = _commands()


def test_every_command_is_checked():
    assert {"memory ", "flops ", "compare ", "embed ", "plan-cp ", "bench ", "demo "} <= set(COMMANDS)


@pytest.mark.parametrize("prefix", list(COMMANDS), ids=lambda p: p.strip() or "qkv")
def test_help_text_keeps_formulas_free_of_spaces(prefix):
    for where, text in _help_texts(COMMANDS[prefix]).items():
        for line in _prose_lines(text):
            m = _SPACED_OPERATOR.search(line)
            assert m is None, (f"qkv {prefix}{where}: an operator next to a space lets the terminal break the "
                               f"formula there; write it without spaces or in words: {line!r}")


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"COLUMNS{w}")
@pytest.mark.parametrize("prefix", list(COMMANDS), ids=lambda p: p.strip() or "qkv")
def test_rendered_help_holds_every_formula_and_example_on_one_line(prefix, width):
    lines = _render(prefix, width)
    for where, text in _help_texts(COMMANDS[prefix]).items():
        for token in formula_tokens(text):
            assert any(token in line for line in lines), (
                f"qkv {prefix}--help at width {width}: formula {token!r} (from {where}) is split across lines:\n"
                + "\n".join(lines))
        for example in _command_lines(text):
            assert any(example in line for line in lines), (
                f"qkv {prefix}--help at width {width}: example {example!r} wraps; shorten it to fit 80 columns")


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"COLUMNS{w}")
@pytest.mark.parametrize("prefix", list(COMMANDS), ids=lambda p: p.strip() or "qkv")
def test_description_lines_break_only_where_the_width_is_full(prefix, width):
    lines = _render(prefix, width)
    description = lines[: next(i for i, line in enumerate(lines) if line.startswith("╭"))]
    for line, following in zip(description, description[1:]):
        if not line or not following or _COMMAND_LINE.match(line) or _COMMAND_LINE.match(following):
            continue
        room = width - 2 - len(line)
        word = following.split()[0]
        assert len(word) + 1 > room, (
            f"qkv {prefix}--help at width {width}: a hard line break inside a paragraph ({word!r} would fit "
            f"after {line!r})")


@pytest.mark.parametrize(
    "text, tokens",
    [("scores are 4*B*H*N*N*D, halved", ["4*B*H*N*N*D,"]), ("128k (=131,072) or O(N^2)", ["(=131,072)", "O(N^2)"]),
     ("qkv memory ./a/config.json", []), ("plain words only", [])],
    ids=["product", "equals-and-big-O", "command-line-skipped", "none"],
)
def test_formula_tokens(text, tokens):
    assert formula_tokens(text) == tokens


@pytest.mark.parametrize("line", ["2 * B * H", "128k (= 131,072)", "x +y", "W =1"], ids=repr)
def test_spaced_operators_are_caught(line):
    assert _SPACED_OPERATOR.search(line)
