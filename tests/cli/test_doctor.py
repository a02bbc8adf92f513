"""`qkv doctor`: the compiled kernels' state (prebuilt / JIT / off and why), capability, torch, threads, oneDNN and the
int8 screen, as text and as JSON."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from qkv.cli import _register, app
from qkv.cpu import kernels

runner = CliRunner()


def _run(*args, env=None):
    _register()
    return runner.invoke(app, ["doctor", *args], env={"COLUMNS": "240", **(env or {})})


def test_doctor_json_reports_each_path():
    res = _run("--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    st = kernels.status()
    assert info["kernels"]["state"] == st.state and info["kernels"]["library"] == st.path
    assert info["kernels"]["capability"] in kernels.CAPABILITIES
    assert info["torch"] == torch.__version__
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    t = info["threads"]
    assert (t["intra_op"], t["inter_op"]) == (torch.get_num_threads(), torch.get_num_interop_threads())
    assert 1 <= t["step_now"] <= t["intra_op"] and 'threads="fixed"' in t["how"]
    assert t["other_runnable_now"] is None or t["other_runnable_now"] >= 0
    for key in ("onednn", "int8_head_screen"):
        assert info[key]["on"] == (info[key]["off_because"] is None)
    for key in ("int8_weights", "bf16_exact_weights"):  # opt-in formats: never the default, their kernel's state
        assert info[key]["default"] is False and info[key]["kernel_on"] == (info[key]["kernel_off_because"] is None)
    assert "bf16-exact" in info["bf16_exact_weights"]["how"]


def test_doctor_text_names_the_state_and_why_a_path_is_off(monkeypatch):
    res = _run()
    assert res.exit_code == 0, res.output
    state = kernels.status().state
    assert {"prebuilt": "compiled kernels: prebuilt", "jit": "compiled kernels: built by JIT at first use"}[state] \
        in res.output
    assert f"torch: {torch.__version__}" in res.output and "threads:" in res.output and "oneDNN products:" in res.output
    monkeypatch.setenv(kernels.ENV, "0")
    off = _run()
    assert off.exit_code == 0, off.output
    assert "compiled kernels: off" in off.output
    assert f"off because: {kernels.ENV}=0 in the environment" in off.output
    assert "int8 head screen: off (qkv's CPU kernels are unavailable" in off.output
    assert "bf16-exact weights (lossless): not by default" in off.output and "cannot run here" in off.output
