"""``qkv.cache.RowSlots`` on ``KVCache`` over paged storage: rows released and admitted one at a time while the
others keep their state, steps over selected rows, position records reset per row, and refusals that change
nothing (other storages refuse, naming themselves)."""

from __future__ import annotations

import pytest
import torch

from qkv.cache import FullSpec, KVCache, Paged, RowSlots, SlidingWindowSpec
from qkv.cache.storage import Dynamic, Static

SPECS = [FullSpec(1, 4), SlidingWindowSpec(3, 1, 4)]


def _cache(**kw) -> KVCache:
    cache = KVCache(SPECS, storage=Paged(block_size=2, num_blocks=12, **kw))
    cache.open_rows(2)
    return cache


def _step(cache, ids, pos, *, prepare=True):
    """One step on every layer, keys equal to the positions (so a view tells which tokens it holds)."""
    ids, pos = torch.as_tensor(ids), torch.as_tensor(pos)
    k = pos.clamp_min(0).to(torch.float64).view(*pos.shape, 1).expand(*pos.shape, 4).unsqueeze(1).contiguous()
    if prepare:
        cache.prepare(ids, pos)
    return [cache.update(i, k, k, positions=pos) for i in range(len(cache.specs))]


def _held(view, row):
    """The positions of the real tokens a row's view holds, and the keys stored with them (must match)."""
    keep = view.kv_positions[row] >= 0
    positions = view.kv_positions[row][keep]
    assert torch.equal(view.k[row, 0, keep, 0], positions.to(torch.float64))
    return sorted(positions.tolist())


def _state(cache):
    return ({k: tuple(v) for k, v in cache.pool_stats().items()}, cache.seq_length, list(cache._manager.lens),
            [list(map(list, g.tables)) for g in cache._manager.groups])


def test_declared_by_kvcache_and_refused_by_other_storages():
    assert isinstance(_cache(), RowSlots)
    for storage, name in ((Dynamic(), "dynamic"), (Static(8), r"static\(max_len=8\)")):
        cache = KVCache(SPECS, storage=storage)
        for call in (lambda c: c.open_rows(2), lambda c: c.release_row(0), lambda c: c.admit_row(0),
                     lambda c: c.step_rows([0])):
            with pytest.raises(ValueError, match=f"needs storage=Paged.*uses {name} storage"):
                call(cache)


def test_release_and_admit_one_row_while_the_other_keeps_its_state():
    cache = _cache()
    _step(cache, [[1, 2, 3], [4, 5, 6]], [[0, 1, 2], [-1, 0, 1]])
    in_use = cache.pool_stats()["full_attention"].blocks_in_use
    cache.release_row(0)
    assert cache.pool_stats()["full_attention"].blocks_in_use == in_use - 2  # row 0's two blocks, at once
    assert cache.admit_row(0) == 0
    views = _step(cache, [[7, 8], [0, 9]], [[0, 1], [-1, 2]])  # row 0 starts again at position 0
    assert _held(views[0], 0) == [0, 1]
    assert _held(views[0], 1) == [0, 1, 2]
    assert _held(views[1], 1) == [0, 1, 2]  # window 3
    with pytest.raises(ValueError, match="positions must increase"):  # row 1's record was kept
        _step(cache, [[1], [2]], [[2], [2]], prepare=False)


def test_step_rows_feeds_selected_rows_only():
    cache = _cache()
    _step(cache, [[1, 2], [3, 4]], [[0, 1], [0, 1]])
    cache.step_rows([1])
    views = _step(cache, [[5, 6, 7]], [[2, 3, 4]])
    assert views[0].k.shape[0] == 1 and _held(views[0], 0) == [0, 1, 2, 3, 4]
    assert _held(views[1], 0) == [0, 1, 2, 3, 4]  # the step's first query still needs key 0
    with pytest.raises(ValueError, match="positions must increase"):  # checked against row 1's own record
        _step(cache, [[5]], [[4]], prepare=False)
    cache.step_rows(None)
    views = _step(cache, [[8], [9]], [[2], [5]])
    assert _held(views[0], 0) == [0, 1, 2] and _held(views[0], 1) == [0, 1, 2, 3, 4, 5]
    assert _held(views[1], 1) == [2, 3, 4, 5]  # the window layer released the block it no longer needs
    with pytest.raises(ValueError, match="got batch 1 but the cache holds 2 rows"):
        _step(cache, [[1]], [[9]], prepare=False)
    cache.step_rows([0])
    with pytest.raises(ValueError, match=r"got batch 2 but steps feed the 1 rows selected by cache.step_rows\(\[0\]\)"):
        _step(cache, [[1], [2]], [[9], [9]], prepare=False)
    for bad in ([1, 0], [], [2], [0.5], "0"):
        with pytest.raises(ValueError, match="step_rows"):
            cache.step_rows(bad)


