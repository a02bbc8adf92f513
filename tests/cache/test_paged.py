"""Paged storage: block accounting, padding not stored, copy-on-write forks, free and reuse, pool
exhaustion that changes nothing, prefix hashing with salts, LRU eviction, sliding-window release."""

from __future__ import annotations

import pytest
import torch

from _toy_lm import ToyLM, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import CacheFull, FullSpec, KVCache, Paged, SlidingWindowSpec, prefix_hashes
from qkv.models.generate import forward_step, generate, prompt_positions
from qkv.testing import max_error


def _kv(B, n, seed=0, H=1, D=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def _rows(view, b):
    p = view.kv_positions[b]
    keep = (p >= 0).nonzero().flatten()
    order = keep[p[keep].argsort()]
    return p[order].tolist(), view.k[b, :, order]


def test_blocks_hold_only_real_tokens():
    cache = KVCache([FullSpec(1, 4)], storage=Paged(block_size=4, num_blocks=16))
    k, v = _kv(2, 13)
    pos = prompt_positions(torch.tensor([[0] * 8 + [1] * 5, [1] * 13]))
    view = cache.update(0, k, v, positions=pos)
    stats = cache.pool_stats()["full_attention"]
    assert stats.blocks_in_use == 2 + 4  # ceil(5 / 4) + ceil(13 / 4)
    p0, k0 = _rows(view, 0)
    assert p0 == list(range(5)) and torch.equal(k0, k[0, :, 8:])
    mem = cache.memory()
    assert mem.used_bytes == 18 * 2 * 4 * 4 and mem.allocated_bytes == 6 * 4 * 2 * 4 * 4


def test_fork_shares_blocks_and_copies_on_write():
    cache = KVCache([FullSpec(1, 4)], storage=Paged(block_size=4, num_blocks=16))
    k, v = _kv(1, 6)
    cache.update(0, k, v, positions=torch.arange(6).view(1, 6))
    assert cache.pool_stats()["full_attention"].blocks_in_use == 2
    cache.fork(3)
    assert cache.pool_stats()["full_attention"].blocks_in_use == 2  # shared, nothing copied
    k_new, v_new = _kv(3, 1, seed=1)
    view = cache.update(0, k_new, v_new, positions=torch.full((3, 1), 6))
    # Each row wrote into the shared partial block: two copies made, the last writer may keep the original.
    assert cache.pool_stats()["full_attention"].blocks_in_use in (4, 5)
    for b in range(3):
        p, kb = _rows(view, b)
        assert p == list(range(7))
        assert torch.equal(kb[:, :6], k[0]) and torch.equal(kb[:, 6], k_new[b, :, 0])


def test_beam_reorder_shares_and_drops_blocks():
    cache = KVCache([FullSpec(1, 4)], storage=Paged(block_size=4, num_blocks=16))
    k, v = _kv(3, 6)
    cache.update(0, k, v, positions=torch.arange(6).expand(3, 6))
    cache.reorder(torch.tensor([1, 1, 0]))  # row 2's blocks lose their last reference
    assert cache.pool_stats()["full_attention"].blocks_in_use == 4
    view = cache.update(0, *_kv(3, 1, seed=2), positions=torch.full((3, 1), 6))
    for b, src in enumerate([1, 1, 0]):
        assert torch.equal(_rows(view, b)[1][:, :6], k[src])


def test_reset_frees_blocks_for_reuse():
    cache = KVCache([FullSpec(1, 4)], storage=Paged(block_size=4, num_blocks=4))
    for _ in range(3):
        cache.update(0, *_kv(2, 8), positions=torch.arange(8).expand(2, 8))
        assert cache.pool_stats()["full_attention"].blocks_free == 0
        cache.reset()
        assert cache.pool_stats()["full_attention"].blocks_free == 4


def test_exhausted_pool_raises_and_corrupts_nothing():
    m = ToyLM(layers=("full", ("window", 4)), seed=3).eval()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    cache = KVCache(m, storage=Paged(block_size=4, num_blocks=8))
    forward_step(m, cache, ids, pos)  # 3 blocks per row in the full group: 6 of 8
    before = [t.clone() for t in (cache._layers[0].store.kp, cache._manager.groups[0].pos)]
    state = (cache.seq_length, list(cache._manager.lens), cache.pool_stats())
    big = torch.randint(0, 61, (2, 9))
    with pytest.raises(CacheFull, match="nothing was written"):
        forward_step(m, cache, big, pos + 9)
    assert (cache.seq_length, list(cache._manager.lens), cache.pool_stats()) == state
    assert all(torch.equal(a, b) for a, b in zip(before, (cache._layers[0].store.kp, cache._manager.groups[0].pos),
                                                 strict=True))
    nxt = torch.tensor([[5], [7]])
    got = forward_step(m, cache, nxt, torch.full((2, 1), 9))[:, -1]
    ref = m(torch.cat([ids, nxt], 1), positions=torch.arange(10).expand(2, 10))[:, -1]
    assert max_error(got, ref) < 1e-4


def test_prefix_hash_chain():
    a = prefix_hashes(list(range(12)), 4)
    assert len(a) == 3
    assert prefix_hashes(list(range(8)) + [0, 0, 0, 0], 4)[:2] == a[:2]
    assert prefix_hashes([99] + list(range(1, 12)), 4)[2] != a[2]  # a change anywhere changes every later key
    assert prefix_hashes(list(range(12)), 4, salt="t1") != a
    assert prefix_hashes(list(range(12)), 4, salt=b"t1") == prefix_hashes(list(range(12)), 4, salt="t1")


def test_lru_eviction_of_cached_prefixes():
    spec = [FullSpec(1, 4)]
    cache = KVCache(spec, storage=Paged(block_size=2, num_blocks=6, prefix_caching=True))
    ids = {name: torch.tensor([seq]) for name, seq in (("a", [1, 2, 3, 4, 9]), ("b", [5, 6, 7, 8, 9]),
                                                         ("c", [11, 12, 13, 14, 9]))}

    def run(name):
        hits = cache.match_prefix(ids[name], torch.arange(5).view(1, 5))
        h = int(hits[0])
        cache.prepare(ids[name][:, h:], torch.arange(h, 5).view(1, -1))
        cache.update(0, *_kv(1, 5 - h), positions=torch.arange(h, 5).view(1, -1))
        cache.reset()
        return h

    assert run("a") == 0 and run("b") == 0  # 2 cached blocks each, 4 of 6
    assert run("a") == 4  # a is now the most recently used
    assert cache.pool_stats()["full_attention"].blocks_cached_reusable == 4
    assert run("c") == 0  # needs 3 blocks: 2 free, then evicts the least recently used: b's first block
    assert run("a") == 4  # a survived: it was used after b
    assert run("b") == 0  # b's chain is broken at its first block
    assert cache.pool_stats()["full_attention"].blocks_in_use == 0


def test_half_written_step_is_never_indexed():
    cache = KVCache([FullSpec(1, 4), FullSpec(1, 4)], storage=Paged(block_size=2, num_blocks=8, prefix_caching=True))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    pos = torch.arange(5).view(1, 5)
    cache.match_prefix(ids, pos)
    cache.prepare(ids, pos)
    cache.update(0, *_kv(1, 5), positions=pos)  # layer 1 never writes: the forward pass failed
    cache.reset()
    assert int(cache.match_prefix(ids, pos)[0]) == 0


def test_sliding_group_releases_blocks():
    cache = KVCache([FullSpec(1, 4), SlidingWindowSpec(3, 1, 4)], storage=Paged(block_size=2, num_blocks=64))
    for t in range(40):
        for layer in (0, 1):
            cache.update(layer, *_kv(1, 1, seed=t), positions=torch.tensor([[t]]))
    stats = cache.pool_stats()
    assert stats["full_attention"].blocks_in_use == 20
    assert stats["sliding_window_3"].blocks_in_use <= 3  # ceil(3 / 2) + 1 blocks cover the window


def test_generate_shared_prefix_batch_saves_prefill():
    m = ToyLM(layers=("full", "full"), seed=4).eval()
    system = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(1))
    cache = KVCache(m, storage=Paged(block_size=4, num_blocks=128, prefix_caching=True))
    generate(m, torch.cat([system, torch.tensor([[3, 4]])], 1), max_new_tokens=2, cache=cache)
    cache.reset()
    users = torch.cat([system.expand(3, 16), torch.tensor([[5, 6], [7, 8], [9, 10]])], 1)
    out = generate(m, users, max_new_tokens=4, cache=cache, return_logits=True)
    assert out.prefix_hits.tolist() == [16, 16, 16]
    ref = generate(m, users, max_new_tokens=4, use_cache=False, return_logits=True)
    assert torch.equal(out.new_tokens, ref.new_tokens) and max_error(out.logits, ref.logits) < 1e-4
    assert cache.pool_stats()["full_attention"].blocks_in_use < 3 * 6  # the 4 system blocks: shared by the 3 rows


