"""qkv.nn blocks, stacks, models and configs: norms, feed-forwards, residual paths, padding, causality,
presets, HF-named configs and the DecoderModel protocol."""

from __future__ import annotations

import dataclasses
import doctest
import importlib

import pytest
import torch
import torch.nn.functional as F

from qkv.cache.protocol import DecoderModel
from qkv.nn import (
    PRESETS,
    DecoderLM,
    EncoderDecoder,
    FeedForward,
    GatedMLP,
    RMSNorm,
    RopeParams,
    TransformerBlock,
    TransformerConfig,
    TransformerDecoder,
    TransformerEncoder,
    get_config,
    rms_norm,
)
from qkv.pos import RotaryEmbedding
from qkv.testing import assert_within_budget

F64 = torch.float64


def test_rms_norm_definition_and_low_precision():
    x = torch.randn(3, 5, 16, dtype=F64)
    w = torch.randn(16, dtype=F64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(rms_norm(x, w, eps=1e-6), want, atol=1e-12)
    assert torch.allclose(F.rms_norm(x, (16,), w, eps=1e-6), want, atol=1e-12)
    out = RMSNorm(16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu", "geglu"])
def test_feed_forward_definitions(activation):
    torch.manual_seed(0)
    ffn = FeedForward(8, 12, activation=activation).double()
    x = torch.randn(2, 3, 8, dtype=F64)
    up = x @ ffn.up_proj.weight.T + ffn.up_proj.bias
    if activation in ("swiglu", "geglu"):
        gate = x @ ffn.gate_proj.weight.T + ffn.gate_proj.bias
        h = (F.silu(gate) if activation == "swiglu" else F.gelu(gate)) * up
    else:
        assert ffn.gate_proj is None
        h = F.gelu(up) if activation == "gelu" else F.relu(up)
    want = h @ ffn.down_proj.weight.T + ffn.down_proj.bias
    assert torch.allclose(ffn(x), want, atol=1e-12)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_block_residual_paths(norm_first, norm):
    torch.manual_seed(1)
    cfg = TransformerConfig(d_model=16, n_heads=2, n_layers=1, norm=norm, norm_first=norm_first, activation="relu")
    block = TransformerBlock(cfg).double()
    x = torch.randn(2, 5, 16, dtype=F64)
    a = block.self_attn(block.attn_norm(x) if norm_first else x).out
    if norm_first:
        h = x + a
        want = h + block.ffn(block.ffn_norm(h))
    else:
        h = block.attn_norm(x + a)
        want = block.ffn_norm(h + block.ffn(h))
    assert torch.allclose(block(x), want, atol=1e-12)


def test_block_parameter_count():
    d, f = 32, 64
    cfg = TransformerConfig(d_model=d, n_heads=4, n_layers=1, d_ff=f, norm="layer", activation="gelu")
    block = TransformerBlock(cfg)
    attn = 4 * d * d + 4 * d
    ffn = 2 * d * f + f + d
    norms = 2 * 2 * d
    assert sum(p.numel() for p in block.parameters()) == attn + ffn + norms
    cross = TransformerBlock(cfg, causal=True, cross_attention=True)
    assert sum(p.numel() for p in cross.parameters()) == 2 * attn + ffn + 3 * 2 * d


def test_encoder_ignores_padding_content():
    torch.manual_seed(2)
    enc = TransformerEncoder(TransformerConfig(d_model=16, n_heads=2, position="learned",
                                               max_position_embeddings=16)).double()
    x = torch.randn(2, 7, 16, dtype=F64)
    y = x.clone()
    y[1, 4:] = torch.randn(3, 16, dtype=F64) * 5
    lengths = torch.tensor([7, 4])
    a, b = enc(x, lengths=lengths), enc(y, lengths=lengths)
    assert torch.allclose(a[1, :4], b[1, :4], atol=1e-12) and torch.allclose(a[0], b[0], atol=1e-12)
    assert not torch.allclose(enc(x)[1, :4], enc(y)[1, :4])


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal", "alibi", "t5", "shaw", "none"])
def test_decoder_is_causal(position):
    torch.manual_seed(3)
    dec = TransformerDecoder(TransformerConfig(d_model=16, n_heads=2, position=position,
                                               max_position_embeddings=32, shaw_max_distance=2)).double()
    x = torch.randn(1, 8, 16, dtype=F64)
    y = x.clone()
    y[:, 5:] += torch.randn(1, 3, 16, dtype=F64)
    assert torch.allclose(dec(x)[:, :5], dec(y)[:, :5], atol=1e-12)
    assert not torch.allclose(dec(x)[:, 5:], dec(y)[:, 5:])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_run(name):
    torch.manual_seed(4)
    cfg = get_config(name)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    if name in ("tiny-t5", "tiny-transformer", "tiny-encoder"):
        logits = EncoderDecoder(cfg)(ids, ids[:, :6], src_lengths=torch.tensor([10, 7]))
        assert logits.shape == (2, 6, cfg.vocab_size)
    else:
        lm = DecoderLM(cfg)
        assert isinstance(lm, DecoderModel)
        logits = lm(ids).logits
        assert logits.shape == (2, 10, cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt", "tiny-bloom", "tiny-gemma", "tiny-mistral"])
def test_decoder_lm_left_padding_with_positions(name):
    torch.manual_seed(5)
    overrides = {"sliding_window": 4} if PRESETS[name].sliding_window else {}  # a window shorter than the text
    lm = DecoderLM(get_config(name, **overrides)).double()
    ids = torch.randint(0, 256, (1, 9))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids), dim=1)
    positions = torch.cat((torch.full((1, 3), -1), torch.arange(9).unsqueeze(0)), dim=1)
    assert torch.allclose(lm(padded, positions=positions).logits[:, 3:], lm(ids).logits, atol=1e-10)
    mask = (positions >= 0).long()  # HF's padding mask gives the same positions
    assert torch.equal(lm(padded, mask).logits, lm(padded, positions=positions).logits)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt", "tiny-bloom"])
def test_decoder_lm_right_padding_mask(name):
    """A right-padded batch (training style): real tokens see only real tokens before them."""
    torch.manual_seed(5)
    lm = DecoderLM(get_config(name)).double()
    ids = torch.randint(0, 256, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    out = lm(ids, mask).logits
    assert torch.allclose(out[1, :4], lm(ids[1:, :4]).logits[0], atol=1e-10)
    assert torch.allclose(out[0], lm(ids[:1]).logits[0], atol=1e-10)


def test_decoder_lm_attention_mask_with_cache_and_bad_input():
    from qkv.cache import KVCache

    torch.manual_seed(5)
    lm = DecoderLM(get_config("tiny-llama")).double()
    ids = torch.randint(0, 256, (2, 8))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    full = lm(ids, mask).logits
    cache = KVCache(lm.cache_specs())
    first = lm(ids[:, :6], mask[:, :6], cache=cache)
    assert first.cache is cache and cache.seq_length == 6
    second = lm(ids[:, 6:], mask, cache=cache).logits  # the mask covers cached and new columns
    assert torch.allclose(second, full[:, 6:], atol=1e-10)
    with pytest.raises(ValueError, match="attention_mask must be"):
        lm(ids[:, :2], mask[:, :3], cache=cache)
    with pytest.raises(ValueError, match="not both"):
        lm(ids, mask, positions=torch.arange(8))
    with pytest.raises(ValueError, match="0 .padding. and 1"):
        lm(ids, mask * 2)
    with pytest.raises(TypeError, match="AttentionCache"):
        lm(ids, cache=object())
    with pytest.raises(ValueError, match="integer tensor"):
        lm(ids.float())
    with pytest.raises(ValueError, match="logits_to_keep"):
        lm(ids, logits_to_keep=-1)
    torch.testing.assert_close(lm(ids, logits_to_keep=2).logits, lm(ids).logits[:, -2:], rtol=0, atol=1e-11)


def test_decoder_lm_ties_embeddings():
    lm = DecoderLM(get_config("tiny-gpt"))
    assert lm.lm_head is None and "lm_head.weight" not in lm.state_dict()
    llama = DecoderLM(get_config("tiny-llama"))
    assert llama.lm_head.weight is not llama.embed_tokens.weight


def test_models_deepcopy_and_pickle():
    import copy
    import io

    lm = DecoderLM(get_config("tiny-llama", rope={"full_attention": RopeParams(scaling={"rope_type": "linear",
                                                                                       "factor": 2.0})}))
    twin = copy.deepcopy(lm)
    ids = torch.randint(0, 256, (1, 5))
    assert torch.equal(twin(ids).logits, lm(ids).logits)
    buf = io.BytesIO()
    torch.save(lm, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(ids).logits, lm(ids).logits)


def test_encoder_decoder_uses_source_lengths():
    torch.manual_seed(6)
    model = EncoderDecoder(get_config("tiny-t5", n_layers=1)).double()
    src = torch.randint(0, 256, (2, 8))
    tgt = torch.randint(0, 256, (2, 5))
    src2 = src.clone()
    src2[0, 5:] = (src2[0, 5:] + 1) % 256
    lengths = torch.tensor([5, 8])
    a, b = model(src, tgt, src_lengths=lengths), model(src2, tgt, src_lengths=lengths)
    assert torch.allclose(a, b, atol=1e-12)
    assert not torch.allclose(model(src, tgt), model(src2, tgt))


def test_config_hf_names_derived_fields_and_errors():
    hf = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 3,
          "intermediate_size": 200, "rms_norm_eps": 1e-6, "rope_theta": 5e5, "max_position_embeddings": 512,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 128}, "vocab_size": 100, "model_type": "llama"}
    cfg = TransformerConfig.from_dict(hf, strict=False)
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (96, 6, 2, 16, 200)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (
        96, 6, 2, 200)
    assert cfg.rope_params.rope_type == "llama3"
    rope = RotaryEmbedding.from_params(cfg.rope_params, cfg.head_dim, cfg.max_position_embeddings)
    assert (rope.rope_type, rope.theta, rope.rotary_dim) == ("llama3", 5e5, 16)
    with pytest.raises(ValueError, match="model_type"):
        TransformerConfig.from_dict(hf)
    wider = cfg.replace(hidden_size=192)
    assert (wider.d_model, wider.head_dim, wider.d_ff) == (192, 32, 200)  # head_dim derived again
    assert cfg.replace(n_layers=3) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 1
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        TransformerConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_window"):
        TransformerConfig(n_layers=2, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="did you mean 'tiny-llama'"):
        get_config("tiny-lama")
    with pytest.raises(ValueError, match="not causal"):
        TransformerEncoder(TransformerConfig(n_layers=1, sliding_window=4))


