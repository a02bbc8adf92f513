"""RecurrentSpec: one KVCache for a hybrid model (attention layers + recurrent layers): fixed bytes in the spec,
plan_memory and cache.memory(), decode through the cache equal to one call, crop and prefix sharing refused with
the layer named, fork and reorder copying the state."""

from __future__ import annotations

import pytest
import torch

from qkv.cache import H2O, Dynamic, FullSpec, KVCache, Paged, RecurrentSpec, SlidingWindowSpec, Static, plan_memory
from qkv.nn import GatedDeltaNet, Mamba2Mixer, RecurrentState


def _layer():
    torch.manual_seed(0)
    return GatedDeltaNet(32, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, dtype=torch.float64)


def test_spec_bytes_do_not_grow_with_context():
    spec = RecurrentSpec(conv_dim=32, conv_kernel=4, num_heads=2, head_k_dim=8, head_v_dim=8)
    conv, state = 32 * 3, 2 * 8 * 8
    assert spec.kind == "recurrent" and spec.bytes_per_token(torch.bfloat16) == 0
    assert spec.fixed_bytes(torch.bfloat16) == conv * 2 + state * 4  # the state accumulates in float32
    assert spec.fixed_bytes(torch.float64) == (conv + state) * 8
    assert spec.bytes_for(10, "bf16") == spec.bytes_for(10**6, "bf16") == spec.fixed_bytes("bf16")
    assert spec.tokens_for(10**6) == 0
    assert _layer().cache_spec() == spec
    with pytest.raises(ValueError, match=r"RecurrentSpec\(num_heads\) must be an int >= 1, got 0"):
        RecurrentSpec(64, 4, 0, 8, 8)


def test_plan_memory_hybrid_state_is_flat_and_matches_the_cache():
    rec = _layer().cache_spec()
    specs = [rec, rec, rec, FullSpec(2, 16)]  # Qwen3-Next's 3:1 pattern
    short = plan_memory(specs, batch=2, context=64, dtype=torch.float64)
    long = plan_memory(specs, batch=2, context=64_000, dtype=torch.float64)
    assert short.held_by_kind["recurrent"] == long.held_by_kind["recurrent"] == 3 * 2 * rec.fixed_bytes(torch.float64)
    assert long.held_by_kind["full"] == 1000 * short.held_by_kind["full"]
    assert [lay.tokens for lay in long.layers] == [0, 0, 0, 64_000]
    assert "recurrent" in str(long)
    # the plan's recurrent bytes are what a cache holds after a prefill
    layer = _layer()
    cache = KVCache(specs)
    x = torch.randn(2, 64, 32, dtype=torch.float64)
    for i in range(3):
        out, state = layer(x)
        cache.update_recurrent(i, state, tokens=64)
    k = torch.randn(2, 2, 64, 16, dtype=torch.float64)
    cache.update(3, k, k, positions=torch.arange(64).expand(2, 64))
    mem = cache.memory()
    assert [lay.kind for lay in mem.layers] == ["recurrent"] * 3 + ["full"]
    assert sum(lay.used_bytes for lay in mem.layers[:3]) == short.held_by_kind["recurrent"]
    assert cache.seq_length == 64


def test_decode_through_the_cache_equals_one_call():
    layer = _layer()
    spec = layer.cache_spec()
    cache = KVCache([SlidingWindowSpec(4, 2, 16), spec])
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    full = layer(x).out
    assert cache.recurrent_state(1) is None
    out, state = layer(x[:, :16], state=cache.recurrent_state(1))
    cache.update_recurrent(1, state, tokens=16)
    outs, before = [out], cache.memory().layers[1].used_bytes
    for t in range(16, 20):
        y, state = layer.step(x[:, t:t + 1], cache.recurrent_state(1))
        cache.update_recurrent(1, state, tokens=1)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.memory().layers[1].used_bytes == before  # the state does not grow
    assert isinstance(cache.recurrent_state(1), RecurrentState)


