"""Costs of hybrid models' recurrent (``linear_attention``) layers, on the Kimi Linear 48B-A3B preset: the state is
flat in the context, equals what the cache planner (and so the built cache) allocates, and the recurrent FLOPs of a
decode step do not grow with the context; bad input is refused."""

from __future__ import annotations

import pytest

from qkv.cache import plan_memory
from qkv.costs import (
    PRESETS,
    gated_delta_flops,
    kv_cache_memory,
    model_attention_flops,
    model_flops,
    recurrent_state_bytes,
)

KIMI = PRESETS["kimi-linear-48b-a3b"]


def test_recurrent_state_is_flat_in_the_context():
    short, long = (kv_cache_memory(KIMI, context=c, batch=2) for c in (4096, 1 << 20))
    assert short.by_layer_type["recurrent"] == long.by_layer_type["recurrent"] == 20 * 2 * 2_170_880
    assert long.by_layer_type["global"] == 256 * short.by_layer_type["global"]  # MLA grows with the context
    assert short.bytes_per_token == 7 * (512 + 64) * 2  # only the 7 MLA layers cache tokens
    state = 32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2  # fp32 state per head, bf16 convolution inputs
    assert recurrent_state_bytes(KIMI) == state
    assert recurrent_state_bytes(KIMI, dtype="fp32") == state + 3 * 4096 * 3 * 2


@pytest.mark.parametrize("context", [4096, 65536])
def test_recurrent_bytes_are_the_planned_cache(context):
    """kv_cache_memory's per-layer bytes equal plan_memory's for the same preset (which the built cache allocates,
    tests/models' plan tests)."""
    plan = plan_memory(KIMI, batch=2, context=context, dtype="bfloat16")
    ours = {g.kind: g for g in kv_cache_memory(KIMI, context=context, batch=2).layers}
    assert {layer.allocated_bytes for layer in plan.layers if layer.kind == "recurrent"} == {
        ours["recurrent"].bytes_per_layer}
    assert {layer.needed_bytes for layer in plan.layers if layer.kind == "latent"} == {ours["global"].bytes_per_layer}


def test_recurrent_flops_decode_is_flat_and_prefill_linear():
    a, b = (model_attention_flops(KIMI, context=c) for c in (4096, 8192))
    step = 20 * gated_delta_flops(1, num_heads=32, head_k_dim=128, head_v_dim=128)
    mla = [f.decode - step for f in (a, b)]
    assert mla[1] == 2 * mla[0]  # the MLA layers' decode grows with the context, the recurrent layers' does not
    assert gated_delta_flops(8192, num_heads=32, head_k_dim=128, head_v_dim=128) == 8192 * step // 20
    assert model_flops(KIMI, context=4096).decode.attention == a.decode


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="'llama-3-8b' has no linear_attention layers"):
        recurrent_state_bytes(PRESETS["llama-3-8b"])
    with pytest.raises(ValueError, match="gated_delta_flops: head_k_dim must be"):
        gated_delta_flops(4, num_heads=2, head_k_dim=0, head_v_dim=8)
    import dataclasses

    with pytest.raises(ValueError, match="'linear_attention' layers and linear_attention .* go together; got 20"):
        dataclasses.replace(KIMI, linear_attention=None)
    with pytest.raises(ValueError, match="mla_use_nope describes MLA layers"):
        dataclasses.replace(KIMI, kv_lora_rank=None, qk_rope_head_dim=None, mla_use_nope=True)
