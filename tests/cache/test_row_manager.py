"""KVCache talks to one row manager: the block manager under paged storage, the no-op DenseRows under dense
storage (no branch on its absence). can_admit is the block manager's admission test (what Engine asks)."""

from __future__ import annotations

import pytest
import torch

from qkv.cache import CacheFull, Dynamic, FullSpec, KVCache, Paged, SlidingWindowSpec, Static
from qkv.cache.paged import BlockManager
from qkv.cache.rows import DenseRows, RowManager

SPECS = [FullSpec(2, 8), SlidingWindowSpec(5, 2, 8)]


def _feed(cache, n, start=0, B=1):
    k = torch.randn(B, 2, n, 8)
    pos = torch.arange(start, start + n).expand(B, n)
    for i in range(len(SPECS)):
        cache.update(i, k, k, positions=pos)


@pytest.mark.parametrize("storage", [Dynamic(), Static(64), Paged(block_size=4, num_blocks=16)],
                         ids=["dynamic", "static", "paged"])
def test_both_managers_follow_the_protocol(storage):
    cache = KVCache(SPECS, storage=storage)
    assert isinstance(cache._manager, RowManager)
    assert isinstance(cache._manager, BlockManager if isinstance(storage, Paged) else DenseRows)


@pytest.mark.parametrize("storage", [Dynamic(), Static(64)], ids=["dynamic", "static"])
def test_dense_rows_are_a_no_op(storage):
    """prepare, crop, reorder and reset on dense storage go through DenseRows, which changes nothing itself: the
    layers' stores do the work, as before the protocol."""
    cache = KVCache(SPECS, storage=storage, rollback=2)
    rows = cache._manager
    assert (rows.rows, rows.selected, rows.cannot_drop(10**6), rows.step_in_progress()) == (0, None, None, False)
    cache.prepare(torch.zeros(2, 3, dtype=torch.int64), torch.arange(3).expand(2, 3))
    assert cache.seq_length == 0 and cache.batch is None  # nothing was allocated
    _feed(cache, 6, B=2)
    cache.crop(-2)
    assert cache.seq_length == 4
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.batch == 3
    cache.reset()
    assert cache.seq_length == 0 and cache.batch is None
    assert cache._manager is rows


@pytest.mark.parametrize("call, what", [
    (lambda c: c.open_rows(2), "open_rows"),
    (lambda c: c.admit_row(0), "admit_row"),
    (lambda c: c.release_row(0), "release_row"),
    (lambda c: c.step_rows([0]), "step_rows"),
    (lambda c: c.can_admit(3, 2), "can_admit"),
    (lambda c: c.never_fits(3, 2), "never_fits"),
    (lambda c: c.reserve_row(0, 3, 2), "reserve_row"),
    (lambda c: c.match_prefix(torch.zeros(1, 3, dtype=torch.int64), torch.arange(3)[None]), "match_prefix"),
    (lambda c: c.pool_stats(), "pool_stats"),
])
def test_dense_rows_refuse_paged_operations_by_name(call, what):
    cache = KVCache(SPECS)
    with pytest.raises(ValueError, match=f"{what}: .*(Paged|paged)"):
        call(cache)


def test_reset_keeps_the_pools_and_the_prefix_index_under_paged_storage():
    cache = KVCache(SPECS, storage=Paged(block_size=4, num_blocks=16, prefix_caching=True))
    _feed(cache, 9)
    stores = [lay.store for lay in cache._layers]
    cache.reset()
    assert [lay.store for lay in cache._layers] == stores and cache.seq_length == 0
    assert cache.pool_stats()["full_attention"].blocks_cached_reusable == 0  # no ids were announced: not indexed
    assert cache.memory().allocated_bytes == 0  # no block in use


