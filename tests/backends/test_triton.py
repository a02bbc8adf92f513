"""The Triton backend: declines and dispatch here; its kernels under Triton's interpreter in a child process.

The kernels are checked by ``tests/_triton_interpreted.py`` (forward and backward for every mask and
modifier, dtypes, head dims, dropout, the decode kernels), run by :func:`test_kernels_under_interpreter`
in a child pytest with ``TRITON_INTERPRET=1`` set before triton is imported; this process never sets it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv import masks as M
from qkv import mods

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install 'qkv[gpu]')")
def test_kernels_under_interpreter():
    here = Path(__file__).resolve().parents[1]  # tests/, where _triton_interpreted.py sits
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here.parent / "src"), str(here), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rfE", "-p", "no:cacheprovider",
                           "-p", "no:xdist", str(here / "_triton_interpreted.py")], env=env, capture_output=True,
                          text=True, cwd=here.parent, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreted Triton kernel tests failed (rc={proc.returncode}):\n{tail}"
    summary = tail.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, tail


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_declines_without_interpreter_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        qkv.attention(x, x, x, backend="triton")
    assert "CUDA" in qkv.explain(x, x, x, return_lse=True).declined["triton"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_declines_float64_and_large_head_dims(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # declining reads the variable only; no kernel is imported
    x = torch.randn(1, 1, 8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        qkv.attention(x, x, x, backend="triton")
    y = torch.randn(1, 1, 8, 320)
    with pytest.raises(ValueError, match="head dims"):
        qkv.attention(y, y, y, backend="triton")


_TWICE = {
    "two-alibi": ([mods.alibi(torch.tensor([0.5, 0.25])), mods.alibi(torch.tensor([0.1, 0.2]))], "two ALiBi"),
    "two-softcap": ([mods.softcap(2.0), mods.softcap(3.0)], "two softcaps"),
    "two-bias": ([mods.bias(torch.zeros(8, 8)), mods.bias(torch.ones(8, 8))], "two tensor/relative bias"),
    "bias-and-relative": ([mods.bias(torch.zeros(8, 8)),
                           mods.relative_bias(torch.zeros(3, 2), lambda d: d.clamp(0, 2))], "two tensor/relative bias"),
    "python-fn": (mods.from_fn(lambda s, b, h, q, k: s), "a Python function cannot run inside a Triton kernel"),
}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", list(_TWICE))
def test_declines_modifiers_the_kernels_lack_and_explain_says_why(monkeypatch, case):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # declining reads the variable only; no kernel is imported
    mod, reason = _TWICE[case]
    x = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=f"backend 'triton' cannot run this request: .*{reason}"):
        qkv.attention(x, x, x, score_mod=mod, backend="triton")
    assert reason in qkv.explain(x, x, x, score_mod=mod).declined["triton"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("kw", [dict(sinks=torch.zeros(2)), dict(return_lse=True), dict(dropout_p=0.1),
                                dict(layout="bnhd"), dict(score_mod=[mods.softcap(2.0), mods.alibi(torch.ones(2))]),
                                dict(sinks=torch.zeros(2), layout="bnhd", mask=M.causal(), return_lse=True)],
                         ids=["sinks", "return_lse", "dropout", "bnhd", "softcap-alibi", "sinks-bnhd-causal-lse"])
def test_accepts_what_the_interpreted_tests_check(monkeypatch, kw):
    """Each of these is run against the float64 reference in tests/_triton_interpreted.py."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 2, 2, 16)  # two heads in either layout
    assert "triton" not in qkv.explain(x, x, x, **kw).declined


def test_auto_never_picks_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 2, 64, 16)
    assert qkv.explain(x, x, x, return_lse=True, mask=M.sliding_window(4)).chosen != "triton"


def test_declines_without_triton(monkeypatch):
    from qkv.backends import triton as tb

    monkeypatch.setattr(tb, "_installed", lambda: False)
    x = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"pip install 'qkv\[gpu\]'"):
        qkv.attention(x, x, x, backend="triton")
    assert "not installed" in qkv.explain(x, x, x).declined["triton"]


def test_declines_when_triton_is_missing(monkeypatch):
    from qkv.backends import triton as tb

    monkeypatch.setattr(tb, "_installed", lambda: False)
    x = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match=r"triton is not installed; install it with pip install 'qkv\[gpu\]'"):
        qkv.attention(x, x, x, backend="triton")
    assert "not installed" in qkv.explain(x, x, x).declined["triton"]
