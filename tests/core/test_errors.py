"""Every misuse raises ValueError/TypeError naming the argument, what was seen and the fix."""

import subprocess
import sys

import pytest
import torch

import qkv

x = torch.randn(2, 4, 8, 16)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: qkv.attention(x[0], x, x), ValueError, r"q must have rank 4.*\(4, 8, 16\).*transpose"),
    (lambda: qkv.attention(x, x[:1], x[:1]), ValueError, r"batch sizes differ"),
    (lambda: qkv.attention(x, x[..., :8], x), ValueError, r"same head dim.*\(2, 4, 8, 8\)"),
    (lambda: qkv.attention(x, x, x[:, :, :5]), ValueError, r"k and v must have the same length"),
    (lambda: qkv.attention(x, x[:, :3], x[:, :3]), ValueError, r"multiple of key/value heads \(3\)"),
    (lambda: qkv.attention(x, x[:, :2], x[:, :1]), ValueError, r"same number of heads"),
    (lambda: qkv.attention(x, x.double(), x), TypeError, r"share a dtype.*float64"),
    (lambda: qkv.attention(x.int(), x, x), TypeError, r"dtype torch.int32"),
    (lambda: qkv.attention(x, x, x, mask=torch.ones(8, 8, dtype=torch.bool)), TypeError, r"masks.dense"),
    (lambda: qkv.attention(x, x, x, mask=qkv.masks.padding([1, 2, 3])), ValueError, r"batch 3.*batch 2"),
    (lambda: qkv.attention(x, x, x, mask=qkv.masks.dense(torch.ones(7, 8, dtype=torch.bool))), ValueError,
     r"does not fit"),
    (lambda: qkv.attention(x, x, x, scale=float("nan")), ValueError, r"scale must be finite"),
    (lambda: qkv.attention(x, x, x, scale=float("inf")), ValueError, r"scale must be finite"),
    (lambda: qkv.attention(x, x, x, scale="big"), TypeError, r"scale must be a float"),
    (lambda: qkv.attention(x, x, x, backend="flash9"), ValueError, r"unknown backend 'flash9'.*auto.*reference"),
    (lambda: qkv.attention(x, x, x, score_mod=lambda s, b, h, q, k: s), TypeError, r"mods.from_fn"),
    (lambda: qkv.attention(x, x, x, score_mod=qkv.mods.alibi(torch.ones(3))), ValueError, r"3 slopes for 4"),
    (lambda: qkv.attention(x, x, x, dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (lambda: qkv.attention(x, "k", x), TypeError, r"k must be a torch.Tensor"),
    (lambda: qkv.masks.sliding_window(0, -1), ValueError, r"right must be >= 0"),
    (lambda: qkv.merge_states([x[..., 0, :]], []), ValueError, r"same non-zero number"),
    (lambda: qkv.merge_states([x], [x[..., 0, 0]]), ValueError, r"lse must be out.shape\[:-1\]"),
], ids=["rank", "batch", "head-dim", "kv-length", "gqa-ratio", "kv-heads", "mixed-dtype", "int-dtype", "raw-mask",
        "mask-batch", "mask-shape", "nan-scale", "inf-scale", "str-scale", "unknown-backend", "bare-fn-mod",
        "alibi-heads", "dropout-1", "k-type", "window-neg", "merge-count", "merge-shape"])
def test_misuse_is_explained(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_explicit_backend_never_falls_back():
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot run this request.*qkv.explain"):
        qkv.attention(x, x, x, score_mod=qkv.mods.softcap(10.0), backend="sdpa")


def test_explain_reports_choice_and_reasons():
    report = qkv.explain(x, x, x, score_mod=qkv.mods.softcap(10.0))
    text = str(report)
    assert report.chosen in report.estimates
    assert "sdpa" in report.declined and "not additive" in report.declined["sdpa"]
    assert "chosen:" in text and "declined" in text
    assert qkv.explain(x, x, x).chosen == "sdpa"


def test_import_is_light():
    code = ("import sys, qkv; import qkv.masks, qkv.mods; "
            "bad = [m for m in ('transformers', 'matplotlib', 'triton', 'scipy', 'rich') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_budget_helper_fails_when_it_should():  # more in test_testing.py
    from qkv.testing import assert_within_budget, budget

    ref = torch.randn(100, dtype=torch.float64)
    base = ref.float()
    assert budget(ref.float(), ref, base).ok
    with pytest.raises(AssertionError, match="candidate err"):
        assert_within_budget(ref.float() + 1e-3, ref, base)
    nan = ref.float().clone()
    nan[3] = float("nan")
    assert not budget(nan, ref, base).ok
