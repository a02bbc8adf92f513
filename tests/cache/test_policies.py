"""Eviction policies: StreamingLLM sinks with in-cache RoPE positions, H2O heavy hitters from exact
accumulated attention, SnapKV observation-window voting per head."""

from __future__ import annotations

import pytest
import torch

from _toy_lm import rope, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import H2O, FullSpec, KVCache, SnapKV, StreamingLLM


def _kept(cache, layer=0):
    """Absolute positions each head holds: (B, H, S) with -1 for empty slots."""
    store = cache._layers[layer].store
    store = getattr(store, "inner", store)
    return store.pos[:, :, :store.end]


def test_streaming_keeps_sinks_and_window_rotated_in_cache():
    cache = KVCache([FullSpec(1, 8)], policy=StreamingLLM(n_sink=2, window=5))
    ks = torch.randn(1, 1, 20, 8)
    for t in range(20):
        view = cache.update(0, ks[:, :, t:t + 1], ks[:, :, t:t + 1], positions=torch.tensor([[t]]), rope=rope)
        expect = list(range(t + 1)) if t < 7 else [0, 1] + list(range(t - 4, t + 1))
        assert _kept(cache)[0, 0].tolist() == expect
        assert view.kv_positions[0].tolist() == list(range(len(expect)))  # positions inside the cache
        assert view.q_positions.tolist() == [[len(expect) - 1]]
        assert torch.allclose(view.k, rope(ks[:, :, expect], torch.arange(len(expect)).view(1, -1)), atol=1e-6)
    assert cache.specs[0].kind == "sink" and cache.layer_tokens(0) == 7


def test_streaming_sinks_skip_left_padding():
    cache = KVCache([FullSpec(1, 8)], policy=StreamingLLM(n_sink=2, window=3))
    pos = torch.tensor([[-1, -1, -1, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    cache.update(0, torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8), positions=pos)
    view = cache.update(0, torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8), positions=torch.tensor([[3], [6]]))
    kept = _kept(cache)[:, 0]
    assert sorted(p for p in kept[0].tolist() if p >= 0) == [0, 1, 2, 3]
    assert sorted(kept[1].tolist()) == [0, 1, 4, 5, 6]
    assert view.q_positions.tolist() == [[3], [4]]


def _aligned(H, n, targets, D=8, scale=6.0, seed=0):
    """Keys with a distinct direction at ``targets[h]`` per head, and queries pointing at it."""
    g = torch.Generator().manual_seed(seed)
    k = 0.1 * torch.randn(1, H, n, D, generator=g)
    q = 0.1 * torch.randn(1, H, n, D, generator=g)
    for h, t in enumerate(targets):
        u = torch.zeros(D)
        u[h] = 1.0
        k[0, h, t] = u * scale
        q[0, h] = q[0, h] + u * scale
    return q, k


def test_h2o_scores_are_accumulated_attention():
    cache = KVCache([FullSpec(2, 8)], policy=H2O(heavy=50, recent=50))
    q, k = _aligned(2, 12, [3, 7])
    v = torch.randn(1, 2, 12, 8)
    cache.update(0, k[:, :, :8], v[:, :, :8], positions=torch.arange(8).view(1, 8))
    cache.observe(0, q[:, :, :8])
    for t in range(8, 12):
        cache.update(0, k[:, :, t:t + 1], v[:, :, t:t + 1], positions=torch.tensor([[t]]))
        cache.observe(0, q[:, :, t:t + 1])
    s = (q.double() @ k.double().transpose(-1, -2)) * 8 ** -0.5
    s = s.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    expect = s.softmax(-1).sum(2)  # (1, H, 12): attention each key received from every query
    got = cache._layers[0].store.score[:, :, :12]
    assert torch.allclose(got.double(), expect, atol=1e-5)


def test_h2o_keeps_heavy_hitters_per_head():
    cache = KVCache([FullSpec(2, 8)], policy=H2O(heavy=1, recent=3))
    q, k = _aligned(2, 14, [3, 5])
    v = torch.randn(1, 2, 14, 8)
    for t in range(14):
        cache.update(0, k[:, :, t:t + 1], v[:, :, t:t + 1], positions=torch.tensor([[t]]))
        cache.observe(0, q[:, :, t:t + 1])
    kept = _kept(cache)[0]
    assert kept[0].tolist() == [3, 11, 12, 13] and kept[1].tolist() == [5, 11, 12, 13]
    view = cache.update(0, k[:, :, :1], v[:, :, :1], positions=torch.tensor([[14]]))
    assert view.k.shape[2] == 4 and view.kv_positions[0].tolist() == [5, 12, 13, 14]  # latest position per slot


def test_snapkv_votes_with_the_observation_window():
    cache = KVCache([FullSpec(2, 8)], policy=SnapKV(budget=5, window=2, kernel_size=3))
    q, k = _aligned(2, 20, [5, 12])
    v = torch.randn(1, 2, 20, 8)
    cache.update(0, k, v, positions=torch.arange(20).view(1, 20))
    cache.observe(0, q)
    assert cache.layer_tokens(0) == 20  # prefill is exact; compression waits for the first decode step
    for t in range(20, 24):
        cache.update(0, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), positions=torch.tensor([[t]]))
        cache.observe(0, torch.randn(1, 2, 1, 8))
    kept = _kept(cache)[0]
    assert kept[0].tolist() == [4, 5, 6, 18, 19, 20, 21, 22, 23]  # pooled neighbours of the hit survive
    assert kept[1].tolist() == [11, 12, 13, 18, 19, 20, 21, 22, 23]


