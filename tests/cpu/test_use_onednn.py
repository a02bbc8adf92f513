"""qkv.cpu: the private oneDNN operators are guarded (a probe, a tested fallback to F.linear), and a model's
state_dict is in standard layout whatever its weights' layout in memory: safetensors saves it as is and a
fresh model loaded from the file gives the same logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv.cpu
from qkv.cpu import gemm
from qkv.nn import DecoderLM, get_config


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma", "tiny-gpt"])
def test_state_dict_is_standard_layout_and_round_trips_through_safetensors(name, input_major, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    config = get_config(name)
    torch.manual_seed(0)
    model = qkv.cpu.optimize(DecoderLM(config).eval(), input_major=input_major)
    in_memory = any(not p.is_contiguous() for p in model.parameters())
    assert in_memory == input_major, "input-major weights in memory exactly when asked for"
    state = model.state_dict()
    bad = [k for k, t in state.items() if not t.is_contiguous()]
    assert not bad, f"non-contiguous tensors in state_dict: {bad}"
    path = tmp_path / "model.safetensors"
    safetensors.save_file(state, str(path))  # raises on non-contiguous tensors
    torch.manual_seed(1)
    fresh = qkv.cpu.optimize(DecoderLM(config).eval(), input_major=input_major)
    fresh.load_state_dict(safetensors.load_file(str(path)))
    ids = torch.randint(0, 256, (2, 7))
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert any(not p.is_contiguous() for p in fresh.parameters()) == input_major  # loading kept the layout


def test_onednn_probe_and_fallback(monkeypatch):
    """Where the private operators are missing or wrong, every product falls back to F.linear and
    use_onednn says why instead of running."""
    reason = gemm.onednn_unavailable_reason()
    assert gemm.onednn_available() == (reason is None), reason  # the probe and its reason agree
    assert reason is None or reason.strip(), "a reason must say why"
    monkeypatch.setattr(gemm, "onednn_available", lambda: False)
    monkeypatch.setattr(gemm, "onednn_unavailable_reason", lambda: "probe failed")

    def broken(*args, **kwargs):
        raise AssertionError("the private operator must not be called when unavailable")

    monkeypatch.setattr(gemm, "_pointwise", broken)
    x, w, b = torch.randn(5, 8), torch.randn(16, 8), torch.randn(16)
    with torch.inference_mode():
        assert torch.equal(gemm.prepacked_linear(x, w, b, gemm.PrepackedWeight()), F.linear(x, w, b))
        lin = gemm.PrepackedLinear.from_linear(torch.nn.Linear(8, 16))
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    with pytest.raises(RuntimeError, match="probe failed"):
        qkv.cpu.use_onednn(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="optimize: onednn=True cannot run: probe failed"):
        qkv.cpu.optimize(torch.nn.Linear(2, 2), onednn=True)
    model = qkv.cpu.optimize(torch.nn.Sequential(torch.nn.Linear(8, 16)))  # default: the other products, no packing
    assert qkv.cpu.optimized(model) == qkv.cpu.Optimized(onednn=False, input_major=None) and not model[0].pack
    with torch.inference_mode():
        assert torch.equal(model(x), F.linear(x, model[0].weight, model[0].bias))
