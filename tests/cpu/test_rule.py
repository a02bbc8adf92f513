"""The product rule (qkv.cpu.rule) equals its committed table, benchmarks/results/skinny.json.

Margin rule: in every measured cell (threads, weight shape, rows), the path the rule takes is refused when
another measured path for the same weight layout was faster in every paired repeat (the table stores each
pair's ratio per repeat as median, min and max). Both of the rule's decisions are judged: with oneDNN (where
the cell measures it) and without (the fallback of a torch build without it, and of ``skinny_linear``). A
cell whose chosen path it did not measure is unjudged: allowed only for oneDNN in a table written before
``benchmarks/skinny.py`` measured it. ``F.linear`` is timed on the standard weight and stands for it in both
layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qkv.cpu import rule
from qkv.cpu.rule import PATHS, TABLE, Paths, choose, shape_class

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "results" / "skinny.json"
COMMITTED_DECODE = ROOT / "benchmarks" / "results" / "skinny_decode.json"
STANDARD, INPUT_MAJOR = ("linear", "row_blocks", "onednn"), ("linear", "columns", "onednn")


def _pairs(row: dict) -> dict[tuple[str, str], dict]:
    """(a, b) -> {min, median, max} of time_a / time_b over the paired repeats, for every measured pair."""
    pairs = {}
    for key, value in row.items():
        a, sep, b = key.partition("/")
        if sep and a in PATHS and b in PATHS and isinstance(value, dict):
            pairs[a, b] = value
    # tables written before every path was forced: "rows" is row blocks only where the rule then took them
    if "rows_path" in row and "row blocks" in row["rows_path"]:
        pairs["linear", "row_blocks"] = row["linear/rows"]
    if "input_major_path" in row and "column blocks" in row["input_major_path"]:
        pairs["linear", "columns"] = row["linear/input_major"]
    return pairs


def _beaten(pairs: dict, path: str, other: str) -> dict | None:
    """The ratio time_path / time_other when ``other`` was faster in every repeat, else None."""
    if (path, other) in pairs and pairs[path, other]["min"] > 1:
        return pairs[path, other]
    if (other, path) in pairs and pairs[other, path]["max"] < 1:
        return pairs[other, path]
    return None


def disagreements(payload: dict) -> tuple[list[str], list[str], int]:
    """(refused decisions, unjudged decisions, judged decisions) of the rule on a skinny.json payload."""
    refused, unjudged, judged = [], [], 0
    for row in payload["rows"]:
        pairs = _pairs(row)
        measured = {p for pair in pairs for p in pair}
        n, k, rows, threads = row["N"], row["K"], row["rows"], row["threads"]
        for layout, contenders in (("standard", STANDARD), ("input_major", INPUT_MAJOR)):
            for with_onednn in ((True, False) if "onednn" in measured else (False,)):
                path = choose(rows, n, k, threads=threads, input_major=layout == "input_major", onednn=with_onednn)
                where = f"N={n} K={k} rows={rows} threads={threads} {layout} onednn={with_onednn}: {path}"
                others = [c for c in contenders if c != path and c in measured and (with_onednn or c != "onednn")]
                if path not in measured:
                    if others:
                        unjudged.append(where)
                    continue
                judged += 1
                if path == "row_blocks" and (rule.thread_class(threads), shape_class(n, k)) in rule.DECIDED_IN_PLACE:
                    continue  # judged on whole decode steps (test_rule_holds_in_place_on_whole_decode_steps)
                for other in others:
                    r = _beaten(pairs, path, other)
                    if r is not None:
                        refused.append(f"{where}, but {other} was faster in every repeat ({path}/{other} "
                                       f"{r['min']:.2f}-{r['max']:.2f})" if (path, other) in pairs else
                                       f"{where}, but {other} was faster in every repeat ({other}/{path} "
                                       f"{r['min']:.2f}-{r['max']:.2f})")
    return refused, unjudged, judged


def test_rule_equals_committed_table():
    payload = json.loads(COMMITTED.read_text())
    assert payload["suite"] == "skinny" and payload["rows"], f"{COMMITTED} holds no skinny table"
    refused, unjudged, judged = disagreements(payload)
    assert not refused, "the rule takes a path its table measured slower:\n" + "\n".join(refused)
    forced = any("row_blocks" in k.split("/") for r in payload["rows"] for k in r)
    if forced:  # written by today's benchmarks/skinny.py: every path in every cell, so every decision is judged
        assert not unjudged, "decisions the table does not measure:\n" + "\n".join(unjudged)
    else:  # the older table: only oneDNN was not measured
        assert all(w.endswith(": onednn") for w in unjudged), unjudged
    assert judged >= len(payload["rows"]), f"only {judged} decisions judged over {len(payload['rows'])} cells"


def test_rule_holds_in_place_on_whole_decode_steps():
    """The decode-step table (the same run): no alternative made whole decode steps faster than the rule in
    every repeat. Today's benchmark times ``x/rule`` (x: row blocks on narrow weights too, or no oneDNN); the
    older table timed the earlier rule (``rule``: row blocks on narrow weights) against narrow weights through
    ``F.linear`` (``small_linear``, today's rule for them)."""
    payload = json.loads(COMMITTED_DECODE.read_text())
    faster = []
    for row in payload["rows"]:
        for key, r in row.items():
            if key.endswith("/rule") and isinstance(r, dict):
                other = key.split("/")[0]
                if other == "small_linear" and r["min"] > 1:  # older table: "rule" was the alternative
                    faster.append(f"{row}: row blocks on narrow weights faster in every repeat ({r})")
                elif other != "small_linear" and r["max"] < 1:
                    faster.append(f"{row}: {other} faster than the rule in every repeat ({r})")
    assert payload["rows"] and not faster, "\n".join(faster)


def test_the_checker_refuses_a_rule_its_own_table_contradicts():
    """Row blocks for every weight of 512+ outputs (the rule before this table) is refused on the committed
    table, at the 512 x 1376 cells where F.linear won every repeat."""
    payload = json.loads(COMMITTED.read_text())
    old = dict(TABLE)
    old[2, "narrow"] = Paths(row_blocks_up_to=8, columns_up_to=32, onednn_from=8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rule, "TABLE", old)
        mp.setattr(rule, "DECIDED_IN_PLACE", frozenset())  # judged on the cells alone, as that rule was
        refused, _, _ = disagreements(payload)
    assert refused and all("N=512 K=1376" in r for r in refused), refused
    assert any("rows=1 threads=2 standard" in r and "row_blocks" in r for r in refused), refused


def test_table_covers_every_key_and_is_ordered():
    assert set(TABLE) == {(t, c) for t in (1, 2) for c in ("narrow", "short", "long")}
    for key, paths in TABLE.items():
        assert all(isinstance(v, int) and v >= 0 for v in paths), f"{key}: {paths}"
        assert paths.row_blocks_up_to <= 32 and paths.columns_up_to <= 32, f"{key}: blocks beyond measured rows"
    for rows in (0, 1, 3, 8, 9, 32, 33, 4096):
        for threads in (1, 2, 16):
            for n, k in ((256, 256), (512, 1376), (32000, 512), (4096, 11008)):
                for input_major in (False, True):
                    for onednn in (False, True):
                        path = choose(rows, n, k, threads=threads, input_major=input_major, onednn=onednn)
                        assert path in PATHS
                        assert onednn or path != "onednn"
                        assert path != ("row_blocks" if input_major else "columns")
    assert choose(0, 32000, 512, threads=2) == "linear"
    assert [shape_class(1023, 64), shape_class(1024, 1024), shape_class(1024, 1025)] == ["narrow", "short", "long"]
