"""Hybrid models (recurrent ``linear_attention`` layers beside attention) in the cost arithmetic, plan_memory and the
CLI: the recurrent state is a fixed number of bytes per sequence at any context, equal to what the KV cache holds;
the Qwen3-Next and Qwen3.5 presets equal HF transformers' config defaults they cite, and their parameter counts
equal the built model's."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from qkv.cache import KVCache, RecurrentSpec, plan_memory
from qkv.cli import _register, app
from qkv.config import DecoderConfig, ModelPreset, preset_from_hf_config
from qkv.costs import PRESETS, kv_cache_memory, model_attention_flops, num_parameters
from qkv.costs.flops import recurrent_flops
from qkv.costs.memory import recurrent_state_bytes
from qkv.nn import DecoderLM, get_config

HYBRIDS = ["qwen3-next-80b-a3b", "qwen3.5-9b"]
runner = CliRunner()


@pytest.fixture(scope="module", autouse=True)
def _commands():
    _register()


@pytest.mark.parametrize("name, cls", [("qwen3-next-80b-a3b", "Qwen3NextConfig"), ("qwen3.5-9b", "Qwen3_5TextConfig")])
def test_presets_are_the_transformers_defaults_they_cite(name, cls):
    transformers = pytest.importorskip("transformers")
    preset = PRESETS[name]
    assert f"transformers 5.25 {cls} defaults" in preset.source
    from_hf = preset_from_hf_config(getattr(transformers, cls)().to_dict(), name=name)
    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                  "layer_types", "linear_attention", "vocab_size", "moe", "max_position_embeddings",
                  "tie_word_embeddings", "attn_output_gate", "qk_norm"):
        assert getattr(from_hf.config, field) == getattr(preset.config, field), field
    assert from_hf.config == preset.config and from_hf.context_limit == preset.context_limit
    assert num_parameters(from_hf).total == num_parameters(preset).total
    n = preset.config.num_hidden_layers
    assert preset.layer_counts == {"global": n // 4, "recurrent": n * 3 // 4}


@pytest.mark.parametrize("name", HYBRIDS)
def test_parameter_count_equals_the_built_model(name):
    cfg = get_config(name, num_hidden_layers=4, hidden_size=64, intermediate_size=64, vocab_size=100)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with torch.device("meta"):
        lm = DecoderLM(cfg)
    assert num_parameters(ModelPreset.from_config(cfg)).total == sum(p.numel() for p in lm.parameters())


def test_published_sizes():
    nxt = num_parameters(PRESETS["qwen3-next-80b-a3b"])
    assert 79e9 < nxt.total < 81e9 and 3e9 < nxt.active < 4e9  # "80B total, 3B active"
    assert 8.5e9 < num_parameters(PRESETS["qwen3.5-9b"]).total < 9.5e9


@pytest.mark.parametrize("name", HYBRIDS)
def test_recurrent_state_does_not_grow_with_context_and_matches_the_cache(name):
    p = PRESETS[name]
    short, long = (kv_cache_memory(p, context=n, batch=2) for n in (4096, 262144))
    n_rec = p.layer_counts["recurrent"]
    state = recurrent_state_bytes(p, dtype="bf16")
    assert short.by_layer_type["recurrent"] == long.by_layer_type["recurrent"] == n_rec * 2 * state
    assert long.by_layer_type["global"] == 64 * short.by_layer_type["global"]
    assert state == RecurrentSpec(*p.config.linear_attention.recurrent_shape()).fixed_bytes(torch.bfloat16)
    assert short.bytes_per_token == p.layer_counts["global"] * 2 * p.config.num_key_value_heads * p.config.head_dim * 2
    for source in (name, p, p.config):  # the preset's plan, whatever describes it
        plans = [plan_memory(source, batch=2, context=n, dtype="bf16") for n in (4096, 262144)]
        assert plans[0].held_by_kind["recurrent"] == plans[1].held_by_kind["recurrent"] == n_rec * 2 * state
        assert plans[0].held_by_kind["full"] == short.by_layer_type["global"]


def test_plan_of_a_built_hybrid_equals_its_cache():
    cfg = get_config("qwen3-next-80b-a3b", num_hidden_layers=4, hidden_size=64, intermediate_size=64, vocab_size=100,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     linear_attention=PRESETS["qwen3.5-9b"].config.linear_attention.__class__(
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8),
                     moe=None)
    lm = DecoderLM(cfg).eval()
    cache = KVCache(lm.cache_specs())
    with torch.no_grad():
        lm(torch.randint(0, 100, (2, 9)), cache=cache)
    plan = plan_memory(lm, batch=2, context=9)
    mem = cache.memory()
    assert [lay.used_bytes for lay in mem.layers] == [lay.needed_bytes for lay in plan.layers]
    assert [lay.kind for lay in plan.layers] == ["recurrent"] * 3 + ["full"]


def test_recurrent_layers_count_their_own_flops():
    p = PRESETS["qwen3-next-80b-a3b"]
    f4, f8 = (model_attention_flops(p, context=n) for n in (4096, 8192))
    rec = p.layer_counts["recurrent"]
    assert recurrent_flops(p, 1) == 6 * 32 * 128 * 128
    attn_only = ModelPreset(config=DecoderConfig(name="attn", num_hidden_layers=12, num_attention_heads=16,
                                                 num_key_value_heads=2, head_dim=256, hidden_size=2048,
                                                 vocab_size=None, intermediate_size=None))
    a4, a8 = (model_attention_flops(attn_only, context=n) for n in (4096, 8192))
    assert f4.decode - a4.decode == f8.decode - a8.decode == rec * recurrent_flops(p, 1)  # flat in the context
    assert f4.prefill - a4.prefill == rec * recurrent_flops(p, 4096)
    with pytest.raises(ValueError, match=r"recurrent_flops: llama-3-8b has no recurrent"):
        recurrent_flops(PRESETS["llama-3-8b"], 1)
    with pytest.raises(ValueError, match=r"recurrent_state_bytes: llama-3-8b has no recurrent"):
        recurrent_state_bytes(PRESETS["llama-3-8b"])


def test_preset_refuses_linear_layers_without_their_shape():
    with pytest.raises(ValueError, match=r"'linear_attention' layers and linear_attention .* got 1 such layers"):
        ModelPreset(config=DecoderConfig(name="x", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, hidden_size=64, vocab_size=None, intermediate_size=None,
                                         layer_types=("linear_attention", "full_attention")))


def test_cli_memory_and_compare_show_the_fixed_state():
    r = runner.invoke(app, ["memory", "qwen3-next-80b-a3b", "--context", "32k"])
    assert r.exit_code == 0, r.output
    assert "12 global, 36 recurrent" in r.stdout and "fixed state" in r.stdout and "77.27 MB" in r.stdout
    states = []
    for ctx in ("4k", "128k"):
        r = runner.invoke(app, ["memory", "qwen3-next-80b-a3b", "--context", ctx, "--json"])
        assert r.exit_code == 0, r.output
        states.append(json.loads(r.stdout)["by_layer_type"]["recurrent"])
    assert states[0] == states[1] == 77266944
    r = runner.invoke(app, ["compare", "qwen3-next-80b-a3b", "qwen3.5-9b", "llama-3-8b", "--context", "8k"])
    assert r.exit_code == 0, r.output
    assert "+36" in r.stdout and "recurrent" in r.stdout and "51.51 MB" in r.stdout and "fixed state" in r.stdout
    r = runner.invoke(app, ["presets"])
    assert "qwen3-next-80b-a3b" in r.stdout and "qwen3.5-9b" in r.stdout and "79.67B" in r.stdout


def test_multimodal_qwen3_5_configs_are_read_from_their_text_config():
    transformers = pytest.importorskip("transformers")
    dense = preset_from_hf_config(transformers.Qwen3_5Config().to_dict())
    assert dense.config.layer_types == PRESETS["qwen3.5-9b"].config.layer_types
    assert dense.config.linear_attention == PRESETS["qwen3.5-9b"].config.linear_attention
    assert num_parameters(dense).total == num_parameters(PRESETS["qwen3.5-9b"]).total
    moe = preset_from_hf_config(transformers.Qwen3_5MoeConfig().to_dict())
    assert moe.layer_counts == {"global": 10, "recurrent": 30} and moe.config.moe.shared_expert_gate
    counts = num_parameters(moe)  # documented as the Qwen3.5-35B-A3B configuration
    assert 34e9 < counts.total < 36e9 and 3e9 < counts.active < 4e9
    plan = plan_memory(transformers.Qwen3_5MoeConfig().to_dict(), context=1000)
    assert plan.held_by_kind["recurrent"] == 30 * recurrent_state_bytes(moe, dtype="bf16")
