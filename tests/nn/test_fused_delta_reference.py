"""The compiled decode step of the gated-delta mixers against the float64 whole-sequence forward (the chunked rule,
a different algorithm), not only against the torch-op step: six float32 steps after a prefill, in the kernel's
error budget (#46: the fused step was checked against the torch fallback only)."""

from __future__ import annotations

import copy

import pytest
import torch

from qkv.cpu import kernels
from qkv.nn import GatedDeltaNet, KimiDeltaAttention
from qkv.testing import assert_within_budget

pytestmark = pytest.mark.xdist_group("cpu_kernels")

LAYERS = {
    "gdn-Hk1-H4": lambda dt: GatedDeltaNet(32, num_k_heads=1, num_v_heads=4, head_k_dim=8, head_v_dim=6, dtype=dt),
    "kda": lambda dt: KimiDeltaAttention(32, num_heads=2, head_dim=8, dtype=dt),
}


def _layer(name, dtype):
    torch.manual_seed(0)
    layer = LAYERS[name](dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def _steps(layer, x, state):
    outs = []
    for t in range(x.shape[1]):
        y, state = layer.step(x[:, t:t + 1], state)
        outs.append(y)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("name", list(LAYERS))
def test_compiled_steps_equal_the_float64_sequence(name, monkeypatch):
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build here: {kernels.unavailable_reason()}")
    x = torch.randn(2, 15, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    hi = _layer(name, torch.float64)
    lo = copy.deepcopy(hi).float()  # the same weights, rounded
    with torch.no_grad():
        ref = hi(x)[0][:, 9:]  # the whole sequence at once, float64
        state = lo(x[:, :9].float())[1]
        fast = _steps(lo, x[:, 9:].float(), state)
        monkeypatch.setenv(kernels.ENV, "0")
        base = _steps(lo, x[:, 9:].float(), state)
    assert_within_budget(fast, ref, base, what=f"{name}: compiled steps")
