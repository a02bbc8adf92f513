"""K = V layers cached once (``values_only`` specs): where one projection gives keys and values (Gemma 4's global
layers), the cache stores the values and the layer derives its keys from them each step (the key norm's scale,
then RoPE at the stored positions), half the bytes of a key-and-value store.

Checked: the bytes (specs, the planner, the allocated stores) are half on those layers; a model decodes the same
tokens with the same logits as with keys stored apart (float64: to rounding), cached decoding equals recomputation on
every storage with crop, fork and prefix reuse (``verify_cache``), shared layers read the derived keys; bad specs and
calls are refused, as are eviction policies and quantizers, which keep keys of their own."""

from __future__ import annotations

import copy

import pytest
import torch

from qkv.cache import (
    H2O,
    KIVI,
    Dynamic,
    FullSpec,
    KVCache,
    Paged,
    SlidingWindowSpec,
    Static,
    plan_memory,
)
from qkv.models import verify_cache
from qkv.nn import DecoderConfig, DecoderLM

_S, _F = "sliding_attention", "full_attention"


def _config(**changes) -> DecoderConfig:
    """A small Gemma-4-like decoder: K = V on global layers (their own heads), QK and value norms, proportional RoPE
    on global layers, the last two layers reading earlier ones' caches."""
    from qkv.config.rope import RopeParams

    base = dict(vocab_size=97, hidden_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                head_dim=12, intermediate_size=64, hidden_act="gelu_pytorch_tanh", sandwich_norms=True, qk_norm=True,
                attention_scale=1.0, value_norm=True, sliding_window=4,
                layer_types=(_S, _F, _S, _F, _S, _F),
                rope={_S: RopeParams(theta=10000.0),
                      _F: RopeParams(theta=1e6, scaling={"rope_type": "proportional"}, partial_rotary_factor=0.25)},
                head_dim_by_type={_F: 16}, kv_heads_by_type={_F: 1}, k_eq_v_types=(_F,),
                kv_shared_from=(None, None, None, None, 2, 3))
    return DecoderConfig(**{**base, **changes})


def _model(dtype=torch.float64, **changes) -> DecoderLM:
    torch.manual_seed(0)
    model = DecoderLM(_config(**changes)).to(dtype).eval()
    with torch.no_grad():  # norms away from 1, so that a key derived without the key norm's scale shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, dtype=torch.float64))
    return model


def test_specs_store_values_only_on_k_eq_v_layers_and_count_half():
    model = _model()
    specs, both = model.cache_specs(), model.cache_specs(values_only=False)
    assert [getattr(s, "values_only", False) for s in specs] == [False, True, False, True, False, False]
    assert not any(getattr(s, "values_only", False) for s in both)
    for one, two in zip(specs, both):
        if getattr(one, "values_only", False):
            assert 2 * one.row_bytes(torch.bfloat16) == two.row_bytes(torch.bfloat16) == 2 * 1 * 16 * 2
    plan, plan2 = (plan_memory(s, batch=2, context=40, dtype=torch.float32) for s in (specs, both))
    global_layers = [1, 3]
    assert sum(plan2.layers[i].needed_bytes for i in global_layers) == 2 * sum(plan.layers[i].needed_bytes
                                                                                for i in global_layers)


@pytest.mark.parametrize("storage", [Dynamic(), Static(64), Paged(block_size=4, num_blocks=64, prefix_caching=True)],
                         ids=["dynamic", "static", "paged"])
def test_cached_decode_equals_recompute_through_values_only_layers(storage):
    """Crop, fork and prefix reuse through layers storing values only, and through shared layers reading them."""
    model = _model()
    report = verify_cache(model, lambda: KVCache(model.cache_specs(), storage=storage, rollback=2),
                          prompt_lengths=(11, 6),
                          max_new_tokens=5)
    names = {c.name for c in report.checks}
    assert report.ok and {"decode", "crop", "fork"} <= names
    assert ("prefix" in names) == isinstance(storage, Paged)


def test_values_only_cache_gives_the_logits_of_keys_stored_apart():
    """The same model decoded with either cache: float64 logits equal to rounding, the stored bytes halve on the
    K = V layers (what the allocated stores hold, not only what the specs say)."""
    model = _model()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 97, (2, 9), generator=gen)
    outs, used = [], []
    for values_only in (True, False):
        cache = KVCache(model.cache_specs(values_only=values_only))
        with torch.no_grad():
            steps = [model(ids[:, :5], cache=cache).logits]
            steps += [model(ids[:, t:t + 1], cache=cache).logits for t in range(5, 9)]
        outs.append(torch.cat(steps, dim=1))
        used.append([m.used_bytes for m in cache.memory().layers])
    assert torch.allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        assert torch.allclose(outs[0], model(ids).logits, rtol=1e-10, atol=1e-10)
    assert [2 * used[0][i] for i in (1, 3)] == [used[1][i] for i in (1, 3)] and used[0][0] == used[1][0]


