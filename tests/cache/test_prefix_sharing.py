"""Prefix caching within one ``generate`` batch: rows with a common prompt prefix share its full blocks (the
longer row writes them, the others point at them), and the greedy tokens equal those of the same batch without
prefix caching and of each row alone. Also the refusals that keep the sharing safe (a row reading blocks not yet
written, reorder/crop half-way) and the ``pool_stats()`` record.

Layouts (block size 4): identical prompts, a shared prefix with different suffix lengths (left padding), a common
prefix shorter than a block (no sharing), different salts (no sharing across tenants), chunked prefill (chunks
that end inside a shared block), and index hits from an earlier request combined with in-batch hits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _toy_lm import ToyLM, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import CacheFull, FullSpec, KVCache, Paged
from qkv.models.generate import generate
from qkv.testing import max_error

T = 4  # block size
NEW = 5


@pytest.fixture(scope="module")
def model():
    return ToyLM(layers=("full", ("window", 5), "latent"), seed=7).eval()


def _tokens(n, seed):
    return torch.randint(1, 61, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _padded(rows):
    """Left-padded (B, N) ids and mask from lists of token ids."""
    N = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), N, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, N - len(r):] = torch.tensor(r)
        mask[b, N - len(r):] = 1
    return ids, mask


P9, P3 = _tokens(9, 1), _tokens(3, 2)
# id -> (prompts, salt, reused tokens per row). A row reuses the full blocks of its prompt that a longer row (ties:
# the earlier one) writes, never its last token: min(common full blocks, (len - 1) // 4) * 4.
LAYOUTS = {
    "identical-3x13": ([P9 + [5, 6, 7, 8]] * 3, None, [0, 12, 12]),
    "identical-2x12-last-block-full": ([P9 + [5, 6, 7]] * 2, None, [0, 8]),
    "prefix9-suffix-1-5-3-leftpad": ([P9 + [11], P9 + [12, 13, 14, 15, 16], P9 + [17, 18, 19]], None, [8, 0, 8]),
    "prefix9-longest-last": ([P9 + [11, 12], P9 + [13, 14, 15, 16, 17, 18, 19]], None, [8, 0]),
    "prefix3-shorter-than-a-block": ([P3 + [21, 22, 23, 24, 25], P3 + [26, 27, 28, 29, 30]], None, [0, 0]),
    "salts-a-b-a": ([P9 + [5, 6, 7, 8]] * 3, ["a", "b", "a"], [0, 0, 12]),
    "unrelated-and-shared": ([_tokens(10, 3), P9 + [1, 2], P9 + [3]], None, [0, 0, 8]),
}


def _run(model, rows, *, salt=None, chunk=None, cache=None):
    ids, mask = _padded(rows)
    return generate(model, ids, attention_mask=mask, max_new_tokens=NEW, cache=cache, salt=salt,
                    prefill_chunk_size=chunk, return_logits=True)


def _paged(model, caching=True):
    return KVCache(model, storage=Paged(block_size=T, num_blocks=128, prefix_caching=caching))


@pytest.mark.parametrize("chunk", [None, 3, 1], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rows_share_blocks_and_decode_the_same(model, layout, chunk):
    rows, salt, expected = LAYOUTS[layout]
    cache = _paged(model)
    out = _run(model, rows, salt=salt, chunk=chunk, cache=cache)
    assert out.prefix_hits.tolist() == expected, f"{layout}: reused tokens {out.prefix_hits.tolist()}"
    plain_cache = _paged(model, caching=False)
    plain = _run(model, rows, chunk=chunk, cache=plain_cache)
    assert torch.equal(out.new_tokens, plain.new_tokens), (
        f"{layout}: tokens with sharing {out.new_tokens.tolist()} vs without {plain.new_tokens.tolist()}")
    err = max_error(out.logits, plain.logits)
    assert err < 1e-4, f"{layout}: logits differ by {err}"
    for b, r in enumerate(rows):
        alone = generate(model, torch.tensor([r]), max_new_tokens=NEW, return_logits=True)
        assert torch.equal(alone.new_tokens[0], out.new_tokens[b]), f"{layout}: row {b} differs from running alone"
        assert max_error(alone.logits[0], out.logits[b]) < 1e-4, f"{layout}: row {b} logits differ from alone"
    # A shared block is held once: the full-attention group needs exactly the reused blocks fewer.
    shared, unshared = cache.pool_stats()["full_attention"], plain_cache.pool_stats()["full_attention"]
    assert shared.blocks_in_use == unshared.blocks_in_use - sum(expected) // T, (shared, unshared)
    assert shared.prefix_hit_tokens == shared.prefix_hit_tokens_in_batch == sum(expected)
    assert shared.prefix_lookup_tokens == sum(len(r) for r in rows)


def test_index_hits_and_batch_hits_combine(model):
    system = P9 + [40, 41, 42]  # 3 full blocks
    cache = _paged(model)
    _run(model, [P9[:4] + [50, 51, 52]], cache=cache)  # an earlier request indexes the first block only
    cache.reset()
    rows = [system + [43, 44, 45, 46, 47], system + [48], P9[:4] + [53, 54]]
    out = _run(model, rows, cache=cache)
    # row 0 reuses the indexed block; row 1 reuses 3 blocks, 2 of them written by row 0 in this prefill; row 2 the index
    assert out.prefix_hits.tolist() == [4, 12, 4]
    plain = _run(model, rows)
    assert torch.equal(out.new_tokens, plain.new_tokens) and max_error(out.logits, plain.logits) < 1e-4
    stats = cache.pool_stats()["full_attention"]
    assert (stats.prefix_hit_tokens, stats.prefix_hit_tokens_in_batch) == (20, 8)
    assert stats.prefix_lookup_tokens == 7 + sum(len(r) for r in rows)
    assert stats.hit_rate == pytest.approx(20 / stats.prefix_lookup_tokens)
    cache.reset()
    again = _run(model, rows, cache=cache)  # everything the batch wrote is indexed now
    assert again.prefix_hits.tolist() == [16, 12, 4] and torch.equal(again.new_tokens, plain.new_tokens)


def _kv(B, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, n, 4, generator=g), torch.randn(B, 1, n, 4, generator=g)


def _shared_pair():
    """A cache whose row 1 reuses the first 8 tokens row 0 is about to write."""
    cache = KVCache([FullSpec(1, 4)], storage=Paged(block_size=T, num_blocks=16, prefix_caching=True))
    ids = torch.arange(1, 13).expand(2, 12)
    hits = cache.match_prefix(ids, torch.arange(12).expand(2, 12))
    assert hits.tolist() == [0, 8]
    return cache, ids


def test_reading_unwritten_shared_blocks_is_refused_and_changes_nothing():
    cache, ids = _shared_pair()
    before = cache.pool_stats()
    pos = torch.tensor([[-1, -1, -1, -1], [8, 9, 10, 11]])  # row 1 first, row 0 not at all: its blocks are empty
    with pytest.raises(ValueError, match="row 1 reuses the first 8 prompt tokens of row 0"):
        cache.prepare(ids[:, 8:], pos)
    assert cache.seq_length == 0 and cache.pool_stats() == before
    # Right-aligned, the writer's tokens come in the same step: accepted, and row 1 sees row 0's keys.
    run = torch.cat([torch.arange(12).view(1, 12), torch.tensor([[-1] * 8 + [8, 9, 10, 11]])])
    cache.prepare(ids, run)
    k, v = _kv(2, 12)
    view = cache.update(0, k, v, positions=run)
    order = view.kv_positions[1].argsort()[-12:]
    assert view.kv_positions[1, order].tolist() == list(range(12))
    assert torch.equal(view.k[1, :, order[:8]], k[0, :, :8]) and torch.equal(view.k[1, :, order[8:]], k[1, :, 8:])


def test_writer_must_write_the_prompt_it_was_matched_with():
    cache, ids = _shared_pair()
    before = cache.pool_stats()
    other = ids.clone()
    other[0, 5] += 1  # row 0 would fill the shared blocks with another prompt
    with pytest.raises(ValueError, match="row 0 writes prompt blocks .* differ from the prompt match_prefix"):
        cache.prepare(other, torch.cat([torch.arange(12).view(1, 12), torch.tensor([[-1] * 8 + [8, 9, 10, 11]])]))
    with pytest.raises(ValueError, match=r"cache.prepare\(input_ids, positions\)"):
        cache.update(0, *_kv(2, 12), positions=torch.arange(12).expand(2, 12))  # no token ids announced
    assert cache.seq_length == 0 and cache.pool_stats() == before


def test_writer_fills_a_shared_block_in_place_across_chunks():
    cache, ids = _shared_pair()
    seen = []
    for a, b in ((0, 3), (3, 6), (6, 12)):  # chunks ending inside the shared blocks: no copy-on-write there
        pos = torch.tensor([list(range(a, b)), [p if p >= 8 else -1 for p in range(a, b)]])
        cache.prepare(ids[:, a:b], pos)
        k, v = _kv(2, b - a, seed=a)
        view = cache.update(0, k, v, positions=pos)
        seen.append(k[0])
    keys = torch.cat(seen, dim=1)  # row 0's keys in order
    order = view.kv_positions[1].argsort()[-12:]
    assert torch.equal(view.k[1, :, order[:8]], keys[:, :8]), "row 1 must read row 0's shared keys"
    assert cache.pool_stats()["full_attention"].blocks_in_use == 3 + 1


@pytest.mark.parametrize("op", ["reorder", "crop"])
def test_reorder_and_crop_wait_for_the_shared_blocks(op):
    cache, ids = _shared_pair()
    pos = torch.tensor([[0, 1, 2, 3], [-1, -1, -1, -1]])
    cache.prepare(ids[:, :4], pos)
    cache.update(0, *_kv(2, 4), positions=pos)
    before = (cache.seq_length, cache.pool_stats())
    with pytest.raises(ValueError, match=r"row\(s\) \[0\] have not yet written .* finish the prefill first"):
        cache.reorder(torch.tensor([1, 0])) if op == "reorder" else cache.crop(2)
    assert (cache.seq_length, cache.pool_stats()) == before


def test_pool_stats_fields_add_up(model):
    cache = _paged(model)
    _run(model, LAYOUTS["prefix9-suffix-1-5-3-leftpad"][0], cache=cache)
    cache.reset()
    stats = cache.pool_stats()
    assert sorted(stats) == ["full_attention", "sliding_window_5"]
    for name, s in stats.items():
        assert s.blocks_in_use + s.blocks_cached_reusable + s.blocks_free == s.blocks_total == 128, (name, s)
        assert s.block_size == T and s.blocks_in_use == 0
        assert 0.0 < s.hit_rate == s.prefix_hit_tokens / s.prefix_lookup_tokens < 1.0
    assert stats["full_attention"].blocks_cached_reusable > 0
    with pytest.raises(ValueError, match="only paged caches"):
        KVCache(model).pool_stats()


def _expected_hits(rows, salts):
    """Reused tokens per row from the token lists alone: the longest common token prefix with a row ordered before
    it (longer, or as long and earlier) under the same salt, in whole blocks, never the row's last token."""
    hits = []
    for b, r in enumerate(rows):
        best = 0
        for a, other in enumerate(rows):
            if (len(other), -a) <= (len(r), -b) or salts[a] != salts[b]:
                continue
            common = 0
            while common < min(len(r), len(other)) and r[common] == other[common]:
                common += 1
            best = max(best, min(common // T, (len(r) - 1) // T) * T)
        hits.append(best)
    return hits


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_batches_share_and_decode_the_same(model, data):
    prefix = data.draw(st.lists(st.integers(1, 60), min_size=0, max_size=13), label="prefix")
    B = data.draw(st.integers(2, 4), label="rows")
    rows, salts = [], []
    for _ in range(B):
        cut = data.draw(st.integers(0, len(prefix)))
        suffix = data.draw(st.lists(st.integers(1, 60), min_size=1, max_size=6))
        rows.append(prefix[:cut] + suffix)
        salts.append(data.draw(st.sampled_from([None, "t"])))
    chunk = data.draw(st.sampled_from([None, 1, 2, 3, 5]), label="chunk")
    cache = _paged(model)
    out = _run(model, rows, salt=salts, chunk=chunk, cache=cache)
    assert out.prefix_hits.tolist() == _expected_hits(rows, salts), (rows, salts)
    plain_cache = _paged(model, caching=False)
    plain = _run(model, rows, chunk=chunk, cache=plain_cache)
    assert torch.equal(out.new_tokens, plain.new_tokens), (rows, salts, chunk)
    assert max_error(out.logits, plain.logits) < 1e-4, (rows, salts, chunk)
    used = cache.pool_stats()["full_attention"].blocks_in_use
    assert used == plain_cache.pool_stats()["full_attention"].blocks_in_use - int(out.prefix_hits.sum()) // T


def test_sharing_fits_a_batch_the_pool_could_not_hold_otherwise():
    m = ToyLM(layers=("full", "full"), seed=3).eval()
    rows = [P9 + [5, 6, 7, 8]] * 3  # 13 prompt tokens + 4 fed back: 5 blocks a row, 15 without sharing
    with pytest.raises(CacheFull, match="need"):
        _run(m, rows, cache=KVCache(m, storage=Paged(block_size=T, num_blocks=10)))
    cache = KVCache(m, storage=Paged(block_size=T, num_blocks=10, prefix_caching=True))
    out = _run(m, rows, cache=cache)  # 5 blocks for the writer, 2 each for the others
    assert out.prefix_hits.tolist() == [0, 12, 12]
    assert torch.equal(out.new_tokens, _run(m, rows).new_tokens)
