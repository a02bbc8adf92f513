"""`qkv presets` and the whole-model part of `qkv flops` through typer's CliRunner."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from qkv.cli import _register, app
from qkv.costs import PRESETS, crossover_context, model_flops, num_parameters

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _commands():
    _register()


def run(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "240"})


def test_presets_lists_every_preset_and_the_ambiguous_names():
    r = run("presets")
    assert r.exit_code == 0, r.output
    for name in PRESETS:
        assert name in r.stdout, name
    assert "mistral-7b: pick a version" in r.stdout
    assert "68.98B" in r.stdout  # llama-2-70b


def test_presets_json_has_sources_and_counts():
    r = run("presets", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    rows = {p["name"]: p for p in out["presets"]}
    assert rows["gpt-2-small"]["parameters"] == num_parameters(PRESETS["gpt-2-small"]).total
    assert all(p["source"] for p in rows.values())
    assert out["ambiguous"]["mistral-7b"][0] == "mistral-7b-v0.1"
    assert rows["deepseek-v2"]["max_position_embeddings"] == 163840
    assert rows["transformer-base"]["max_position_embeddings"] is None


def test_flops_prints_attention_beside_the_rest_and_the_crossover():
    r = run("flops", "gpt-3-175b", "--context", "128k")
    assert r.exit_code == 0, r.output
    assert "crossover: attention reaches the rest from 147,980 tokens" in r.stdout
    assert "17,179,869,184" in r.stdout  # N^2 at 128K (131,072): not the lecture's 1.6 billion
    assert "LM head" in r.stdout and "attention share" in r.stdout


def test_flops_json_breakdown():
    r = run("flops", "llama-2-70b", "--context", "4096", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    m = model_flops(PRESETS["llama-2-70b"], context=4096)
    assert out["prefill_breakdown"]["total"] == m.prefill.total
    assert out["training_breakdown"]["attention"] == m.training.attention
    assert out["crossover_context"] == crossover_context(PRESETS["llama-2-70b"])


def test_flops_sliding_model_never_crosses_and_attention_only_preset_still_works(tmp_path):
    r = run("flops", "mistral-7b-v0.1", "--context", "32k")
    assert r.exit_code == 0 and "never reaches the rest" in r.stdout, r.output
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))
    r = run("flops", str(cfg), "--context", "1k")
    assert r.exit_code == 0 and "attention only" in r.stdout, r.output


def test_flops_ambiguous_name_is_a_clean_error():
    r = run("flops", "mistral-7b")
    assert r.exit_code == 2
    assert "pick one of mistral-7b-v0.1" in r.output
