"""qkv.nn.KimiDeltaAttention and qkv.nn.Mamba2Mixer against HF's KimiLinearDeltaAttention and Mamba2Mixer with the
same random weights in float64: prefill, step-by-step decode with HF's own cache, left padding, bad inputs."""

from __future__ import annotations

import pytest
import torch

from qkv.nn import KimiDeltaAttention, Mamba2Mixer

# HF computes its kernels (and KDA's norm) in float32 even for float64 modules.
TOL = {"rtol": 1e-4, "atol": 1e-5}
E = 32


def _kda_pair(seed=0):
    try:
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    except ImportError as e:
        pytest.skip(f"transformers' kimi_linear is not importable: {e}")
    cfg = KimiLinearConfig(hidden_size=E, num_hidden_layers=1, vocab_size=16, num_attention_heads=2,
                           num_key_value_heads=2, linear_attn_config={"head_dim": 8, "num_heads": 3,
                                                                      "short_conv_kernel_size": 4,
                                                                      "kda_layers": [1], "full_attn_layers": []})
    torch.manual_seed(seed)
    hf = KimiLinearDeltaAttention(cfg, 0).double()
    with torch.no_grad():  # HF leaves these uninitialised outside from_pretrained
        hf.forget_gate.A_log.copy_(torch.empty_like(hf.forget_gate.A_log).uniform_(1, 16).log())
        hf.forget_gate.dt_bias.normal_(0, 1)
        hf.o_norm.weight.uniform_(0.5, 1.5)
    ours = KimiDeltaAttention(E, num_heads=3, head_dim=8, conv_kernel_size=4, norm_eps=cfg.rms_norm_eps,
                              dtype=torch.float64)
    ours.load_state_dict(hf.state_dict())
    return cfg, hf, ours


def _mamba_pair(seed=0):
    try:
        from transformers import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMixer
    except ImportError as e:
        pytest.skip(f"transformers' mamba2 is not importable: {e}")
    cfg = Mamba2Config(hidden_size=E, num_heads=4, head_dim=16, state_size=8, expand=2, n_groups=2, conv_kernel=4,
                       chunk_size=16, num_hidden_layers=1, vocab_size=16)
    torch.manual_seed(seed)
    hf = HFMixer(cfg, 0).double()
    with torch.no_grad():
        hf.norm.weight.uniform_(0.5, 1.5)
        hf.D.uniform_(0.5, 1.5)
    ours = Mamba2Mixer(E, num_heads=4, head_dim=16, state_size=8, n_groups=2, conv_kernel=4,
                       use_bias=cfg.use_bias, use_conv_bias=cfg.use_conv_bias,
                       time_step_limit=cfg.time_step_limit, norm_eps=cfg.layer_norm_epsilon, dtype=torch.float64)
    ours.load_state_dict(hf.state_dict())
    return cfg, hf, ours


PAIRS = {"kda": _kda_pair, "mamba2": _mamba_pair}


def _hf_state(name, cache):
    s = cache.layers[0].recurrent_states[0].double()
    return s if name == "kda" else s.transpose(-1, -2)  # HF's Mamba2 keeps (P, Ns), qkv (Ns, P)


@pytest.mark.parametrize("name", list(PAIRS))
def test_prefill_and_decode_match_hf(name):
    cfg, hf, ours = PAIRS[name]()
    from transformers.cache_utils import DynamicCache

    x = torch.randn(2, 70, E, dtype=torch.float64)
    with torch.no_grad():
        want = hf(x)
        got, _ = ours(x)
        torch.testing.assert_close(got, want, **TOL)
        cache = DynamicCache(config=cfg)
        hf_steps = [hf(x[:, :66], cache=cache)]
        out, state = ours(x[:, :66])
        steps = [out]
        for t in range(66, 70):
            hf_steps.append(hf(x[:, t:t + 1], cache=cache))
            y, state = ours.step(x[:, t:t + 1], state)
            steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), torch.cat(hf_steps, 1), **TOL)
    torch.testing.assert_close(torch.cat(steps, 1), got, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.recurrent, _hf_state(name, cache), **TOL)


