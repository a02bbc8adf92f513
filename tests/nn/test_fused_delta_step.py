"""The compiled decode step of the gated-delta mixers (qkv/cpu/csrc/delta_decode.cpp, put into a mixer's
``delta_kernel`` by ``qkv.cpu.optimize`` and run by ``qkv.nn._recurrent.fused_delta_step``): GatedDeltaNet and
KimiDeltaAttention steps equal their torch-op steps
(``QKV_CPU_KERNELS=0``) from a fresh state and after a prefill, grouped key heads included; calls it cannot take
are left to the torch ops."""

from __future__ import annotations

import pytest
import torch

import qkv.cpu
from qkv.cpu import kernels
from qkv.cpu.fused import DELTA
from qkv.nn import GatedDeltaNet, KimiDeltaAttention
from qkv.nn._recurrent import RecurrentState, fused_delta_step

pytestmark = pytest.mark.xdist_group("cpu_kernels")

LAYERS = {
    "gdn-Hk1-H4": lambda dt: GatedDeltaNet(32, num_k_heads=1, num_v_heads=4, head_k_dim=8, head_v_dim=6, dtype=dt),
    "gdn-Hk2-H2": lambda dt: GatedDeltaNet(32, num_k_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16, dtype=dt),
    "kda": lambda dt: KimiDeltaAttention(32, num_heads=2, head_dim=8, dtype=dt),
}


def _layer(name, dtype):
    torch.manual_seed(0)
    layer = LAYERS[name](dtype)
    with torch.no_grad():
        for p in layer.parameters():  # weights large enough that the gates and the state matter
            p.normal_(0, 0.3)
    return qkv.cpu.optimize(layer, onednn=False)


def _steps(layer, x, state):
    outs = []
    for t in range(x.shape[1]):
        y, state = layer.step(x[:, t:t + 1], state)
        outs.append(y)
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("prefill", [0, 9])
@pytest.mark.parametrize("name", list(LAYERS))
def test_compiled_step_equals_the_torch_ops(name, prefill, dtype, monkeypatch):
    if kernels.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build in the test environment: {kernels.unavailable_reason()}")
    layer = _layer(name, dtype)
    x = torch.randn(3, prefill + 6, 32, dtype=dtype)
    tol = {"rtol": 1e-11, "atol": 1e-11} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-5}
    with torch.no_grad():
        state = layer(x[:, :prefill])[1] if prefill else None
        fast, fast_state = _steps(layer, x[:, prefill:], state)
        monkeypatch.setenv(kernels.ENV, "0")
        slow, slow_state = _steps(layer, x[:, prefill:], state)
    torch.testing.assert_close(fast, slow, **tol)
    torch.testing.assert_close(fast_state.conv, slow_state.conv, **tol)
    torch.testing.assert_close(fast_state.recurrent, slow_state.recurrent, **tol)
    if state is not None:  # the state given is read, not changed
        again, _ = _steps(layer, x[:, prefill:], state)
        torch.testing.assert_close(again, slow, **tol)


def test_calls_the_kernel_does_not_take_are_left_to_the_torch_ops():
    B, Hk, H, Dk, Dv, K = 1, 1, 2, 4, 4, 4
    Cc = 2 * Hk * Dk + H * Dv
    mixed, w = torch.randn(B, 1, Cc), torch.randn(Cc, 1, K)
    g, beta = -torch.rand(B, H, 1), torch.rand(B, H, 1)
    kw = {"Hk": Hk, "Dk": Dk, "Dv": Dv, "q_scale": 0.5, "kernel": DELTA}
    assert fused_delta_step(mixed, w, None, g, beta, None, **kw) is not None
    assert fused_delta_step(mixed, w, None, g, beta, None, **{**kw, "kernel": None}) is None  # not optimized
    assert fused_delta_step(mixed, w, torch.zeros(Cc), g, beta, None, **kw) is None  # a bias
    assert fused_delta_step(mixed.bfloat16(), w.bfloat16(), None, g, beta, None, **kw) is None  # mixed dtypes
    assert fused_delta_step(mixed.requires_grad_(), w, None, g, beta, None, **kw) is None  # autograd
    with torch.no_grad():
        out, state = fused_delta_step(mixed, w, None, g, beta, None, **kw)
    assert out.shape == (B, H, 1, Dv) and isinstance(state, RecurrentState)
    assert state.conv.shape == (B, Cc, K - 1) and state.recurrent.shape == (B, H, Dk, Dv)


def test_switched_off(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "0")
    mixed = torch.randn(1, 1, 16)
    assert fused_delta_step(mixed, torch.randn(16, 1, 4), None, -torch.rand(1, 2, 1), torch.rand(1, 2, 1), None,
                            Hk=1, Dk=4, Dv=4, q_scale=0.5, kernel=DELTA) is None