def test_paged_needs_fresh_rows_for_prefix_match():
    cache = KVCache([FullSpec(1, 4)], storage=Paged(block_size=2, num_blocks=8))
    with pytest.raises(ValueError, match="prefix_caching=True"):
        cache.match_prefix(torch.tensor([[1, 2]]), torch.arange(2).view(1, 2))
    with pytest.raises(ValueError, match="num_blocks"):
        Paged(num_blocks=0)


def _paged_step(window=None, defer=False):
    """A paged cache holding rows of 3, 9 and 14 tokens (left-padded), then one decode step; its view."""
    g = torch.Generator().manual_seed(3)
    specs = [FullSpec(2, 8)] if window is None else [SlidingWindowSpec(window, 2, 8)]
    cache = KVCache(specs, storage=Paged(block_size=4, num_blocks=64))
    lens = [3, 9, 14]
    pos = torch.full((3, 14), -1, dtype=torch.int64)
    for b, n in enumerate(lens):
        pos[b, 14 - n:] = torch.arange(n)
    cache.update(0, torch.randn(3, 2, 14, 8, generator=g), torch.randn(3, 2, 14, 8, generator=g), positions=pos)
    step = torch.tensor(lens).view(3, 1)
    view = cache.update(0, torch.randn(3, 2, 1, 8, generator=g), torch.randn(3, 2, 1, 8, generator=g),
                        positions=step, defer_view=defer)
    return cache, view