def test_decoder_config_derived_fields_and_errors():
    mistral = get_config("tiny-mistral")
    assert mistral.window_for(0) == 16
    assert mistral.replace(layer_types=None, sliding_window=None).window_for(0) is None
    wider = get_config("tiny-llama", hidden_size=128)
    assert (wider.head_dim, wider.num_key_value_heads) == (32, 2)  # head_dim derived again, kv heads kept
    assert get_config("tiny-llama").replace(num_hidden_layers=3).layer_types == ("full_attention",) * 3
    with pytest.raises(ValueError, match="did you mean 'hidden_size'"):
        get_config("tiny-llama", hiden_size=128)
    for bad, match in [(dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
                       (dict(hidden_act="tanh"), "hidden_act"), (dict(norm="batch"), "norm must be"),
                       (dict(position="sinusoidal"), "position must be"),
                       (dict(layer_types=("sliding_attention",) * 2), "sliding_window"),
                       (dict(num_hidden_layers=0), "positive int")]:
        with pytest.raises(ValueError, match=match):
            get_config("tiny-llama", **bad)
    with pytest.raises(TypeError, match="DecoderConfig"):
        DecoderLM(get_config("tiny-t5"))


@pytest.mark.parametrize("name", ["__init__", "attention", "norm", "ffn", "blocks", "transformer", "decoder",
                                  "moe", "activations"])
def test_docstring_examples_run(name):
    module = importlib.import_module("qkv.nn" if name == "__init__" else f"qkv.nn.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-bloom", "tiny-gemma", "mla", "mha"])
