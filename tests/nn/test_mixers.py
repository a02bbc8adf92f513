"""The mixer registry (qkv.config.mixers, qkv.nn.mixers): for every kind of layer, the declared module, cache spec,
parameter count and FLOP count agree with the module and the model built from the same config; bad use of the
registry raises clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from qkv.cache.describe import cache_specs_of, spec_of
from qkv.config import IndexerConfig, ModelPreset
from qkv.config.mixers import MIXERS, MixerKind, get_mixer, mixer_of, register_mixer
from qkv.costs.flops import attention_flops, recurrent_flops
from qkv.costs.params import num_parameters
from qkv.nn import DecoderConfig, DecoderLM, get_config
from qkv.nn.decoder import DecoderLayer
from qkv.nn.mixer import DecoderMixer
from qkv.nn.mixers import MIXER_MODULES, build_mixer, mixer_module, register_mixer_module

_SMALL = dict(hidden_size=64, num_attention_heads=4, intermediate_size=64, vocab_size=64, moe=None)

#: One small config per situation a kind meets: (test id, config, the kind each layer must be).
CASES = {
    "llama-gqa": (get_config("tiny-llama"), ["attention"] * 2),
    "gemma-sliding-qknorm": (get_config("tiny-gemma"), ["attention"] * 4),
    "gpt-biases": (get_config("tiny-gpt"), ["attention"] * 2),
    "gpt-oss-sinks": (get_config("gpt-oss-20b", num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                 sliding_window=8, **_SMALL), ["attention"] * 2),
    "olmo3-projection-qknorm": (get_config("olmo-3-7b", num_hidden_layers=4, num_key_value_heads=4, head_dim=16,
                                           sliding_window=8, **_SMALL), ["attention"] * 4),
    "deepseek-v2-mla": (get_config("deepseek-v2", num_hidden_layers=2, **_SMALL), ["mla"] * 2),
    "mla-biases-no-qlora": (get_config("deepseek-v2", num_hidden_layers=1, **_SMALL).replace(latent=dataclasses.replace(
        get_config("deepseek-v2", num_hidden_layers=1, **_SMALL).latent, attention_bias=True, q_lora_rank=None)),
        ["mla"]),
    "deepseek-v3.2-dsa": (get_config("deepseek-v3.2", num_hidden_layers=2, **_SMALL).replace(
        indexer=IndexerConfig(index_n_heads=2, index_head_dim=64, index_topk=4)), ["dsa"] * 2),
    "qwen3-next-gdn-gated-attn": (get_config("qwen3-next-80b-a3b", num_hidden_layers=4, num_key_value_heads=2,
                                             head_dim=16, **_SMALL),
                                  ["gated_deltanet"] * 3 + ["attention"]),
    "qwen3.5-gdn-split": (get_config("qwen3.5-9b", num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                                     **_SMALL), ["gated_deltanet_split"] * 3 + ["attention"]),
    "kimi-kda-mla-nope": (get_config("kimi-linear-48b-a3b", num_hidden_layers=4, **_SMALL),
                          ["kda"] * 3 + ["mla"]),
}


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("case", list(CASES))
def test_each_layer_kind_agrees_with_its_built_module(case):
    c, kinds = CASES[case]
    assert [mixer_of(c, i).name for i in range(c.num_hidden_layers)] == kinds
    specs = cache_specs_of(c)
    for i in range(c.num_hidden_layers):
        kind = mixer_of(c, i)
        mixer = build_mixer(c, i, None)
        assert isinstance(mixer, MIXER_MODULES[kind.name]) and isinstance(mixer, DecoderMixer), type(mixer)
        assert mixer.layer_idx == i
        got = sum(p.numel() for p in mixer.parameters())
        assert kind.params(c) == got, f"{case} layer {i} ({kind.name}): declared {kind.params(c)}, built {got}"
        assert kind.weights(c) == _linear_weights(mixer), f"{case} layer {i} ({kind.name}): projection weights"
        assert spec_of(kind.cache(c, i)) == specs[i]
        if kind.name != "attention":  # the other mixers state their own spec too
            assert mixer.cache_spec() == specs[i]
        assert kind.window(c, i) == (c.window_for(i) if kind.name == "attention" else None)


@pytest.mark.parametrize("case", ["llama-gqa", "gemma-sliding-qknorm", "qwen3-next-gdn-gated-attn",
                                  "kimi-kda-mla-nope", "deepseek-v2-mla"])
def test_a_built_model_holds_what_the_registry_declares(case):
    c, kinds = CASES[case]
    lm = DecoderLM(c)
    assert [layer.kind for layer in lm.layers] == kinds
    assert [layer.recurrent for layer in lm.layers] == [get_mixer(k).recurrent for k in kinds]
    for i, layer in enumerate(lm.layers):  # held under HF's name for its kind, and nowhere else
        kind = get_mixer(layer.kind)
        assert getattr(layer, kind.attribute) is layer.mixer
        assert sum(p.numel() for p in layer.mixer.parameters()) == kind.params(c)
        others = {"self_attn", "linear_attn"} - {kind.attribute}
        assert not any(hasattr(layer, name) for name in others), f"layer {i} holds a second mixer"
    assert lm.cache_specs() == [spec_of(mixer_of(c, i).cache(c, i)) for i in range(c.num_hidden_layers)]
    if c.moe is None and c.position != "learned":  # the whole count, through qkv.costs, equals the built model's
        total = sum(p.numel() for p in lm.parameters())
        assert num_parameters(ModelPreset.from_config(c)).total == total


@pytest.mark.parametrize("case,layer", [("llama-gqa", 0), ("gpt-biases", 1), ("qwen3-next-gdn-gated-attn", 3),
                                        ("deepseek-v2-mla", 0)])
def test_attention_flops_are_torchs_count_of_the_built_mixer(case, layer):
    """The reference backend scores every (query, key) pair and masks afterwards (MLA on its expanded path), so torch's
    own count of one uncached forward over N tokens is the projections, 2 N weights, plus N^2 pairs per sequence."""
    from qkv.nn.decoder import _ForwardContext

    c = CASES[case][0].replace(backend="reference", decode_backend=None)
    lm = DecoderLM(c).eval()
    for table in lm.ropes.values():
        table.reserve(64)
    mixer, kind = lm.layers[layer].mixer, mixer_of(c, layer)
    if kind.name == "mla":
        mixer.path = "expanded"
    B, N = 2, 7
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        mixer.mix(torch.randn(B, N, c.hidden_size), _ForwardContext(None, None, N, torch.float32))
    assert counter.get_total_flops() == B * (2 * N * kind.weights(c) + N * N * kind.pair_flops(c))
    if kind.name == "attention":
        assert B * N * N * kind.pair_flops(c) == attention_flops(B, c.num_attention_heads, N, N, c.head_dim)


def test_recurrent_token_flops_are_the_delta_rule_count():
    c, _ = CASES["qwen3-next-gdn-gated-attn"]
    lin = c.linear_attention
    assert get_mixer("gated_deltanet").token_flops(c) == 6 * lin.linear_num_value_heads * lin.linear_key_head_dim \
        * lin.linear_value_head_dim == recurrent_flops(ModelPreset.from_config(c), 1)
    for name in ("attention", "mla", "dsa"):
        assert get_mixer(name).token_flops(c) == 0
    assert get_mixer("kda").pair_flops(c) == get_mixer("gated_deltanet").pair_flops(c) == 0


def test_mixer_of_refuses_a_layer_outside_the_model():
    c = get_config("tiny-llama")
    for bad in (-1, 2, "0", True):
        with pytest.raises(ValueError, match=r"mixer_of: layer_idx must be an int in \[0, 2\), got"):
            mixer_of(c, bad)


def test_unknown_mixer_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown mixer kind 'mamba3'; registered: attention, mla, dsa"):
        get_mixer("mamba3")
    with pytest.raises(ValueError, match=r"unknown mixer kind 'mamba3': no module registered \(registered: attention"):
        mixer_module("mamba3")
    with pytest.raises(ValueError, match=r"no mixer kind 'mamba3' in qkv.config.mixers.MIXERS"):
        register_mixer_module("mamba3", nn.Linear)


def test_duplicate_registration_is_refused():
    attention = get_mixer("attention")
    with pytest.raises(ValueError, match=r"a mixer named 'attention' is already registered"):
        register_mixer(attention)
    with pytest.raises(TypeError, match=r"kind must be a qkv.config.mixers.MixerKind, got dict"):
        register_mixer({"name": "x"})
    with pytest.raises(ValueError, match=r"the mixer kind 'mla' already has a module, LatentAttention"):
        register_mixer_module("mla", MIXER_MODULES["attention"])
    assert set(MIXER_MODULES) == set(MIXERS)  # both halves name the same kinds


@pytest.fixture
def registries():
    """The registries' contents restored after the test (they are module-level, shared by every test)."""
    from qkv.config import mixers as spec_mixers
    from qkv.nn import mixers as nn_mixers

    saved = [(d, d.copy()) for d in (spec_mixers._MIXERS, nn_mixers._MODULES)]
    yield
    for live, copy in saved:
        live.clear()
        live.update(copy)