@pytest.mark.parametrize("name", list(PAIRS))
def test_left_padding_does_not_leak_into_the_state(name):
    cfg, hf, ours = PAIRS[name]()
    x = torch.randn(2, 12, E, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        got, state = ours(x, attention_mask=mask)
        torch.testing.assert_close(got[:, 5:], hf(x, attention_mask=mask)[:, 5:], **TOL)
        alone, alone_state = ours(x[1:, 5:])
    torch.testing.assert_close(got[1:, 5:], alone, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.recurrent[1:], alone_state.recurrent, rtol=1e-10, atol=1e-10)


def test_bad_inputs():
    kda = KimiDeltaAttention(16, num_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=r"KimiDeltaAttention.forward: x must have shape \(B, N, hidden_size=16\)"):
        kda(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"KimiDeltaAttention.step: x must hold one token"):
        kda.step(torch.randn(2, 3, 16), None)
    with pytest.raises(ValueError, match=r"num_heads must be a positive int, got 0"):
        KimiDeltaAttention(16, num_heads=0, head_dim=4)
    mamba = Mamba2Mixer(16, num_heads=2, head_dim=8, state_size=4)
    with pytest.raises(ValueError, match=r"Mamba2Mixer.forward: state must have conv \(B, Cc, K - 1\) = \(2, 24, 3\)"):
        from qkv.nn import RecurrentState
        mamba(torch.randn(2, 3, 16), state=RecurrentState(torch.zeros(2, 16, 3), torch.zeros(2, 2, 4, 8)))
    with pytest.raises(ValueError, match=r"n_groups=3 must divide num_heads=2"):
        Mamba2Mixer(16, num_heads=2, head_dim=8, state_size=4, n_groups=3)


@pytest.mark.parametrize("name", ["gdn", "kda", "mamba2"])
def test_bfloat16_modules_stay_close_to_float64(name):
    """A bfloat16 layer (its gates kept in float32, the state accumulated in float32) against the same weights in
    float64: within a bfloat16-sized tolerance, state in float32."""
    from qkv.nn import GatedDeltaNet

    torch.manual_seed(2)
    make = {"gdn": lambda: GatedDeltaNet(E, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8),
            "kda": lambda: KimiDeltaAttention(E, num_heads=2, head_dim=8),
            "mamba2": lambda: Mamba2Mixer(E, num_heads=2, head_dim=16, state_size=8)}[name]
    ref = make().double()
    low = make().bfloat16()
    low.load_state_dict(ref.state_dict())
    x = torch.randn(2, 40, E, dtype=torch.float64)
    with torch.no_grad():
        want = ref(x).out
        got, state = low(x.bfloat16())
    assert got.dtype == torch.bfloat16 and state.recurrent.dtype == torch.float32
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 0.05, f"{name}: bfloat16 relative error {err:.3g}"


@pytest.mark.parametrize("name", ["gdn", "kda", "mamba2"])
def test_head_gate_scales_each_heads_output(name):
    """The AttentionModule protocol's head_gate multiplies each value head's output before the output projection:
    all ones changes nothing, zeros silence the layer, one head off equals that head's output set to zero."""
    from qkv.nn import GatedDeltaNet
    from qkv.nn.protocol import AttentionModule

    torch.manual_seed(4)
    layer = {"gdn": lambda: GatedDeltaNet(E, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8),
             "kda": lambda: KimiDeltaAttention(E, num_heads=2, head_dim=8),
             "mamba2": lambda: Mamba2Mixer(E, num_heads=2, head_dim=16, state_size=8)}[name]().double()
    assert isinstance(layer, AttentionModule) and layer.attention_fn is None and layer.n_heads == 2
    x = torch.randn(1, 9, E, dtype=torch.float64)
    with torch.no_grad():
        base = layer(x).out
        layer.head_gate = torch.ones(2, dtype=torch.float64)
        torch.testing.assert_close(layer(x).out, base, rtol=0, atol=0)
        layer.head_gate = torch.zeros(2, dtype=torch.float64)
        assert layer(x).out.abs().max() == 0
        layer.head_gate = torch.tensor([1.0, 0.0], dtype=torch.float64)
        proj = layer.out_proj if name != "kda" else layer.o_proj
        half = proj.weight.shape[1] // 2
        w = proj.weight.clone()
        proj.weight[:, half:] = 0  # head 1's columns of the output projection
        layer.head_gate = None
        want = layer(x).out
        proj.weight.copy_(w)
        layer.head_gate = torch.tensor([1.0, 0.0], dtype=torch.float64)
        torch.testing.assert_close(layer(x).out, want, rtol=1e-12, atol=1e-12)