def test_attention_fn_hook_sees_every_call(name):
    """Replacing ``attention_fn`` on the attention modules routes every attention call through it (same
    output when the replacement calls qkv.attention), with rotated q/k and the modules' masks and scale."""
    import qkv
    from qkv.nn import LatentAttention, LatentConfig, MultiHeadAttention
    from qkv.pos import RotaryEmbedding

    torch.manual_seed(7)
    if name == "mla":
        model = LatentAttention(LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=16,
                                             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8))
        modules, run = [model], lambda: model(torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))).out
    elif name == "mha":
        model = MultiHeadAttention(32, 4, rope=RotaryEmbedding(8), causal=True)
        modules, run = [model], lambda: model(torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))).out
    else:
        model = DecoderLM(get_config(name)).eval()
        modules = [layer.self_attn for layer in model.layers]
        ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
        run = lambda: model(ids).logits  # noqa: E731
    want = run()
    calls = []

    def recording(q, k, v, **kw):
        calls.append((q.shape, kw.get("mask"), kw.get("scale")))
        return qkv.attention(q, k, v, **kw)

    for m in modules:
        m.attention_fn = recording
    assert torch.equal(run(), want)
    assert len(calls) == len(modules) and all(mask is not None for _, mask, _ in calls), calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 1, 512), (3, 7, 40), (2, 5), (4, 0, 8)])