@pytest.mark.parametrize("window", [None, 5])
def test_deferred_view_is_built_on_request_and_equals_the_eager_one(window):
    """``update(..., defer_view=True)`` skips gathering a paged layer's view (the paged backend reads the pools in
    place, on every path); ``view`` gathers it afterwards, equal to what an eager update returns."""
    _, eager = _paged_step(window)
    cache, deferred = _paged_step(window, defer=True)
    assert deferred.k is None and deferred.v is None
    assert torch.equal(deferred.kv_positions, eager.kv_positions)
    built = cache.view(0)
    assert torch.equal(built.k, eager.k) and torch.equal(built.v, eager.v)
    assert cache.view(0) is built  # gathered once


def test_view_before_any_update_is_refused():
    cache = KVCache([FullSpec(2, 8)], storage=Paged(block_size=4, num_blocks=8))
    with pytest.raises(ValueError, match="has not been updated"):
        cache.view(0)


def test_deferring_non_paged_layers_changes_nothing():
    cache = KVCache([FullSpec(2, 8)])
    view = cache.update(0, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), positions=torch.arange(3)[None],
                        defer_view=True)
    assert view.k is not None and view.k.shape == (1, 2, 3, 8)


def test_paged_gather_with_gradients_matches_and_flows():
    """The head-major block gather (index_select per head) equals advanced indexing, and with a pool that requires
    grad it records the gradient (no out= copy)."""
    from qkv._paged import gather_head_major

    pool = torch.randn(9, 3, 4, 5, requires_grad=True)
    tab = torch.tensor([[4, 1, 8], [0, 0, 2]])
    want = pool.transpose(0, 1)[:, tab].transpose(0, 1).reshape(2, 3, 12, 5)
    got = gather_head_major(pool, tab)
    assert torch.equal(got, want)
    got.sum().backward()
    assert pool.grad is not None and pool.grad[4].eq(1).all() and pool.grad[0].eq(2).all()
    with torch.no_grad():
        assert torch.equal(gather_head_major(pool, tab), want)
