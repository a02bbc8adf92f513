"""Storages under the cache protocol: dynamic growth, static addresses, rings, crop, reorder, cross and
latent layers, and the errors that leave the cache untouched."""

from __future__ import annotations

import pytest
import torch

import qkv
from _toy_lm import rope, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.cache import CrossSpec, Dynamic, FullSpec, KVCache, LatentSpec, SlidingWindowSpec, Static


def _kv(B, H, n, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)


def _pos(B, a, b):
    return torch.arange(a, b).expand(B, b - a)


def _sorted_view(view):
    """(positions, k, v) of real slots of row 0, in position order (storage order does not matter)."""
    p = view.kv_positions[0]
    keep = (p >= 0).nonzero().flatten()
    order = keep[p[keep].argsort()]
    return p[order], view.k[0, :, order], view.v[0, :, order]


def test_dynamic_grows_geometrically():
    cache = KVCache([FullSpec(2, 8)])
    ptrs = set()
    for t in range(300):
        k, v = _kv(1, 2, 1, seed=t)
        view = cache.update(0, k, v, positions=_pos(1, t, t + 1))
        ptrs.add(view.k.data_ptr())
    assert len(ptrs) <= 6, f"{len(ptrs)} reallocations for 300 tokens: growth is not geometric"
    assert view.k.shape[2] == 300 and cache.seq_length == 300


@pytest.mark.parametrize("storage", [Dynamic(), Static(64)], ids=["dynamic", "static"])
def test_full_layer_keeps_everything_in_order(storage):
    cache = KVCache([FullSpec(2, 8)], storage=storage)
    ks, vs = [], []
    for a, b in ((0, 5), (5, 6), (6, 13)):
        k, v = _kv(2, 2, b - a, seed=a)
        ks.append(k)
        vs.append(v)
        view = cache.update(0, k, v, positions=_pos(2, a, b))
    p, k, v = _sorted_view(view)
    assert p.tolist() == list(range(13))
    assert torch.equal(k, torch.cat(ks, 2)[0]) and torch.equal(v, torch.cat(vs, 2)[0])


def test_static_addresses_are_fixed_and_overflow_is_refused():
    cache = KVCache([FullSpec(2, 8), SlidingWindowSpec(4, 2, 8)], storage=Static(10))
    ptrs = set()
    for t in range(10):
        k, v = _kv(2, 2, 1, seed=t)
        for layer in (0, 1):
            view = cache.update(layer, k, v, positions=_pos(2, t, t + 1))
            ptrs.add((layer, view.k.data_ptr(), tuple(view.k.shape)))
    cache.reorder(torch.tensor([1, 0]))
    view = cache.update(1, *_kv(2, 2, 1, seed=99), positions=_pos(2, 10, 11))
    ptrs.add((1, view.k.data_ptr(), tuple(view.k.shape)))
    assert len(ptrs) == 2, ptrs  # one buffer per layer, shapes fixed (10 slots; a 4-slot ring)
    before = cache.update(0, *_kv(2, 2, 0), positions=_pos(2, 10, 10)).k.clone()
    with pytest.raises(ValueError, match=r"max_len=10"):
        cache.update(0, *_kv(2, 2, 1), positions=_pos(2, 10, 11))
    assert torch.equal(cache.update(0, *_kv(2, 2, 0), positions=_pos(2, 10, 10)).k, before)


@pytest.mark.parametrize("storage", [Dynamic(), Static(64)], ids=["dynamic", "ring"])
def test_sliding_layer_keeps_its_window(storage):
    W = 5
    cache = KVCache([SlidingWindowSpec(W, 1, 8)], storage=storage)
    all_k = []
    for t in range(23):
        k, v = _kv(1, 1, 1, seed=t)
        all_k.append(k)
        view = cache.update(0, k, v, positions=_pos(1, t, t + 1))
        p, kk, _ = _sorted_view(view)
        assert p.tolist()[-W:] == list(range(max(0, t - W + 1), t + 1))
        assert torch.equal(kk[:, -min(W, t + 1):], torch.cat(all_k, 2)[0, :, -min(W, t + 1):])
    assert cache.layer_tokens(0) == W
    assert cache.memory().layers[0].allocated_bytes < 64 * W * 2 * 8 * 4 + 64 * 8


def test_ring_multi_token_step_sees_overwritten_keys():
    """A 7-token step into a 4-slot ring: its first queries need keys its last tokens overwrite."""
    W = 4
    cache = KVCache([SlidingWindowSpec(W, 1, 8)], storage=Static(32))
    cache.update(0, *_kv(1, 1, 3, seed=1), positions=_pos(1, 0, 3))
    view = cache.update(0, *_kv(1, 1, 7, seed=2), positions=_pos(1, 3, 10))
    q = torch.randn(1, 1, 7, 8)
    mask = qkv.masks.positions(view.q_positions, view.kv_positions, window=W)
    allowed = mask.materialize(1, 1, 7, view.k.shape[2])[0, 0]
    assert allowed.sum(1).tolist() == [W] * 7  # each query finds all W keys of its window
    assert qkv.attention(q, view.k, view.v, mask=mask).isfinite().all()
    assert cache.layer_tokens(0) == W