def test_derived_keys_need_the_key_norm_scale():
    """Perturbing the key norm's weight moves the cached logits (the derivation reads it, not a copy)."""
    model = _model()
    ids = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(ids, cache=KVCache(model.cache_specs())).logits
        model.layers[1].self_attn.k_norm.weight.mul_(1.5)
        after = model(ids, cache=KVCache(model.cache_specs())).logits
        assert torch.allclose(after, model(ids).logits, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(before, after)


def test_float32_and_bfloat16_models_decode_within_budget():
    """Cached decoding in float32 and bfloat16 (values stored in the model's dtype, the keys derived from them)
    within the error budget of the float64 logits, the baseline the same model without a cache."""
    from qkv.testing import assert_within_budget

    ref = _model()
    ids = torch.randint(1, 97, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        truth = ref(ids).logits
    for dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(ref).to(dtype)
        cache = KVCache(model.cache_specs())
        with torch.no_grad():
            out = torch.cat([model(ids[:, :4], cache=cache).logits]
                            + [model(ids[:, t:t + 1], cache=cache).logits for t in range(4, 8)], dim=1)
            baseline = model(ids).logits
        assert_within_budget(out, truth, baseline, what=f"{dtype} cached logits")


def test_no_k_norm_layers_store_the_shared_tensor_and_value_norm_alone_does_not():
    """Without QK and value norms keys and values are one tensor (values only); a value norm without a key norm
    makes them differ in scale, so both are stored."""
    plain = _model(qk_norm=False, value_norm=False)
    assert [getattr(s, "values_only", False) for s in plain.cache_specs()][1]
    assert verify_cache(plain, lambda: KVCache(plain.cache_specs(), rollback=2), max_new_tokens=3).ok
    mixed = _model(qk_norm=False, value_norm=True)
    assert not any(getattr(s, "values_only", False) for s in mixed.cache_specs())


@pytest.mark.parametrize("make, match", [
    (lambda: FullSpec(2, 8, 4, True), "one width"),
    (lambda: SlidingWindowSpec(4, 2, 8, None, 1), "must be a bool"),
], ids=["widths-differ", "not-a-bool"])
def test_bad_specs_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_calls_and_unsupported_combinations_are_refused():
    model = _model(kv_shared_from=None)  # (eviction policies refuse KV sharing on their own)
    specs = model.cache_specs()
    for extra in ({"policy": H2O(heavy=2, recent=2)}, {"quant": KIVI(bits=4, group_size=8)}):
        with pytest.raises(ValueError, match=r"values_only=False"):
            KVCache(specs, **extra)
        KVCache(model.cache_specs(values_only=False), **extra)  # keys stored apart: accepted
    with pytest.raises(ValueError, match=r"values_only=False"):
        plan_memory(specs, context=8, quant=KIVI(bits=4, group_size=8))
    cache = KVCache([FullSpec(1, 8, None, True)])
    v, pos = torch.randn(1, 1, 3, 8), torch.arange(3)[None]
    with pytest.raises(ValueError, match="keys_from_values"):
        cache.update(0, v, v, positions=pos)
    with pytest.raises(ValueError, match="shaped like the values"):
        cache.update(0, None, v, positions=pos, keys_from_values=lambda vals, p: vals[..., :4])
    assert cache.seq_length == 0  # refused before anything was written
    view = cache.update(0, None, v, positions=pos, keys_from_values=lambda vals, p: 2 * vals)
    assert torch.equal(view.k, 2 * v) and torch.equal(view.v, v) and cache.values_only(0)
    with pytest.raises(TypeError, match="values_only must be a bool"):
        model.cache_specs(values_only="yes")


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("factor", [0.25, 1.0], ids=["quarter-turns", "all-turn"])
def test_derived_keys_turn_like_the_stored_ones_for_every_rope_layout(interleaved, factor):
    """Keys derived from stored values equal the keys a two-tensor cache stores, whichever pairs turn (proportional
    RoPE: the first quarter; plain: all) and however pairs are laid out (halves or adjacent channels)."""
    from qkv.config.rope import RopeParams

    rope = {_S: RopeParams(theta=10000.0, interleaved=interleaved),
            _F: RopeParams(theta=1e4, scaling={"rope_type": "proportional"}, partial_rotary_factor=factor,
                           interleaved=interleaved)}
    model = _model(rope=rope, kv_shared_from=None)
    ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(6))
    outs = []
    for values_only in (True, False):
        cache = KVCache(model.cache_specs(values_only=values_only))
        with torch.no_grad():
            outs.append(torch.cat([model(ids[:, :6], cache=cache).logits]
                                  + [model(ids[:, t:t + 1], cache=cache).logits for t in range(6, 11)], dim=1))
    assert torch.allclose(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    assert model.layers[1].self_attn.rope.emb.turning_pairs == (2 if factor < 1 else 8)
