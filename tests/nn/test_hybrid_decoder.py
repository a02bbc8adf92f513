"""DecoderLM with recurrent (``linear_attention``) layers beside attention layers: one KVCache holds both, cached
decoding equals recomputation, padding leaves the recurrent state alone, the gated attention output, bad configs."""

from __future__ import annotations

import pytest
import torch

from qkv.cache import KVCache, RecurrentSpec
from qkv.models.generate import generate
from qkv.nn import DecoderConfig, DecoderLM, GatedDeltaNet, LatentConfig, LinearAttentionConfig, SplitGatedDeltaNet

LIN = LinearAttentionConfig(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=8)
TYPES = ("linear_attention", "linear_attention", "full_attention", "linear_attention")


def _config(**kw) -> DecoderConfig:
    base = dict(vocab_size=50, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, layer_types=TYPES, linear_attention=LIN, attn_output_gate=True, qk_norm=True)
    return DecoderConfig(**{**base, **kw})


def _model(**kw) -> DecoderLM:
    torch.manual_seed(0)
    lm = DecoderLM(_config(**kw)).double().eval()
    with torch.no_grad():  # gates away from 0 so that they matter
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return lm


def test_layers_and_cache_specs():
    lm = _model()
    assert [type(layer.mixer).__name__ if layer.recurrent else "attn" for layer in lm.layers] == [
        "GatedDeltaNet", "GatedDeltaNet", "attn", "GatedDeltaNet"]
    specs = lm.cache_specs()
    assert [s.kind for s in specs] == ["recurrent", "recurrent", "full", "recurrent"]
    assert specs[0] == lm.layers[0].linear_attn.cache_spec() == RecurrentSpec(2 * 2 * 8 + 4 * 8, 4, 4, 8, 8)
    split = _model(linear_attention=LinearAttentionConfig(**{**LIN.__dict__, "mixer": "gated_deltanet_split"}))
    assert isinstance(split.layers[0].linear_attn, SplitGatedDeltaNet)
    assert isinstance(lm.layers[0].linear_attn, GatedDeltaNet)
    assert lm.layers[2].self_attn.qkv_proj.out_features == (4 + 4 + 2 * 2) * 8  # q, k, v and the output gate


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_cached_decode_equals_recomputation(split):
    lin = LinearAttentionConfig(**{**LIN.__dict__, "mixer": "gated_deltanet_split" if split else "gated_deltanet"})
    lm = _model(linear_attention=lin)
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    full = lm(ids).logits
    cache = KVCache(lm.cache_specs())
    outs = [lm(ids[:, :5], cache=cache).logits, lm(ids[:, 5:8], cache=cache).logits]  # prefill in two pieces
    outs += [lm(ids[:, t:t + 1], cache=cache).logits for t in range(8, 11)]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-11)
    assert cache.seq_length == 11
    state = cache.recurrent_state(0)
    assert state.recurrent.shape == (2, 4, 8, 8) and state.conv.shape == (2, 64, 3)


def test_left_padding_does_not_reach_the_state():
    """A left-padded row gives the logits (and the next decode steps) of the same row without padding."""
    lm = _model()
    g = torch.Generator().manual_seed(2)
    short, long = torch.randint(1, 50, (1, 4), generator=g), torch.randint(1, 50, (1, 7), generator=g)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    cache = KVCache(lm.cache_specs())
    got = lm(batch, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(got[0, 3:], lm(short).logits[0], rtol=0, atol=1e-11)
    torch.testing.assert_close(got[1], lm(long).logits[0], rtol=0, atol=1e-11)
    nxt = torch.tensor([[5], [6]])
    step = lm(nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), cache=cache).logits
    torch.testing.assert_close(step[0, 0], lm(torch.cat([short, nxt[:1]], 1)).logits[0, -1], rtol=0, atol=1e-11)
    out = generate(lm, batch, attention_mask=mask, max_new_tokens=4)
    alone = generate(lm, short, max_new_tokens=4)
    assert torch.equal(out.new_tokens[0], alone.new_tokens[0])


