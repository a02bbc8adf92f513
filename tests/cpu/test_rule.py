"""The product rule (qkv.cpu.rule) equals its committed table, benchmarks/results/skinny.json.

Margin rule: in every measured cell (threads, weight shape, rows), the path the rule takes is refused when
another measured path for the same weight layout was faster in every paired repeat (the table stores each
pair's ratio per repeat as median, min and max), except where every path lost that way in some shape of the
rule's class at that row count (no class-wide rule can follow those cells). Both of the rule's decisions are
judged: with oneDNN (where the cell measures it) and without (the fallback of a torch build without it, and
of ``skinny_linear``). A cell whose chosen path it did not measure is unjudged: allowed only for oneDNN in a
table written before ``benchmarks/skinny.py`` measured it. ``F.linear`` is timed on the standard weight and
stands for it in both layouts. The narrow class is judged on whole decode steps instead (``skinny_decode.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qkv.cpu import rule
from qkv.cpu.rule import MEASURED_ROWS, PATHS, TABLE, Band, choose, shape_class, switches

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "results" / "skinny.json"
COMMITTED_DECODE = ROOT / "benchmarks" / "results" / "skinny_decode.json"
COMMITTED_STREAM = ROOT / "benchmarks" / "results" / "skinny_stream.json"
COMMITTED_BF16 = ROOT / "benchmarks" / "results" / "skinny_bf16.json"
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


def _no_common_path(payload: dict) -> set[tuple]:
    """(thread class, shape class, rows, layout, onednn) where no contender escaped defeat in every shape of the
    class: no class-wide rule can follow those cells, so there the rule is free (the fitter takes the path
    losing least)."""
    free: dict[tuple, set | None] = {}
    for row in payload["rows"]:
        pairs = _pairs(row)
        measured = {p for pair in pairs for p in pair}
        for layout, contenders in (("standard", STANDARD), ("input_major", INPUT_MAJOR)):
            for with_onednn in ((True, False) if "onednn" in measured else (False,)):
                cands = [c for c in contenders if c in measured and (with_onednn or c != "onednn")]
                ok = {c for c in cands if not any(_beaten(pairs, c, o) for o in cands if o != c)}
                key = (rule.thread_class(row["threads"]), shape_class(row["N"], row["K"]), row["rows"], layout,
                       with_onednn)
                free[key] = ok if free.get(key) is None else free[key] & ok
    return {key for key, ok in free.items() if not ok}


def disagreements(payload: dict) -> tuple[list[str], list[str], int]:
    """(refused decisions, unjudged decisions, judged decisions) of the rule on a skinny.json payload."""
    refused, unjudged, judged = [], [], 0
    conflicts = _no_common_path(payload)
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
                if (rule.thread_class(threads), shape_class(n, k)) in rule.DECIDED_IN_PLACE:
                    continue  # judged on whole decode steps (test_rule_holds_in_place_on_whole_decode_steps)
                if (rule.thread_class(threads), shape_class(n, k), rows, layout, with_onednn) in conflicts:
                    continue
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


def stream_refusals(payload: dict, stream_rows: int) -> list[str]:
    """Cells of a skinny_stream table where streaming up to ``stream_rows`` rows is refused: a product of at most
    that many rows where another path was faster in every repeat, or whole decode steps of that batch that were
    faster without the stream in every repeat."""
    refused = []
    for row in payload["rows"]:
        if "decode_step" in row:
            r = row["no_stream/stream"]
            if row["B"] <= stream_rows and r["max"] < 1:
                refused.append(f"decode step B={row['B']} threads={row['threads']}: faster without ({r})")
            continue
        if row["rows"] > stream_rows:
            continue
        for key, r in row.items():
            if key.endswith("/stream") and isinstance(r, dict) and r["max"] < 1:
                refused.append(f"N={row['N']} K={row['K']} rows={row['rows']} threads={row['threads']}: "
                               f"{key.split('/')[0]} faster in every repeat ({r})")
    return refused


def test_stream_rows_hold_on_their_table():
    """The committed skinny_stream table: at up to ``STREAM_ROWS`` rows no path beat the streaming kernel in every
    repeat on a real decode shape, and whole decode steps were not faster without it; the checker refuses a
    larger ``STREAM_ROWS`` where the table says so."""
    payload = json.loads(COMMITTED_STREAM.read_text())
    assert payload["suite"] == "skinny_stream" and payload["rows"], f"{COMMITTED_STREAM} holds no table"
    assert any("decode_step" in r for r in payload["rows"]) and any(r.get("rows") == 1 for r in payload["rows"])
    refused = stream_refusals(payload, rule.STREAM_ROWS)
    assert not refused, "the streaming kernel lost where the rule takes it:\n" + "\n".join(refused)
    assert stream_refusals(payload, 4), "the table shows no row count where the stream loses (then raise STREAM_ROWS)"


def test_bf16_stream_and_screen_rows_hold_on_their_table():
    """The committed skinny_bf16 table: at up to ``BF16_STREAM_ROWS`` rows no path beat the streaming kernel in
    every repeat and whole bf16 decode steps were not faster without it, and the table shows where it loses; the
    head screen was not beaten by the head's own product at up to ``SCREEN_ROWS`` rows, and a bf16 head's product
    beat it at the next measured row count (so the bound is not too low either)."""
    from qkv.cpu.greedy import SCREEN_ROWS

    payload = json.loads(COMMITTED_BF16.read_text())
    assert payload["suite"] == "skinny_bf16" and payload["rows"], f"{COMMITTED_BF16} holds no table"
    products = {"rows": [r for r in payload["rows"] if "head" not in r]}
    refused = stream_refusals(products, rule.BF16_STREAM_ROWS)
    assert not refused, "the streaming kernel lost where the rule takes it:\n" + "\n".join(refused)
    assert stream_refusals(products, 16), "the table shows no row count where the stream loses"
    heads = [r for r in payload["rows"] if "head" in r]
    assert {r["dtype"] for r in heads} == {"bfloat16", "float32"}
    for r in heads:
        bound = SCREEN_ROWS[getattr(torch, r["dtype"])]
        if r["rows"] <= bound:
            assert r["head/screen"]["max"] >= 1, f"the head's product beat the screen in every repeat: {r}"
    for threads in {r["threads"] for r in heads}:
        above = [r for r in heads if r["dtype"] == "bfloat16" and r["threads"] == threads
                 and r["rows"] > SCREEN_ROWS[torch.bfloat16]]
        assert above and min(above, key=lambda r: r["rows"])["head/screen"]["median"] < 1, \
            "the bf16 screen still won at the next row count: raise SCREEN_ROWS"


def test_the_checker_refuses_a_rule_its_own_table_contradicts():
    """F.linear for every short weight (no row blocks, no oneDNN) is refused on the committed table, at the
    LM-head and gate/up cells where row blocks or oneDNN won every repeat."""
    payload = json.loads(COMMITTED.read_text())
    old = dict(TABLE)
    for t in (1, 2):
        old[t, "short"] = switches(row_blocks_up_to=0, onednn_from=MEASURED_ROWS + 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rule, "TABLE", old)
        refused, _, _ = disagreements(payload)
    assert refused and all(("N=32000 K=512" in r or "N=2752 K=512" in r) and ": linear, but" in r for r in refused), \
        refused
    assert any("threads=2 standard onednn=True" in r and "row_blocks was faster" in r for r in refused), refused
    assert any("rows=8 threads=1 standard onednn=True" in r and "onednn was faster" in r for r in refused), refused


def test_switches_and_bands():
    bands = switches(2, 3)
    assert [tuple(b) for b in bands] == [(2, "row_blocks", "row_blocks", "linear", "linear"),
                                         (MEASURED_ROWS, "onednn", "linear", "onednn", "linear")]
    assert switches(0, 1) == (Band(MEASURED_ROWS, "onednn", "linear", "onednn", "linear"),)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rule, "TABLE", {**TABLE, (1, "narrow"): bands})
        assert [choose(r, 512, 512, threads=1) for r in (1, 2, 3, 32, 33, 4096)] == \
            ["row_blocks", "row_blocks", "onednn", "onednn", "onednn", "onednn"]
        assert [choose(r, 512, 512, threads=1, onednn=False) for r in (1, 2, 3, 33)] == \
            ["row_blocks", "row_blocks", "linear", "linear"]
        assert choose(5, 512, 512, threads=1, input_major=True, onednn=False) == "linear"


def test_table_covers_every_key_and_is_ordered():
    assert set(TABLE) == {(t, c) for t in (1, 2) for c in ("narrow", "short", "wide", "long")}
    for key, bands in TABLE.items():
        ups = [b.up_to for b in bands]
        assert ups == sorted(set(ups)) and ups[-1] == MEASURED_ROWS, f"{key}: bands {ups}"
        for b in bands:
            assert b.standard in ("onednn", "row_blocks", "linear") and b.standard_no_onednn in ("row_blocks", "linear")
            assert b.input_major in ("onednn", "columns", "linear") and b.input_major_no_onednn in ("columns", "linear")
    for rows in (0, 1, 3, 8, 9, 32, 33, 4096):
        for threads in (1, 2, 16):
            for n, k in ((256, 256), (512, 1376), (32000, 512), (4096, 11008), (11008, 4096)):
                for input_major in (False, True):
                    for onednn in (False, True):
                        path = choose(rows, n, k, threads=threads, input_major=input_major, onednn=onednn)
                        assert path in PATHS
                        assert onednn or path != "onednn"
                        assert path != ("row_blocks" if input_major else "columns")
                        assert rows <= MEASURED_ROWS or path in ("onednn", "linear")
    assert choose(0, 32000, 512, threads=2) == "linear"
    assert [shape_class(1023, 64), shape_class(1024, 1024), shape_class(1024, 1025), shape_class(2050, 1025)] == \
        ["narrow", "short", "long", "wide"]