def test_a_new_kind_is_a_registry_entry_and_a_module(registries):
    """What adding a kind of layer takes: a MixerKind, a module following DecoderMixer, one line each."""
    base = get_mixer("gated_deltanet")
    register_mixer(MixerKind(name="toy_recurrent", attribute="linear_attn", cache=base.cache, params=base.params,
                             weights=base.weights, pair_flops=base.pair_flops, token_flops=base.token_flops,
                             window=base.window, recurrent=True))
    with pytest.raises(TypeError, match=r"does not follow qkv.nn.mixer.DecoderMixer \(missing for_decoder, mix"):
        register_mixer_module("toy_recurrent", nn.Linear)

    class Toy(MIXER_MODULES["gated_deltanet"]):
        pass

    register_mixer_module("toy_recurrent", Toy)
    c0, _ = CASES["qwen3-next-gdn-gated-attn"]
    c = DecoderConfig(**{**{k: getattr(c0, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                          "num_attention_heads", "num_key_value_heads", "head_dim",
                                                          "intermediate_size", "layer_types")},
                         "linear_attention": c0.linear_attention.__class__(
                             **{**c0.linear_attention.__dict__, "mixer": "toy_recurrent"})})
    layer = DecoderLayer(c, 0, None)
    assert type(layer.linear_attn) is Toy and layer.recurrent and layer.kind == "toy_recurrent"
