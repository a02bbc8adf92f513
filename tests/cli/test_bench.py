"""`qkv bench`: suite selection, friendly failure, summary and plots from suite JSON."""

import pytest
from typer.testing import CliRunner

from qkv.cli import _register, app
from qkv.cli.bench import SUITES, find_benchmarks, plot_suite, summarize

PAYLOAD = {"suite": "dense", "description": "demo", "context": {"torch": "x", "threads": 2},
           "rows": [{"N": 1024, "causal": True, "sdpa_ms": 10.0, "qkv_ms": 10.2},
                    {"N": 4096, "causal": True, "sdpa_ms": 90.0, "qkv_ms": 91.0}], "notes": ["a note"]}


def test_unknown_suite_is_refused_with_the_list():
    _register()
    res = CliRunner().invoke(app, ["bench", "nosuch"])
    assert res.exit_code == 2
    assert "unknown suite" in res.output and "dense" in res.output


def test_every_suite_has_a_script():
    bench_dir = find_benchmarks()
    missing = [n for n, f in SUITES.items() if not (bench_dir / f).is_file()]
    assert not missing, f"suites without a script: {missing}"


def test_summary():
    md = summarize([PAYLOAD])
    assert "| N | causal | sdpa_ms | qkv_ms |" in md and "threads=2" in md and "a note" in md


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = plot_suite(PAYLOAD, tmp_path / "dense.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_output_goes_under_the_working_directory_not_the_source_tree(tmp_path, monkeypatch):
    """Run from any directory, ``qkv bench`` writes under ``./qkv-bench`` there (or ``--out``)."""
    import qkv.cli.bench as bench_mod

    seen = []
    monkeypatch.setattr(bench_mod, "run_suites", lambda names, *, quick, out, bench_dir: seen.append(out) or [])
    monkeypatch.chdir(tmp_path)
    _register()
    assert CliRunner().invoke(app, ["bench", "dense"]).exit_code == 0
    assert CliRunner().invoke(app, ["bench", "dense", "--out", "elsewhere"]).exit_code == 0
    assert seen == [tmp_path / "qkv-bench", tmp_path / "elsewhere"], seen
    assert all(find_benchmarks() not in p.parents for p in seen)


def test_spread_cells_print_as_median_and_range():
    md = summarize([{**PAYLOAD, "rows": [{"N": 1, "qkv/sdpa": {"median": 1.0, "min": 0.9, "max": 1.2, "n": 3}}]}])
    assert "| 1 | 1 [0.9, 1.2] |" in md, md