def test_admit_row_attaches_cached_prefix_blocks():
    cache = _cache(prefix_caching=True)
    _step(cache, [[1, 2, 3, 4, 5], [0, 0, 0, 6, 7]], [[0, 1, 2, 3, 4], [-1, -1, -1, 0, 1]])
    cache.release_row(0)  # its full blocks stay indexed
    assert cache.pool_stats()["full_attention"].blocks_cached_reusable == 2
    assert cache.admit_row(0, [1, 2, 3, 4, 9], salt=None) == 4
    cache.step_rows([0])
    views = _step(cache, [[9]], [[4]])
    assert _held(views[0], 0) == [0, 1, 2, 3, 4]
    cache.step_rows(None)
    cache.release_row(0)
    assert cache.admit_row(0, [1, 2, 3, 4, 9], salt="other tenant") == 0


def test_refusals_change_nothing():
    cache = _cache()
    _step(cache, [[1, 2, 3], [4, 5, 6]], [[0, 1, 2], [0, 1, 2]])
    before = _state(cache)
    for call, match in ((lambda: cache.admit_row(0), "row 0 holds 3 tokens; release_row"),
                        (lambda: cache.admit_row(2), "not a row of this cache, which holds 2"),
                        (lambda: cache.release_row(-1), "not a row"),
                        (lambda: cache.release_row(True), "not a row"),
                        (lambda: cache.open_rows(3), "already holds 2 rows"),
                        (lambda: cache.step_rows([0, 0]), "increasing")):
        with pytest.raises(ValueError, match=match):
            call()
        assert _state(cache) == before
    cache.release_row(1)
    with pytest.raises(ValueError, match="non-empty list of token ids"):
        cache.admit_row(1, [1.0])
    with pytest.raises(TypeError, match="salt"):
        cache.admit_row(1, salt=3)
    k = torch.zeros(2, 1, 1, 4, dtype=torch.float64)
    pos = torch.tensor([[3], [0]])
    cache.prepare(torch.tensor([[1], [2]]), pos)
    cache.update(0, k, k, positions=pos)  # layer 1 has not written this step yet
    before = _state(cache)
    with pytest.raises(ValueError, match="a step is in progress"):
        cache.release_row(0)
    assert _state(cache) == before
    fresh = KVCache(SPECS, storage=Paged(block_size=2, num_blocks=12))
    with pytest.raises(ValueError, match="call cache.open_rows"):
        fresh.release_row(0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="open_rows"):
            fresh.open_rows(bad)


def test_long_history_is_folded_and_crop_still_counts_the_same(monkeypatch):
    """A long-running engine's step record stays a short list (steps joined), and crop reads it alike."""
    import qkv.cache.paged.blocks as paged

    def run(fold: int):
        monkeypatch.setattr(paged, "_FOLD_STEPS", fold)
        cache = KVCache(SPECS[:1], storage=Paged(block_size=2, num_blocks=12))
        cache.open_rows(2)
        for t in range(13):
            pos = [[t], [t if t % 3 else -1]]
            _step(cache, [[1], [2]], pos)
            if t == 7:
                cache.release_row(1)
                cache.admit_row(1)
        n_entries = len(cache._manager.history)
        cache.crop(-5)
        after_drop = list(cache._manager.lens)
        cache.crop(3)
        return n_entries, after_drop, list(cache._manager.lens)

    plain, folded = run(10**6), run(3)
    assert plain[0] == 13 and folded[0] <= 5
    assert plain[1:] == folded[1:] == ([8, 0], [3, 0])
