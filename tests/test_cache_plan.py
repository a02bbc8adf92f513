"""plan_memory: the arithmetic matches what the storages actually allocate, and says whether it fits."""

from __future__ import annotations

import torch

from _toy_lm import ToyLM, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import Dynamic, FullSpec, KVCache, Paged, SlidingWindowSpec, Static, plan_memory
from qkv.costs import PRESETS
from qkv.models.generate import generate

SPECS = [FullSpec(2, 16), SlidingWindowSpec(5, 2, 16)]


def _run(storage, lengths, new=4):
    m = ToyLM(layers=("full", ("window", 5)), seed=0).eval()
    N = max(lengths)
    ids = torch.randint(0, 61, (len(lengths), N))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, N - n:] = 1
    cache = KVCache(m, storage=storage)
    generate(m, ids, attention_mask=mask, max_new_tokens=new + 1, cache=cache)
    return cache


def test_plan_matches_paged_and_static_allocation():
    lengths = [3, 17, 9]
    ctx = [n + 4 for n in lengths]  # the last generated token is never fed
    paged = Paged(block_size=4, num_blocks=64)
    cache = _run(paged, lengths)
    plan = plan_memory(SPECS, context=ctx, dtype=torch.float32, storage=paged)
    mem = cache.memory()
    assert plan.needed_bytes == mem.used_bytes
    stats = cache.pool_stats()
    assert plan.blocks[None] == stats[None].in_use and plan.blocks[5] == stats[5].in_use
    static = _run(Static(32), lengths)
    splan = plan_memory(SPECS, context=ctx, dtype=torch.float32, storage=Static(32))
    positions = 3 * (32 + 5) * 8  # the cache also holds an int64 position per slot
    assert splan.allocated_bytes == sum(lay.allocated_bytes for lay in static.memory().layers) - positions


def test_paged_wastes_less_than_static_for_mixed_lengths():
    ctx = [100, 900, 4000, 8000]
    static = plan_memory([FullSpec(8, 128)] * 4, context=ctx, storage=Static(8192))
    paged = plan_memory([FullSpec(8, 128)] * 4, context=ctx, storage=Paged(block_size=16, num_blocks=1024))
    assert static.needed_bytes == paged.needed_bytes
    assert static.wasted_fraction > 0.55 and paged.wasted_fraction < 0.01


def test_fits_and_breakdown():
    gemma = PRESETS["gemma-3-27b"]
    plan = plan_memory(gemma, batch=1, context=128 * 1024, dtype="bf16", budget_bytes=80 * 10**9)
    assert plan.fits
    kinds = plan.by_kind
    assert kinds["full"] > kinds["sliding"]  # 10 global layers outweigh 52 local ones at 128k
    dense = plan_memory(gemma.mha_equivalent(), batch=8, context=128 * 1024, dtype="bf16", budget_bytes=80 * 10**9)
    assert dense.fits is False
    pool = plan_memory([FullSpec(8, 128)], batch=2, context=2048, storage=Paged(block_size=16, num_blocks=200))
    assert pool.blocks[None] == 256 and plan_memory(
        [FullSpec(8, 128)], batch=2, context=2048, storage=Paged(block_size=16, num_blocks=200),
        budget_bytes=10**12).fits is False
    assert "KV cache plan" in str(plan)
    dyn = plan_memory(SPECS, context=10, storage=Dynamic())
    assert dyn.allocated_bytes >= dyn.needed_bytes
