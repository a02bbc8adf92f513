"""Bad input to ``qkv conform``, ``qkv plan-cp`` and ``qkv memory`` ends in one ``error:`` line and exit code 2,
never a traceback or a zero exit (#46 item 8); a model folder is taken where the Python API takes one."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import _register, app

runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _commands():
    _register()


def run(*args: str):
    return runner.invoke(app, list(args))


def _refused(r, *words):
    assert r.exit_code == 2, f"exit {r.exit_code}: {r.output}"
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    for w in words:
        assert w in r.output, r.output


@pytest.mark.parametrize("device", ["nope", "cuda:banana"])
def test_conform_refuses_a_device_that_is_not_one(device):
    _refused(run("conform", "sdpa", "--device", device), "error:", repr(device), "not a torch device")


def test_conform_refuses_a_device_this_torch_cannot_reach():
    device = "hpu" if torch.cuda.is_available() else "cuda"  # a device type with no backend here
    _refused(run("conform", "sdpa", "--device", device), "error:", "not available here")


@pytest.mark.parametrize("flag", ["--memory-gb", "--hbm-tbps", "--link-gbps", "--tflops"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_plan_cp_refuses_non_finite_sizes(flag, value):
    r = run("plan-cp", "llama-3-8b", flag, value)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))


def test_memory_takes_a_model_folder_and_names_a_folder_without_config(tmp_path):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
           "intermediate_size": 512, "vocab_size": 1000}
    model = tmp_path / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    by_folder = run("memory", str(model), "--context", "1024")
    by_file = run("memory", str(model / "config.json"), "--context", "1024")
    assert by_folder.exit_code == 0, by_folder.output
    assert by_folder.stdout == by_file.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(run("memory", str(empty)), "error:", "folder without a config.json")