@pytest.mark.parametrize("block, pool", [(4, 2), (4, 5), (3, 7)], ids=["T4-P2", "T4-P5", "T3-P7"])
def test_can_admit_exactly_the_pool_and_not_a_token_more(block, pool):
    """prompt + max_new_tokens - 1 tokens are stored (the last new token is never fed back): exactly block * pool of
    them fit, one more does not; never_fits says why, naming the group and the pool."""
    cache = KVCache([FullSpec(2, 8)], storage=Paged(block_size=block, num_blocks=pool))
    cache.open_rows(2)
    tokens = block * pool
    assert cache.can_admit(3, tokens - 2)
    assert cache.never_fits(3, tokens - 2) is None
    assert not cache.can_admit(3, tokens - 1)
    assert f"the pool has {pool}" in cache.never_fits(3, tokens - 1)


def test_admitted_rows_hold_their_promise_until_released():
    cache = KVCache([FullSpec(2, 8)], storage=Paged(block_size=4, num_blocks=6))
    cache.open_rows(3)
    cache.admit_row(0, [1, 2, 3, 4, 5], max_new_tokens=4)  # 8 tokens: 2 blocks
    assert cache.can_admit(9, 8) and not cache.can_admit(9, 9)  # 16 tokens fit the 4 left, 17 do not
    cache.admit_row(1, list(range(9)), max_new_tokens=8)
    assert not cache.can_admit(1, 1)
    before = cache._manager.reserved
    with pytest.raises(CacheFull, match="admit_row"):
        cache.admit_row(2, [1], max_new_tokens=1)
    assert cache._manager.reserved == before  # a refused call changes nothing
    cache.release_row(0)
    assert cache.can_admit(5, 4) and not cache.can_admit(5, 5)


def test_a_row_promised_before_its_prompt_attaches_is_counted_once():
    """The Engine promises a row waiting for another request's prompt blocks its blocks at once (reserve_row) and
    attaches the prompt later (admit_row with max_new_tokens): the pool counts that row once, before and after."""
    cache = KVCache([FullSpec(2, 8)], storage=Paged(block_size=4, num_blocks=4))
    cache.open_rows(2)
    cache.reserve_row(0, 5, 4)  # 8 tokens: 2 blocks promised
    assert cache.can_admit(5, 4) and not cache.can_admit(5, 5)
    cache.admit_row(0, [1, 2, 3, 4, 5], max_new_tokens=8)  # the same row, now 12 tokens: 3 blocks, not 2 + 3
    assert cache.can_admit(1, 4) and not cache.can_admit(1, 5)
    with pytest.raises(CacheFull, match="admit_row"):
        cache.admit_row(0, [1, 2, 3, 4, 5], max_new_tokens=13)  # 17 tokens: more than the pool
    assert cache.can_admit(1, 4) and not cache.can_admit(1, 5)  # the refused call kept the earlier promise
    with pytest.raises(ValueError, match="reserve_row"):
        cache.reserve_row(1, 0, 4)
    cache.release_row(0)
    assert cache.can_admit(9, 8)


def test_a_window_group_needs_only_its_window():
    cache = KVCache([SlidingWindowSpec(8, 2, 8)], storage=Paged(block_size=4, num_blocks=4))
    cache.open_rows(1)
    assert cache.can_admit(4, 1000, chunk=4)  # (8 + 4 + 2 * 4 - 2) // 4 = 4 blocks, whatever the length
    assert not cache.can_admit(8, 1000, chunk=8)  # a chunk of 8: 5 blocks


@pytest.mark.parametrize("args, kw, match", [
    ((0, 2), {}, "prompt_tokens"),
    ((2, 0), {}, "max_new_tokens"),
    ((2.0, 2), {}, "prompt_tokens"),
    ((2, True), {}, "max_new_tokens"),
    ((2, 2), {"chunk": 0}, "chunk"),
])
def test_can_admit_refuses_bad_counts(args, kw, match):
    cache = KVCache([FullSpec(2, 8)], storage=Paged(block_size=4, num_blocks=4))
    cache.open_rows(1)
    with pytest.raises(ValueError, match=f"can_admit\\({match}\\): expected an int >= 1, got"):
        cache.can_admit(*args, **kw)


def test_a_reservation_needs_the_prompt():
    cache = KVCache([FullSpec(2, 8)], storage=Paged(block_size=4, num_blocks=4))
    cache.open_rows(1)
    with pytest.raises(ValueError, match="needs the request's prompt_ids"):
        cache.admit_row(0, max_new_tokens=3)
