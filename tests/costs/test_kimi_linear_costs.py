"""The Kimi Linear 48B-A3B preset in the cost arithmetic: 20 KDA layers whose state is flat in the context beside 7
NoPE MLA layers whose latents grow with it, equal to what the cache planner allocates; parameter counts equal to the
built model's (the KDA mixer's own projections); the recurrent FLOPs of a decode step flat in the context."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkv.cache import RecurrentSpec, plan_memory
from qkv.config import ModelPreset
from qkv.costs import PRESETS, kv_cache_memory, model_attention_flops, model_flops, num_parameters
from qkv.costs.flops import recurrent_flops
from qkv.costs.memory import recurrent_state_bytes
from qkv.nn import DecoderLM, get_config

KIMI = PRESETS["kimi-linear-48b-a3b"]


def test_recurrent_state_is_flat_and_the_latents_grow():
    short, long = (kv_cache_memory(KIMI, context=c, batch=2) for c in (4096, 1 << 20))
    state = 32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2  # fp32 (Dk, Dv) per head, the bf16 convolution's last 3 inputs
    shape = KIMI.config.linear_attention.recurrent_shape()
    assert recurrent_state_bytes(KIMI) == state == RecurrentSpec(*shape).fixed_bytes(torch.bfloat16)
    assert short.by_layer_type["recurrent"] == long.by_layer_type["recurrent"] == 20 * 2 * state
    assert long.by_layer_type["global"] == 256 * short.by_layer_type["global"]
    assert short.bytes_per_token == 7 * (512 + 64) * 2  # only the 7 MLA layers cache tokens: latent + shared key part


@pytest.mark.parametrize("context", [4096, 65536])
def test_bytes_are_the_planned_cache(context):
    plan = plan_memory(KIMI, batch=2, context=context, dtype="bf16")
    ours = {g.kind: g for g in kv_cache_memory(KIMI, context=context, batch=2).layers}
    assert {layer.allocated_bytes for layer in plan.layers if layer.kind == "recurrent"} == {
        ours["recurrent"].bytes_per_layer}
    assert {layer.needed_bytes for layer in plan.layers if layer.kind == "latent"} == {ours["global"].bytes_per_layer}


def test_parameters_are_the_built_models():
    cfg = get_config("kimi-linear-48b-a3b", num_hidden_layers=4, vocab_size=100)  # full width, on the meta device
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.position == "none" and not cfg.latent.use_rope and cfg.linear_attention.mixer == "kda"
    with torch.device("meta"):
        lm = DecoderLM(cfg)
    assert num_parameters(ModelPreset.from_config(cfg)).total == sum(p.numel() for p in lm.parameters())
    full = num_parameters(KIMI)
    assert 48e9 < full.total < 50e9 and 3e9 < full.active < 4e9  # "48B total, 3B active" (49.1B counted)


def test_recurrent_flops_of_a_decode_step_are_flat():
    a, b = (model_attention_flops(KIMI, context=c) for c in (4096, 8192))
    step = 20 * recurrent_flops(KIMI, 1)
    assert step == 20 * 6 * 32 * 128 * 128
    assert b.decode - step == 2 * (a.decode - step)  # the MLA layers' decode grows with the context
    assert model_flops(KIMI, context=4096).decode.attention == a.decode


def test_bad_presets_are_refused():
    with pytest.raises(ValueError, match=r"needs position='none' \(its use_rope is False: NoPE\)"):
        dataclasses.replace(KIMI, config=KIMI.config.replace(position="rope"))
    with pytest.raises(ValueError, match="'linear_attention' layers and linear_attention .* go together"):
        dataclasses.replace(KIMI, config=KIMI.config.replace(linear_attention=None))
