"""`qkv demo` steps that are cheap enough for the suite (the whole demo runs as `make demo`)."""

from qkv.cli import demo


def test_masks_and_kv_table_steps():
    assert demo.step_masks()["masks_drawn"] == 4
    table = demo.step_kv_table()
    # GQA is 8x smaller than the reference texts' MHA teaching example; MLA smaller still.
    assert table["llama-70b-mha"] / table["llama-3-70b"] == 8.0
    assert table["deepseek-v2"] < table["gemma-3-27b"] < table["llama-3-70b"]


def test_operator_step_agrees_with_float64():
    assert demo.step_operator()["max_error"] < 1e-5


def test_outputs_go_under_the_working_directory(tmp_path, monkeypatch):
    """Run from any directory, ``qkv demo`` writes under ``./qkv-out`` there (or ``--out``)."""
    from pathlib import Path

    from typer.testing import CliRunner

    from qkv.cli import _register, app

    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda out: seen.append(Path(out).resolve()) or {})
    monkeypatch.chdir(tmp_path)
    _register()
    assert CliRunner().invoke(app, ["demo"]).exit_code == 0
    assert CliRunner().invoke(app, ["demo", "--out", "there"]).exit_code == 0
    assert seen == [tmp_path / "qkv-out", tmp_path / "there"], seen