def test_crop_and_prefix_sharing_are_refused_naming_the_layer():
    layer = _layer()
    cache = KVCache([FullSpec(2, 16), layer.cache_spec()])
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 16, dtype=torch.float64)
    cache.update(0, k, k, positions=torch.arange(6)[None])
    cache.update_recurrent(1, layer(x).state, tokens=6)
    with pytest.raises(ValueError, match=r"crop\(4\): cannot drop 2 slots; nothing was changed\. layer 1 "
                                         r"\(RecurrentSpec\): a recurrent layer keeps one state"):
        cache.crop(4)
    assert cache.seq_length == 6 and cache.layer_tokens(0) == 6
    cache.crop(6)  # dropping nothing is fine
    paged = KVCache([FullSpec(2, 16), layer.cache_spec()], storage=Paged(block_size=4, num_blocks=16,
                                                                         prefix_caching=True))
    ids = torch.arange(8)[None]
    with pytest.raises(ValueError, match=r"match_prefix: layer 1 \(RecurrentSpec\) keep a recurrent state"):
        paged.match_prefix(ids, torch.arange(8)[None])


def test_fork_and_reorder_copy_the_state():
    layer = _layer()
    cache = KVCache([layer.cache_spec()])
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    state = layer(x).state
    cache.update_recurrent(0, state, tokens=5)
    cache.fork(2)
    forked = cache.recurrent_state(0)
    assert forked.recurrent.shape[0] == 4 and cache.batch == 4
    torch.testing.assert_close(forked.recurrent[0], forked.recurrent[1])
    torch.testing.assert_close(forked.recurrent[2], state.recurrent[1])
    forked.recurrent[0].zero_()  # a copy per row: the sibling and the original are untouched
    assert forked.recurrent[1].abs().sum() > 0 and state.recurrent[0].abs().sum() > 0
    cache.reorder(torch.tensor([3, 0]))
    torch.testing.assert_close(cache.recurrent_state(0).conv[0], state.conv[1])


def test_bad_updates_name_the_layer():
    mixer = Mamba2Mixer(16, num_heads=2, head_dim=8, state_size=4, dtype=torch.float64)
    cache = KVCache([FullSpec(1, 4), mixer.cache_spec()])
    state = mixer(torch.randn(2, 3, 16, dtype=torch.float64)).state
    with pytest.raises(ValueError, match=r"update_recurrent: layer 0 \(FullSpec\) cannot take update_recurrent"):
        cache.update_recurrent(0, state, tokens=3)
    with pytest.raises(ValueError, match=r"recurrent_state: layer 0 \(FullSpec\) cannot take recurrent_state"):
        cache.recurrent_state(0)
    with pytest.raises(ValueError, match=r"update: layer 1 \(RecurrentSpec\) cannot take update\(\)"):
        cache.update(1, torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), positions=torch.arange(3).expand(2, 3))
    with pytest.raises(ValueError, match=r"layer 1 \(RecurrentSpec\) .* got conv \(2, 3, 3\)"):
        cache.update_recurrent(1, RecurrentState(state.conv[:, :3], state.recurrent), tokens=3)
    with pytest.raises(TypeError, match=r"layer 1 \(RecurrentSpec\) takes its state as a pair of tensors"):
        cache.update_recurrent(1, state.recurrent, tokens=3)
    with pytest.raises(ValueError, match=r"tokens must be an int >= 0"):
        cache.update_recurrent(1, state, tokens=-1)
    cache.update_recurrent(1, state, tokens=3)
    with pytest.raises(ValueError, match=r"got batch 1 but the cache holds 2 rows"):
        cache.update_recurrent(1, RecurrentState(state.conv[:1], state.recurrent[:1]), tokens=1)


@pytest.mark.parametrize("storage, policy", [(Dynamic(), None), (Static(32), None), (Paged(block_size=4, num_blocks=32),
                                                                                    None), (Dynamic(), H2O(2, 2))],
                         ids=["dynamic", "static", "paged", "h2o"])
def test_every_storage_holds_a_hybrid_model(storage, policy):
    """The recurrent layer keeps its dense state whatever the storage or policy of the attention layers, and the
    plan's bytes for it equal what the cache holds."""
    layer = _layer()
    specs = [FullSpec(2, 16), layer.cache_spec()]
    cache = KVCache(specs, storage=storage, policy=policy)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    k = torch.randn(2, 2, 8, 16, dtype=torch.float64)
    cache.prepare(torch.zeros(2, 8, dtype=torch.long), torch.arange(8).expand(2, 8))
    cache.update(0, k, k, positions=torch.arange(8).expand(2, 8))
    cache.update_recurrent(1, layer(x).state, tokens=8)
    plan = plan_memory(specs, batch=2, context=8, dtype=torch.float64, storage=storage, policy=policy)
    assert cache.memory().layers[1].used_bytes == plan.layers[1].needed_bytes == plan.layers[1].allocated_bytes
    assert cache.seq_length == 8
