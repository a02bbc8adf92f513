"""`qkv bench`: suite selection, friendly failure, summary and plots from suite JSON."""

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


def test_summary_and_plot(tmp_path):
    md = summarize([PAYLOAD])
    assert "| N | causal | sdpa_ms | qkv_ms |" in md and "threads=2" in md and "a note" in md
    png = plot_suite(PAYLOAD, tmp_path / "dense.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