def test_rope_is_applied_at_absolute_positions():
    cache = KVCache([FullSpec(2, 8)])
    k, v = _kv(2, 2, 6)
    pos = torch.tensor([[-1, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    view = cache.update(0, k, v, positions=pos, rope=rope)
    assert torch.equal(view.q_positions, pos) and torch.equal(view.kv_positions, pos)
    assert torch.allclose(view.k, rope(k, pos))


@pytest.mark.parametrize("storage", [Dynamic(), Static(32)], ids=["dynamic", "static"])
def test_crop_and_errors_leave_cache_unchanged(storage):
    cache = KVCache([FullSpec(1, 8), SlidingWindowSpec(3, 1, 8)], storage=storage, rollback=2)
    for t in range(10):
        for layer in (0, 1):
            cache.update(layer, *_kv(1, 1, 1, seed=t), positions=_pos(1, t, t + 1))
    with pytest.raises(ValueError, match="rollback >= 4"):
        cache.crop(-4)
    assert cache.seq_length == 10
    cache.crop(8)
    assert cache.seq_length == 8
    for layer in (0, 1):
        view = cache.update(layer, *_kv(1, 1, 1, seed=50), positions=_pos(1, 8, 9))
        p = view.kv_positions[0]
        assert sorted(p[p >= 0].tolist())[-3:] == [6, 7, 8]
    with pytest.raises(ValueError, match="0 <= length <= 9"):
        cache.crop(12)


def test_reorder_and_fork_select_rows():
    cache = KVCache([FullSpec(1, 8)])
    k, v = _kv(3, 1, 4)
    cache.update(0, k, v, positions=_pos(3, 0, 4))
    cache.reorder(torch.tensor([2, 2, 0]))
    view = cache.update(0, *_kv(3, 1, 0), positions=_pos(3, 4, 4))
    assert torch.equal(view.k, k[[2, 2, 0]])
    cache.fork(2)
    assert cache.batch == 6
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        cache.reorder(torch.tensor([6]))
    with pytest.raises(ValueError, match="batch 3 but the cache holds 6 rows"):
        cache.update(0, *_kv(3, 1, 1), positions=_pos(3, 4, 5))


def test_cross_kv_is_computed_once_and_reordered():
    cache = KVCache([FullSpec(1, 8), CrossSpec(1, 8, source_len=5)])
    calls = []

    def compute():
        calls.append(1)
        return _kv(2, 1, 5)

    k1, _ = cache.cross_kv(1, compute)
    k2, _ = cache.cross_kv(1, compute)
    assert len(calls) == 1 and k1 is k2
    cache.reorder(torch.tensor([1, 1]))
    k3, _ = cache.cross_kv(1, compute)
    assert torch.equal(k3, k1[[1, 1]]) and len(calls) == 1


def test_latent_layer_stores_latents_and_rotated_rope_keys():
    cache = KVCache([LatentSpec(16, 8)], storage=Static(12))
    c, r = torch.randn(2, 5, 16), torch.randn(2, 5, 8)
    pos = _pos(2, 0, 5)
    view = cache.update_latent(0, c, r, positions=pos, rope=rope)
    assert view.c_kv.shape == (2, 12, 16) and view.k_rope.shape == (2, 12, 8)
    assert torch.equal(view.c_kv[:, :5], c)
    assert torch.allclose(view.k_rope[:, :5], rope(r.unsqueeze(1), pos).squeeze(1))
    assert view.kv_positions[0].tolist() == list(range(5)) + [-1] * 7
    with pytest.raises(ValueError, match="update_latent"):
        cache.update(0, *_kv(2, 1, 1, D=16), positions=_pos(2, 5, 6))
    with pytest.raises(ValueError, match=r"c_kv must be \(B, N, 16\)"):
        cache.update_latent(0, torch.randn(2, 1, 15), r[:, :1], positions=_pos(2, 5, 6))


def test_update_errors_name_the_problem():
    cache = KVCache([FullSpec(2, 8)])
    with pytest.raises(ValueError, match=r"k must be \(B, 2, N, 8\)"):
        cache.update(0, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), positions=_pos(1, 0, 4))
    with pytest.raises(ValueError, match=r"positions must have shape \(4,\) or \(1, 4\).*got \(1, 3\)"):
        cache.update(0, *_kv(1, 2, 4), positions=_pos(1, 0, 3))
    with pytest.raises(TypeError, match="integer tensor"):
        cache.update(0, *_kv(1, 2, 4), positions=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="out of range"):
        cache.update(1, *_kv(1, 2, 4), positions=_pos(1, 0, 4))
    with pytest.raises(TypeError, match="layer spec"):
        KVCache([object()])
    assert cache.seq_length == 0
