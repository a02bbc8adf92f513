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
    RMSNorm,
    TransformerBlock,
    TransformerConfig,
    TransformerDecoder,
    TransformerEncoder,
    get_config,
    rms_norm,
)

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
        logits = lm(ids)
        assert logits.shape == (2, 10, cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt", "tiny-bloom", "tiny-gemma", "tiny-mistral"])
def test_decoder_lm_left_padding_with_positions(name):
    torch.manual_seed(5)
    overrides = {"sliding_window": 4} if PRESETS[name].sliding_window else {}  # a window shorter than the text
    lm = DecoderLM(get_config(name, **overrides)).double()
    ids = torch.randint(0, 256, (1, 9))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids), dim=1)
    positions = torch.cat((torch.full((1, 3), -1), torch.arange(9).unsqueeze(0)), dim=1)
    assert torch.allclose(lm(padded, positions=positions)[:, 3:], lm(ids), atol=1e-10)


def test_decoder_lm_ties_embeddings_and_requires_positions_with_cache():
    lm = DecoderLM(get_config("tiny-gpt"))
    assert lm.lm_head.weight is lm.embed_tokens.weight
    llama = DecoderLM(get_config("tiny-llama"))
    assert llama.lm_head.weight is not llama.embed_tokens.weight
    with pytest.raises(ValueError, match="needs positions"):
        lm(torch.zeros(1, 3, dtype=torch.long), cache=object())


def test_models_deepcopy_and_pickle():
    import copy
    import io

    lm = DecoderLM(get_config("tiny-llama", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    twin = copy.deepcopy(lm)
    ids = torch.randint(0, 256, (1, 5))
    assert torch.equal(twin(ids), lm(ids))
    buf = io.BytesIO()
    torch.save(lm, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(ids), lm(ids))


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
    assert cfg.rotary_embedding().rope_type == "llama3"
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
    mistral = get_config("tiny-mistral")
    assert mistral.window_for(0) == 16 and mistral.replace(sliding_window=None).window_for(0) is None
    with pytest.raises(ValueError, match="not causal"):
        TransformerEncoder(mistral)


@pytest.mark.parametrize("name", ["__init__", "attention", "norm", "ffn", "blocks", "transformer", "config"])
def test_docstring_examples_run(name):
    module = importlib.import_module("qkv.nn" if name == "__init__" else f"qkv.nn.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, result