def test_policy_errors():
    with pytest.raises(ValueError, match="odd"):
        SnapKV(kernel_size=4)
    with pytest.raises(ValueError, match="budget"):
        SnapKV(budget=8, window=8)
    with pytest.raises(ValueError, match="recent"):
        H2O(recent=0)
    from qkv.cache import Paged
    with pytest.raises(ValueError, match="storage=Dynamic"):
        KVCache([FullSpec(1, 8)], policy=H2O(), storage=Paged())


def test_scores_attention_says_which_layers_rank_by_observed_attention():
    from qkv.cache import SlidingWindowSpec

    specs = [FullSpec(2, 8), SlidingWindowSpec(4, 2, 8)]
    assert [KVCache(specs).scores_attention(i) for i in (0, 1)] == [False, False]
    assert [KVCache(specs, policy=H2O(heavy=2, recent=2)).scores_attention(i) for i in (0, 1)] == [True, False]
    assert KVCache(specs, policy=SnapKV(budget=8, window=2)).scores_attention(0)
    with pytest.raises(ValueError, match="layer_idx 5 out of range"):
        KVCache(specs).scores_attention(5)


@pytest.mark.parametrize("policy", [H2O(heavy=4, recent=4), SnapKV(budget=8, window=2)], ids=["h2o", "snapkv"])
@pytest.mark.parametrize("kind", ["softcap", "alibi"])
def test_models_with_score_modifiers_refuse_scoring_policies_before_writing(policy, kind):
    """H2O/SnapKV rank tokens by softmax(q.k); a softcapped or ALiBi model attends with other scores, so it
    refuses them (a clear error, the cache untouched) instead of ranking tokens by the wrong numbers."""
    from qkv.models.generate import generate
    from qkv.nn import DecoderLM, get_config

    cfg = get_config("tiny-bloom") if kind == "alibi" else get_config("tiny-gemma", attn_logit_softcapping=50.0)
    lm = DecoderLM(cfg).eval()
    cache = KVCache(lm.cache_specs(), policy=policy)
    with pytest.raises(ValueError, match=r"evicts by observed attention.*(softcap|ALiBi)"):
        generate(lm, torch.randint(0, 100, (1, 6)), max_new_tokens=2, cache=cache)
    assert cache.seq_length == 0 and all(cache.layer_tokens(i) == 0 for i in range(len(lm.cache_specs())))
    out = generate(lm, torch.randint(0, 100, (1, 6)), max_new_tokens=2,
                   cache=KVCache(lm.cache_specs(), policy=StreamingLLM(n_sink=2, window=8)))
    assert out.new_tokens.shape == (1, 2)


def test_module_with_score_mod_refuses_a_scoring_policy():
    from qkv import mods
    from qkv.nn import MultiHeadAttention

    mha = MultiHeadAttention(16, 2, score_mod=mods.softcap(20.0), layer_idx=0)
    cache = KVCache([FullSpec(2, 8)], policy=H2O(heavy=2, recent=2))
    with pytest.raises(ValueError, match="evicts by observed attention"):
        mha(torch.randn(1, 3, 16), positions=torch.arange(3), cache=cache)
    assert cache.seq_length == 0
    plain = MultiHeadAttention(16, 2, layer_idx=0)
    assert plain(torch.randn(1, 3, 16), positions=torch.arange(3), cache=cache).out.shape == (1, 3, 16)