def test_rms_norm_compiled_loop_within_budget(dtype, offset, shape, monkeypatch):
    """On the CPU without autograd an optimized RMSNorm (qkv.cpu.optimize) runs qkv's compiled loop (norms.cpp): within
    budget of the float64 definition, with torch's F.rms_norm as the baseline, for Llama's and Gemma's weight
    conventions, a strided input and an empty one; with the kernels off (QKV_CPU_KERNELS=0) it is torch's F.rms_norm
    itself."""
    import qkv.cpu
    from qkv.cpu import kernels

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(6)
    norm = qkv.cpu.optimize(RMSNorm(shape[-1], offset=offset, eps=1e-5).to(dtype))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 4).to(dtype)[..., ::2]  # strided
    xd, wd = x.double(), norm.weight.double() + offset
    want = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * wd
    with torch.inference_mode():
        got = norm(x)
        monkeypatch.setenv(kernels.ENV, "0")
        torch_path = norm(x)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(torch_path, F.rms_norm(x, (shape[-1],), offset + norm.weight, 1e-5))
    assert_within_budget(got, want, torch_path, what="compiled RMSNorm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 2752), (3, 7, 70), (2, 2), (4, 0, 8), (0, 16)])
def test_swiglu_gate_in_one_compiled_pass_equals_torch(dtype, shape, monkeypatch):
    """SwiGLU's silu(gate) * up over a fused gate-up projection runs as one pass of qkv's compiled kernels on the
    CPU without autograd (activations.cpp, qkv.cpu.fused.silu_gate): bit for bit torch's two ops (a vectorized
    body and a scalar tail, as torch computes them), a strided input and empty ones included; an optimized GatedMLP
    takes it. Under autograd, or with the kernels off, the torch ops run (and gradients flow)."""
    import qkv.cpu
    from qkv.cpu import kernels
    from qkv.cpu.fused import silu_gate
    from qkv.nn.activations import gated

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(9)
    h = (torch.randn(*shape[:-1], shape[-1] + 6, generator=g) * 5).to(dtype)[..., :shape[-1]]  # rows strided
    gate, up = h.chunk(2, dim=-1)
    with torch.inference_mode():
        got = gated(h, F.silu, silu_gate)
        assert silu_gate(h, F.silu) is not None or h.numel() == 0
        want = F.silu(gate) * up
    assert got.shape == want.shape and got.dtype == dtype and torch.equal(got, want)
    mlp = qkv.cpu.optimize(GatedMLP(8, 16).to(dtype), onednn=False)
    assert mlp.gate_kernel is silu_gate
    x = torch.randn(3, 8, generator=g).to(dtype)
    with torch.no_grad():
        fast = mlp(x)
        monkeypatch.setenv(kernels.ENV, "0")
        slow = mlp(x)
    assert torch.equal(fast, slow)
    monkeypatch.delenv(kernels.ENV)
    leaf = h.detach().clone().requires_grad_(True)
    assert silu_gate(leaf, F.silu) is None
    gated(leaf, F.silu, silu_gate).sum().backward()  # the torch ops: a gradient
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape


def test_compiled_kernels_are_named_in_profiles():
    """Kernels that run their own loops (no ATen call inside) are invisible to torch's profiler; while it records,
    qkv.cpu.kernels.profiled names them (qkv::rotary, qkv::silu_mul, qkv::rms_norm, qkv::decode_attention), so a
    profile's breakdown counts their time where it belongs rather than as Python's. Outside a profile nothing is
    recorded and the result is the same."""
    from torch.profiler import profile

    from qkv.cpu import kernels

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    model = DecoderLM(get_config("tiny-llama")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    from qkv.models import generate

    with torch.inference_mode():
        plain = generate(model, ids, max_new_tokens=3).new_tokens  # optimized: the compiled kernels swapped in
        with profile() as prof:
            traced = generate(model, ids, max_new_tokens=3).new_tokens
    names = {e.name for e in prof.events()}
    assert {"qkv::rotary", "qkv::silu_mul", "qkv::rms_norm", "qkv::decode_attention"} <= names, sorted(
        n for n in names if n.startswith("qkv::"))
    assert torch.equal(plain, traced)
