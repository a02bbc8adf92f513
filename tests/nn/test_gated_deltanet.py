"""qkv.nn.GatedDeltaNet against HF's Qwen3NextGatedDeltaNet with the same random weights in float64: prefill,
step-by-step decode with HF's own cache, left padding, state carry and bad inputs."""

from __future__ import annotations

import pytest
import torch

from qkv.nn import GatedDeltaNet, RecurrentState

# HF computes its kernels and norm in float32 even for float64 modules, so agreement is float32-tight.
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _hf_pair(Hk=2, H=4, Dk=8, Dv=6, E=32, K=4, seed=0):
    try:
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    except ImportError as e:
        pytest.skip(f"transformers' qwen3_next is not importable: {e}")
    cfg = Qwen3NextConfig(hidden_size=E, linear_num_value_heads=H, linear_num_key_heads=Hk, linear_key_head_dim=Dk,
                          linear_value_head_dim=Dv, linear_conv_kernel_dim=K, num_hidden_layers=1,
                          layer_types=["linear_attention"], vocab_size=16, num_attention_heads=2,
                          num_key_value_heads=1)
    torch.manual_seed(seed)
    hf = Qwen3NextGatedDeltaNet(cfg, 0).double()
    with torch.no_grad():  # non-trivial norm weights and gates
        hf.norm.weight.uniform_(0.5, 1.5)
        hf.dt_bias.normal_()
    ours = GatedDeltaNet(E, num_k_heads=Hk, num_v_heads=H, head_k_dim=Dk, head_v_dim=Dv, conv_kernel_size=K,
                         norm_eps=cfg.rms_norm_eps, dtype=torch.float64)
    ours.load_state_dict(hf.state_dict())
    return cfg, hf, ours


@pytest.mark.parametrize("Hk, H", [(2, 2), (1, 4), (2, 4)], ids=["Hk2-H2", "Hk1-H4", "Hk2-H4"])
def test_prefill_and_decode_match_hf(Hk, H):
    cfg, hf, ours = _hf_pair(Hk=Hk, H=H)
    from transformers.cache_utils import DynamicCache

    x = torch.randn(2, 75, 32, dtype=torch.float64)
    with torch.no_grad():
        want = hf(x)
        got, state = ours(x)
        torch.testing.assert_close(got, want, **TOL)
        cache = DynamicCache(config=cfg)
        hf_steps = [hf(x[:, :70], cache=cache)]
        out, state = ours(x[:, :70])
        steps = [out]
        for t in range(70, 75):
            hf_steps.append(hf(x[:, t:t + 1], cache=cache))
            y, state = ours.step(x[:, t:t + 1], state)
            steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), torch.cat(hf_steps, 1), **TOL)
    torch.testing.assert_close(torch.cat(steps, 1), got, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.recurrent, cache.layers[0].recurrent_states[0].double(), **TOL)


def test_left_padding_does_not_leak_into_the_state():
    """A left-padded row gives the unpadded row's outputs and state, as HF's masking does."""
    cfg, hf, ours = _hf_pair()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        got, state = ours(x, attention_mask=mask)
        torch.testing.assert_close(got, hf(x, attention_mask=mask), **TOL)
        alone, alone_state = ours(x[1:, 5:])
        torch.testing.assert_close(got[1:, 5:], alone, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state.recurrent[1:], alone_state.recurrent, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state.conv[1:], alone_state.conv, rtol=1e-10, atol=1e-10)


def test_continuation_and_gradients():
    torch.manual_seed(1)
    layer = GatedDeltaNet(16, num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4, chunk_size=8,
                          dtype=torch.float64)
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    full = layer(x)
    a = layer(x[:, :2])  # shorter than the kernel: the convolution's state carries zeros and 2 inputs
    b = layer(x[:, 2:], state=a.state)
    torch.testing.assert_close(torch.cat([a.out, b.out], 1), full.out, rtol=1e-10, atol=1e-10)
    full.out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_bad_inputs():
    layer = GatedDeltaNet(16, num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4)
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, hidden_size=16\), got \(3, 16\)"):
        layer(x[0])
    with pytest.raises(ValueError, match=r"one token \(B, 1, hidden_size\)"):
        layer.step(x, None)
    with pytest.raises(TypeError, match=r"state must be a qkv.nn.RecurrentState"):
        layer(x, state=torch.zeros(2, 2, 4, 4))
    with pytest.raises(ValueError, match=r"state must have conv \(B, Cc, K - 1\) = \(2, 16, 3\)"):
        layer(x, state=RecurrentState(torch.zeros(1, 16, 3), torch.zeros(1, 2, 4, 4)))
    with pytest.raises(ValueError, match=r"attention_mask must be a tensor \(B, N\) = \(2, 3\)"):
        layer(x, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"num_v_heads=3 must be a multiple of num_k_heads=2"):
        GatedDeltaNet(16, num_k_heads=2, num_v_heads=3, head_k_dim=4, head_v_dim=4)
    with pytest.raises(ValueError, match=r"head_k_dim must be a positive int, got 0"):
        GatedDeltaNet(16, num_k_heads=1, num_v_heads=1, head_k_dim=0, head_v_dim=4)


def test_split_projections_match_hf_qwen3_5():
    """SplitGatedDeltaNet against HF's Qwen3_5GatedDeltaNet (flat in_proj_qkv / z / b / a): prefill and decode."""
    try:
        from transformers.cache_utils import DynamicCache
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    except ImportError as e:
        pytest.skip(f"transformers' qwen3_5 is not importable: {e}")
    from qkv.nn import SplitGatedDeltaNet

    cfg = Qwen3_5TextConfig(hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                            linear_value_head_dim=6, linear_conv_kernel_dim=4, num_hidden_layers=1,
                            layer_types=["linear_attention"], vocab_size=16, num_attention_heads=2,
                            num_key_value_heads=1)
    torch.manual_seed(3)
    hf = Qwen3_5GatedDeltaNet(cfg, 0).double()
    with torch.no_grad():
        hf.norm.weight.uniform_(0.5, 1.5)
        hf.dt_bias.normal_()
    ours = SplitGatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel_size=4,
                              norm_eps=cfg.rms_norm_eps, dtype=torch.float64)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x).out, hf(x), **TOL)
        cache = DynamicCache(config=cfg)
        want = [hf(x[:, :37], cache=cache)] + [hf(x[:, t:t + 1], cache=cache) for t in range(37, 40)]
        out, state = ours(x[:, :37])
        got = [out]
        for t in range(37, 40):
            y, state = ours.step(x[:, t:t + 1], state)
            got.append(y)
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), **TOL)
