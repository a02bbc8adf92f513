"""Issue 29 item 6: a retried step is refused on every storage, and a refused write leaves the position record as
it was (so the next correct write goes through)."""

import pytest
import torch

from qkv.cache import (
    H2O,
    KIVI,
    CacheFull,
    Dynamic,
    FullSpec,
    Int8,
    KVCache,
    Paged,
    SlidingWindowSpec,
    Static,
    StreamingLLM,
)

STORAGES = {
    "dynamic": lambda: KVCache([FullSpec(2, 8)] * 2, storage=Dynamic()),
    "static": lambda: KVCache([FullSpec(2, 8)] * 2, storage=Static(32)),
    "ring": lambda: KVCache([SlidingWindowSpec(8, 2, 8)] * 2, storage=Static(32)),
    "paged": lambda: KVCache([FullSpec(2, 8)] * 2, storage=Paged(4, 16)),
    "kivi": lambda: KVCache([FullSpec(2, 8)] * 2, quant=KIVI(bits=4, group_size=4, residual=8)),
    "int8": lambda: KVCache([FullSpec(2, 8)] * 2, quant=Int8()),
    "h2o": lambda: KVCache([FullSpec(2, 8)] * 2, policy=H2O(heavy=8, recent=8)),
    "streaming": lambda: KVCache([FullSpec(2, 8)] * 2, policy=StreamingLLM(n_sink=2, window=8)),
}


def _write(cache, layer, pos):
    p = torch.tensor([pos])
    return cache.update(layer, torch.randn(1, 2, len(pos), 8), torch.randn(1, 2, len(pos), 8), positions=p)


def _step(cache, pos, layers=(0, 1)):
    cache.prepare(torch.zeros(1, len(pos), dtype=torch.long), torch.tensor([pos]))
    for layer in layers:
        _write(cache, layer, pos)


@pytest.mark.parametrize("storage", list(STORAGES))
def test_retried_step_is_refused_and_keeps_one_key_per_position(storage):
    cache = STORAGES[storage]()
    _step(cache, [0, 1, 2, 3])
    _step(cache, [4], layers=(0,))  # layer 1 raised here; the caller retries the step from layer 0
    held = cache.layer_tokens(0)
    with pytest.raises(ValueError, match="layer 0 already stored this step"):
        _write(cache, 0, [4])
    assert cache.layer_tokens(0) == held
    view = _write(cache, 1, [4])  # finishing the step is fine
    kv = view.kv_positions[0]
    real = kv[kv >= 0]
    assert real.unique().numel() == real.numel(), f"two keys share a position: {kv.tolist()}"


@pytest.mark.parametrize("storage", list(STORAGES))
def test_new_step_after_a_step_left_part_way_is_refused(storage):
    cache = STORAGES[storage]()
    _step(cache, [0, 1, 2, 3])
    _step(cache, [4], layers=(0,))
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\] have not stored the previous step"):
        _step(cache, [5])


def test_static_overflow_does_not_advance_the_position_record():
    cache = KVCache([FullSpec(2, 8)] * 2, storage=Static(6))
    _step(cache, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="Static"):
        _step(cache, [4, 5, 6, 7])  # nothing was written
    _step(cache, [4, 5])  # the correct next step
    assert cache.seq_length == 6


def test_cache_full_does_not_advance_the_position_record():
    cache = KVCache([FullSpec(2, 8)] * 2, storage=Paged(block_size=2, num_blocks=3))
    _step(cache, [0, 1, 2, 3])
    with pytest.raises(CacheFull):
        _write(cache, 0, [4, 5, 6, 7])  # write without prepare: allocation fails inside update
    _step(cache, [4, 5])
    assert cache.seq_length == 6
