"""README's layout table says what the import graph enforces: every qkv package named in it, each in its row of
tests/core/test_layering.py's LAYERS, the rows listed from the highest layer down."""

from __future__ import annotations

import re
from pathlib import Path

from .test_layering import LAYERS

README = Path(__file__).resolve().parents[2] / "README.md"


def _rows() -> list[tuple[str, set[str]]]:
    text = README.read_text()
    table = text[text.index("| layer | package |"):]
    table = table[:table.index("\n\n")]
    rows = []
    for line in table.splitlines()[2:]:
        name, packages = line.split("|")[1:3]
        while "(" in packages:  # what a row holds is named outside parentheses; inside them, what it says of it
            packages = re.sub(r"\([^()]*\)", "", packages)
        first = {m.split(".")[1] for m in re.findall(r"`(qkv\.[a-z_]+)", packages)}
        rows.append((name.strip(), {p for p in first if p in LAYERS or f"_{p}" in LAYERS}))
    return rows


def test_every_package_with_a_layer_is_in_the_table():
    named = set().union(*(packages for _, packages in _rows()))
    public = {p for p in LAYERS if not p.startswith("_") and p not in ("spec", "lse", "varlen", "plain", "linear",
                                                                       "sparse", "masks", "mods", "pos", "backends")}
    assert public <= named, f"packages missing from README's layout table: {sorted(public - named)}"


def test_rows_go_from_the_highest_layer_down_and_hold_one_layer_each():
    seen = []
    for name, packages in _rows():
        layers = {LAYERS[p] for p in packages if p in LAYERS}
        if not layers:
            continue
        assert len(layers) == 1 or layers <= {1}, f"row {name!r} mixes layers {sorted(layers)}: {sorted(packages)}"
        seen.append((max(layers), name))
    order = [layer for layer, _ in seen]
    assert order == sorted(order, reverse=True), f"rows out of layer order: {seen}"
