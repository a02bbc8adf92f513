"""`qkv memory`, `qkv flops`, `qkv compare` through typer's CliRunner."""

from __future__ import annotations

import doctest
import json

import pytest
from typer.testing import CliRunner

from qkv.cli import _register, app
from qkv.costs import PRESETS, kv_cache_memory, model_attention_flops

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _commands():
    _register()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_memory_teaching_example():
    r = run("memory", "llama-70b-mha", "--context", "128000", "--dtype", "fp16")
    assert r.exit_code == 0, r.output
    assert "4.19 GB" in r.stdout and "335.54 GB" in r.stdout and "335,544,320,000" in r.stdout


def test_memory_prints_mha_equivalent_and_fits():
    r = run("memory", "llama-3-70b", "--context", "128k")
    assert r.exit_code == 0, r.output
    assert "42.95 GB" in r.stdout and "343.60 GB" in r.stdout and "8.0x" in r.stdout
    assert "24 GB no" in r.stdout and "80 GB yes" in r.stdout


def test_memory_json():
    r = run("memory", "gemma-3-27b", "--context", "128k", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["total_bytes"] == kv_cache_memory(PRESETS["gemma-3-27b"], context=131072).total_bytes
    assert {g["kind"]: g["tokens"] for g in d["layers"]} == {"global": 131072, "local": 1024}
    assert d["mha_equivalent_total_bytes"] == 2 * d["total_bytes"]


def test_memory_quantized_json():
    r = run("memory", "deepseek-v2", "--context", "1k", "--dtype", "int4", "--group-size", "64", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["total_bytes"] == 60 * 576 * 1024 * (0.5 + 4 / 64)


def test_memory_reads_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}))
    r = run("memory", str(path), "--context", "1000", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["total_bytes"] == 2 * 2 * 4 * 64 * 1000 * 2


def test_flops_table_and_json():
    r = run("flops", "deepseek-v2", "--context", "8k")
    assert r.exit_code == 0, r.output
    assert all(word in r.stdout for word in ("prefill", "decode", "training", "absorbed"))
    r = run("flops", "llama-3-8b", "--context", "8k", "--batch", "2", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    f = model_attention_flops(PRESETS["llama-3-8b"], context=8192, batch=2)
    assert (d["prefill"], d["decode"], d["training"]) == (f.prefill, f.decode, f.training)


def test_compare_table_and_json():
    r = run("compare", "llama-70b-mha", "llama-3-70b", "deepseek-v2", "gemma-3-27b")
    assert r.exit_code == 0, r.output
    assert all(name in r.stdout for name in ("llama-70b-mha", "deepseek-v2", "9.06 GB", "343.60 GB"))
    r = run("compare", "llama-3-8b", "mistral-7b-v0.1", "--context", "32k", "--json")
    assert [m["preset"] for m in json.loads(r.stdout)] == ["llama-3-8b", "mistral-7b-v0.1"]


def test_compare_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "kv.png"
    r = run("compare", "llama-70b-mha", "llama-3-70b", "deepseek-v2", "gemma-3-27b", "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", ["memory", "flops", "compare"])
def test_unknown_preset_fails_with_names(command):
    r = run(command, "llama3-70b")
    assert r.exit_code == 2
    assert "Did you mean 'llama-3-70b'?" in r.stderr
    assert all(name in r.stderr for name in PRESETS)
    assert "Traceback" not in r.output


@pytest.mark.parametrize(
    "args, forms",
    [(("--context", "abc"), "128k = 131072"), (("--context", "-5"), "128k = 131072"),
     (("--dtype", "int3"), "fp32, fp16, bf16"), (("--dtype", "bf16", "--group-size", "32"), "group_size")],
)
def test_bad_options_fail_with_accepted_forms(args, forms):
    r = run("memory", "llama-3-8b", *args)
    assert r.exit_code == 2, r.output
    assert forms in r.stderr and "Traceback" not in r.output
    assert r.stdout == ""


def test_bad_plot_path_fails_cleanly(tmp_path):
    r = run("compare", "llama-3-8b", "--plot", str(tmp_path / "missing" / "kv.png"))
    assert r.exit_code == 2 and "error:" in r.stderr


@pytest.mark.parametrize("command", ["memory", "flops", "compare"])
def test_help_has_examples(command):
    r = run(command, "--help")
    assert r.exit_code == 0
    assert "Examples" in r.stdout and f"qkv {command}" in r.stdout


def test_compare_plot_tells_overlapping_lines_apart_and_labels_the_context_line():
    pytest.importorskip("matplotlib")
    from qkv.cli.costs import plot_figure

    p = PRESETS["llama-3-8b"]
    grid = [1024, 4096, 65536]
    curve = [kv_cache_memory(p, context=c) for c in grid]
    fig = plot_figure({"a": curve, "b": list(curve), "c": list(curve)}, 4096)
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_label() in ("a", "b", "c")]
    looks = {(ln.get_linestyle(), ln.get_marker()) for ln in lines}
    assert len(looks) == 3, looks
    labels = ax.get_legend_handles_labels()[1]
    assert "context 4,096 tokens" in labels, labels


def test_flops_table_columns_all_have_headers():
    r = run("flops", "llama-3-8b", "--context", "8k")
    assert r.exit_code == 0, r.output
    header = next(line for line in r.stdout.splitlines() if "pass" in line and "┃" in line)
    cells = [c.strip() for c in header.strip().strip("┃").split("┃")]
    assert cells and all(cells), f"a column without a header: {cells}"


def _hf_config(tmp_path, name: str, **fields) -> str:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                                "hidden_size": 256, **fields}))
    return str(path)


