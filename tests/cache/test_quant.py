"""KIVI and int8 caches: packing, per-channel keys / per-token values, quantize-once groups, measured
errors under their half-step bounds, and bytes that really shrink."""

from __future__ import annotations

import pytest
import torch

from _toy_lm import single_thread  # noqa: F401 (autouse fixture)
from qkv.cache import KIVI, FullSpec, Int8, KVCache, plan_memory
from qkv.cache.quant import pack_bits, quantize_groups, unpack_bits


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_bits(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_error_is_at_most_half_a_step(bits):
    x = torch.randn(6, 32, 16) * torch.logspace(-3, 2, 16)  # channels of very different ranges
    x[0] = 1.2345  # a constant group
    codes, scale, zero = quantize_groups(x, bits, 1)
    deq = codes.float() * scale.float() + zero.float()
    err = (deq - x).abs()
    assert bool((err <= scale.float() / 2 * (1 + 1e-5) + 1e-7).all()), float((err / scale.float()).max())
    assert codes.max() <= (1 << bits) - 1


def _fill(cache, n, D=16, seed=0, outlier=None):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, n, D, generator=g)
    if outlier is not None:
        k[..., outlier] *= 100.0
    v = torch.randn(1, 2, n, D, generator=g)
    view = cache.update(0, k, v, positions=torch.arange(n).view(1, n))
    return k, v, view


def test_keys_are_quantized_per_channel_values_per_token():
    cache = KVCache([FullSpec(2, 16)], quant=KIVI(bits=4, group_size=8, residual=0))
    k, v, _ = _fill(cache, 16, outlier=3)
    view = cache.update(0, torch.zeros(1, 2, 0, 16), torch.zeros(1, 2, 0, 16), positions=torch.zeros(1, 0, dtype=int))
    kerr = (view.k - k).abs()
    # Per channel: the outlier channel's large scale stays in channel 3 (per token it would spread to all).
    assert kerr[..., 3].max() > 10 * kerr[..., [0, 1, 2, 4, 5]].max()
    store = cache._layers[0].store
    assert store.kscale.get(0).shape == (1, 2, 2, 16)  # (B, H, tokens / G, channels)
    assert store.vscale.get(0).shape == (1, 2, 16, 2)  # (B, H, tokens, channels / G)


def test_groups_quantize_once_when_full():
    cache = KVCache([FullSpec(2, 16)], quant=KIVI(bits=2, group_size=4, residual=6))
    store = cache._layers[0].store
    k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    for t in range(9):
        cache.update(0, k[:, :, t:t + 1], v[:, :, t:t + 1], positions=torch.tensor([[t]]))
    assert store.keys.n == 0  # 9 < residual + group
    cache.update(0, torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), positions=torch.tensor([[9]]))
    assert store.keys.n == 4 and store.rk.shape[2] == 6
    first = store.keys.get(0).clone(), store.kscale.get(0).clone()
    for t in range(10, 30):
        cache.update(0, torch.randn(1, 2, 1, 16) * 50, torch.randn(1, 2, 1, 16), positions=torch.tensor([[t]]))
    assert torch.equal(store.keys.get(0)[:, :, :4], first[0])  # never re-quantized
    assert torch.equal(store.kscale.get(0)[:, :, :1], first[1])
    assert store.keys.n == 24 and store.rk.shape[2] == 6


@pytest.mark.parametrize("quant", [KIVI(bits=4, group_size=32, residual=32), KIVI(bits=2, group_size=32, residual=32),
                                   Int8()], ids=["kivi4", "kivi2", "int8"])
def test_measured_error_under_bound_and_bytes_shrink(quant):
    cache = KVCache([FullSpec(2, 64)], quant=quant)
    full = KVCache([FullSpec(2, 64)])
    k, v, view = _fill(cache, 512, D=64)
    _fill(full, 512, D=64)
    e = cache.quant_error()
    assert 0 < e.key_max_error <= e.key_bound and 0 < e.value_max_error <= e.value_bound
    view = cache.update(0, torch.zeros(1, 2, 0, 64), torch.zeros(1, 2, 0, 64), positions=torch.zeros(1, 0, dtype=int))
    assert float((view.k - k).abs().max()) <= e.key_bound * 1.0001
    used, fp32 = cache.memory().used_bytes, full.memory().used_bytes
    plan = plan_memory([FullSpec(2, 64)], context=512, dtype=torch.float32, quant=quant)
    assert used == plan.needed_bytes
    bits = getattr(quant, "bits", 8)
    assert used < fp32 * (bits / 32 + 0.2), (used, fp32)


def test_crop_only_within_full_precision_tail():
    cache = KVCache([FullSpec(2, 16)], quant=KIVI(bits=4, group_size=4, residual=3))
    _fill(cache, 13)
    assert cache._layers[0].store.rk.shape[2] == 5
    with pytest.raises(ValueError, match="crop at most 5"):
        cache.crop(-6)
    assert cache.seq_length == 13
    cache.crop(-5)
    assert cache.seq_length == 8
    int8 = KVCache([FullSpec(2, 16)], quant=Int8())
    _fill(int8, 10)
    int8.crop(4)  # per-token codes truncate exactly
    assert int8.layer_tokens(0) == 4


def test_bad_configs():
    with pytest.raises(ValueError, match="bits"):
        KIVI(bits=3)
    with pytest.raises(ValueError, match="multiple of 4"):
        KVCache([FullSpec(1, 6)], quant=KIVI(bits=2))
    with pytest.raises(ValueError, match="storage=Dynamic"):
        from qkv.cache import Static
        KVCache([FullSpec(1, 8)], quant=Int8(), storage=Static(8))