def test_gate_and_padding_are_what_the_model_computes():
    """Without the output gate or the padding mask the results differ (the checks above can fail)."""
    lm = _model()
    ids = torch.randint(1, 50, (1, 6), generator=torch.Generator().manual_seed(3))
    attn = lm.layers[2].self_attn
    before = lm(ids).logits
    attn.output_gate = False
    with torch.no_grad():
        attn.qkv_proj.weight = torch.nn.Parameter(attn.qkv_proj.weight[:(4 + 2 * 2) * 8])
    assert (lm(ids).logits - before).abs().max() > 1e-3
    lm = _model()
    padded = torch.cat([torch.full((1, 2), 7), ids], 1)
    unmasked = lm(padded, positions=torch.arange(-2, 6).clamp_min(-1)[None])  # padding at -1: masked
    assert (unmasked.logits[0, 2:] - lm(ids).logits[0]).abs().max() < 1e-11
    pos = torch.cat([torch.full((2,), 0), torch.arange(6)])[None]  # the same tokens as real ones: they count
    assert (lm(padded, positions=pos).logits[0, 2:] - lm(ids).logits[0]).abs().max() > 1e-6


def test_recurrent_layers_refuse_crop_naming_the_layer_and_fork_copies():
    lm = _model()
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(4))
    cache = KVCache(lm.cache_specs())
    lm(ids, cache=cache)
    with pytest.raises(ValueError, match=r"layer 0 \(RecurrentSpec\): a recurrent layer keeps one state"):
        cache.crop(4)
    cache.fork(2)
    a = lm(torch.tensor([[3], [4]]), cache=cache).logits
    torch.testing.assert_close(a[0, 0], lm(torch.cat([ids, torch.tensor([[3]])], 1)).logits[0, -1], rtol=0,
                               atol=1e-11)
    torch.testing.assert_close(a[1, 0], lm(torch.cat([ids, torch.tensor([[4]])], 1)).logits[0, -1], rtol=0,
                               atol=1e-11)


def test_bad_configs_name_the_fields():
    with pytest.raises(ValueError, match=r"'linear_attention' layers and linear_attention .* go together; got 3"):
        _config(linear_attention=None)
    with pytest.raises(ValueError, match=r"go together; got 0 such layers"):
        _config(layer_types=("full_attention",) * 4)
    with pytest.raises(ValueError, match=r"layer_types must be one of .* got \['chunked_attention'\]"):
        _config(layer_types=("chunked_attention",) * 4)
    with pytest.raises(ValueError, match=r"attn_output_gate is not supported with latent attention"):
        _config(latent=LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=8, qk_nope_head_dim=8,
                                    qk_rope_head_dim=4, v_head_dim=8))
    with pytest.raises(ValueError, match=r"linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"):
        LinearAttentionConfig(linear_num_key_heads=2, linear_num_value_heads=3, linear_key_head_dim=8,
                              linear_value_head_dim=8)
    with pytest.raises(ValueError, match=r"mixer must be one of .* got 'mamba'"):
        LinearAttentionConfig(**{**LIN.__dict__, "mixer": "mamba"})
    with pytest.raises(ValueError, match=r"linear_key_head_dim must be a positive int, got 0"):
        LinearAttentionConfig(**{**LIN.__dict__, "linear_key_head_dim": 0})


def test_padding_between_real_tokens_is_refused():
    """Left padding of a fresh row and trailing padding are exact; padding after a row's earlier tokens is not."""
    lm = _model()
    ids = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(5))
    trailing = lm(ids, positions=torch.tensor([[0, 1, 2, -1, -1], [0, 1, 2, 3, 4]])).logits
    torch.testing.assert_close(trailing[0, :3], lm(ids[:1, :3]).logits[0], rtol=0, atol=1e-11)
    with pytest.raises(ValueError, match=r"layer 0 \(recurrent\) got padding \(position -1\) between real tokens "
                                         r"of row 0"):
        lm(ids, positions=torch.tensor([[0, -1, 1, 2, 3], [0, 1, 2, 3, 4]]))
    cache = KVCache(lm.cache_specs())
    lm(ids[:, :3], cache=cache)
    with pytest.raises(ValueError, match=r"between real tokens of row 1"):  # row 1 has a state already
        lm(ids[:, 3:], positions=torch.tensor([[3, 4], [-1, 3]]), cache=cache)
    assert cache.seq_length == 3  # refused before any layer wrote