@pytest.mark.parametrize(
    "models, context, end",
    [
        (("llama-3-8b", "deepseek-v2"), 4096, 163840),  # a model's max_position_embeddings is the longest
        (("llama-3-8b", "gpt-2-small"), 2**20, 2**20),  # the requested context is the longest
        (("gpt-2-small", "gpt-3-175b"), 1000, 2048),
        (("hf-40k", "llama-3-8b"), 1024, 40960),  # a config.json's max_position_embeddings
        (("hf-gpt2-style", "llama-70b-mha"), 1024, 3000),  # GPT-2's n_positions; a preset that states none
    ],
    ids=["model-longest", "context-longest", "gpt", "hf-config", "hf-n_positions"],
)
def test_compare_plot_axis_ends_at_the_longest_context(tmp_path, models, context, end):
    pytest.importorskip("matplotlib")
    from qkv.cli.costs import compare_figure
    from qkv.costs import get_preset

    configs = {"hf-40k": _hf_config(tmp_path, "hf-40k", max_position_embeddings=40960),
               "hf-gpt2-style": _hf_config(tmp_path, "hf-gpt2-style", n_positions=3000)}
    presets = [get_preset(configs.get(m, m)) for m in models]
    ax = compare_figure(presets, context).axes[0]
    lo, hi = ax.get_xlim()
    assert hi == end, f"x axis ends at {hi}, expected {end} for {models} at context {context}"
    assert lo <= min(1024, context), f"x axis starts at {lo}, after the context {context} or 1k"
    labels = ax.get_legend_handles_labels()[1]
    assert f"context {context:,} tokens" in labels and all(p.name in labels for p in presets), labels
    for p in presets:
        (line,) = [ln for ln in ax.get_lines() if ln.get_label() == p.name]
        last = max(p.context_limit or end, context)
        assert line.get_xdata()[-1] == min(last, end), f"{p.name}'s curve ends at {line.get_xdata()[-1]}"


def test_compare_plot_png_through_the_cli(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "kv.png"
    r = run("compare", "gpt-2-small", _hf_config(tmp_path, "m", max_position_embeddings=4096), "--context", "2k",
            "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert r.stderr.splitlines() == [
        "warning: gpt-2-small: context 2,048 tokens exceeds its max_position_embeddings 1,024; the numbers are "
        "arithmetic for a length the model was not configured for"
    ], r.stderr


@pytest.mark.parametrize("command", ["compare", "memory", "flops"])
def test_context_past_max_position_embeddings_warns_one_line_per_model(tmp_path, command):
    config = _hf_config(tmp_path, "my-model", max_position_embeddings=16384)
    models = (config, "llama-3-8b", "deepseek-v2") if command == "compare" else (config,)
    r = run(command, *models, "--context", "32k")
    assert r.exit_code == 0, r.output
    expected = ["warning: my-model: context 32,768 tokens exceeds its max_position_embeddings 16,384; "
                "the numbers are arithmetic for a length the model was not configured for"]
    if command == "compare":
        expected.append("warning: llama-3-8b: context 32,768 tokens exceeds its max_position_embeddings 8,192; "
                        "the numbers are arithmetic for a length the model was not configured for")
    assert r.stderr.splitlines() == expected, r.stderr
    assert "warning" not in r.stdout


@pytest.mark.parametrize("args", [("compare", "llama-3-8b", "deepseek-v2", "--context", "8k"),
                                  ("memory", "llama-70b-mha", "--context", "1M"),
                                  ("compare", "gpt-2-small", "--context", "1024", "--json")],
                         ids=["at-the-limit", "no-limit-stated", "json"])
def test_context_within_max_position_embeddings_does_not_warn(args):
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert r.stderr == "", r.stderr


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "8k"], ids=repr)
def test_preset_refuses_a_bad_max_position_embeddings(bad):
    from qkv.config import DecoderConfig
    from qkv.costs import ModelPreset

    with pytest.raises(ValueError, match="max_position_embeddings must be a positive int"):
        ModelPreset(config=DecoderConfig(name="t", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, hidden_size=32, vocab_size=None, intermediate_size=None,
                                         max_position_embeddings=bad))


def test_hf_config_max_position_embeddings_is_read_from_text_config(tmp_path):
    from qkv.costs import get_preset

    path = tmp_path / "mm" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_size": 64, "max_position_embeddings": 131072}}))
    assert get_preset(str(path)).context_limit == 131072


def test_docstring_examples_run():
    from qkv.cli import costs as cli_costs

    result = doctest.testmod(cli_costs, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result


def test_compare_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    png = tmp_path / "kv.png"
    r = run("compare", "llama-3-8b", "--context", "8k", "--plot", str(png))
    assert r.exit_code == 2, r.output
    assert "pip install 'qkv[plot]'" in r.stderr and "Traceback" not in r.output, r.output
    assert r.stdout == "" and not png.exists()


def test_flops_deepseek_v32_sets_dsa_beside_dense_mla():
    from qkv.costs import dsa_model_flops, format_flops

    f = dsa_model_flops(PRESETS["deepseek-v3.2"], context=131072)
    r = run("flops", "deepseek-v3.2", "--context", "128k")
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "indexer key 128" in out and "DeepSeek Sparse Attention: each query reads 2,048 latents" in out
    wide = runner.invoke(app, ["flops", "deepseek-v3.2", "--context", "128k"], env={"COLUMNS": "200"}).stdout
    for value in (f.prefill.indexer, f.prefill.selected, f.prefill.dense, f.decode.sparse, f.decode.dense):
        assert format_flops(value) in wide, (format_flops(value), wide)
    assert f"DSA prefill: fewer FLOPs than dense MLA from {f.crossover_prefill:,} tokens on" in out
    assert f"DSA decode: fewer FLOPs than dense MLA from {f.crossover_decode:,} tokens on" in out
    data = json.loads(run("flops", "deepseek-v3.2", "--context", "2k", "--json").stdout)
    assert data["dsa"]["crossover_decode"] == f.crossover_decode and data["dsa"]["index_topk"] == 2048
    assert data["dsa"]["decode"]["sparse"] > data["dsa"]["decode"]["dense"]  # 2k tokens: below the crossover
    plain = run("flops", "deepseek-v3", "--context", "8k")
    assert plain.exit_code == 0 and "Sparse Attention" not in plain.stdout
    assert "dsa" not in json.loads(run("flops", "deepseek-v3", "--json").stdout)


def test_memory_deepseek_v32_counts_the_indexer_key(tmp_path):
    r = run("memory", "deepseek-v3.2", "--context", "1000", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bytes_per_token"] == 61 * (512 + 64 + 128) * 2
    transformers = pytest.importorskip("transformers")
    transformers.DeepseekV32Config(index_head_dim=96).save_pretrained(tmp_path)  # indexed_attention layer types
    r = run("memory", str(tmp_path / "config.json"), "--context", "1000", "--dtype", "bf16", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bytes_per_token"] == 61 * (512 + 64 + 96) * 2
