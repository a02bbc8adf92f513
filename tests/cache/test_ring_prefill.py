"""Issue 29 item 16: a ring store (Static storage, sliding-window layer) given a prefill longer than its window
attends like full recomputation, for the prefill's own queries and for every decode step after it."""

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.cache import KVCache, SlidingWindowSpec, Static

W, H, D = 4, 2, 8


@pytest.mark.parametrize("prefill", [5, 9, 13], ids=lambda n: f"N{n}-W{W}")
@pytest.mark.parametrize("rollback", [0, 2], ids=lambda r: f"rollback{r}")
def test_ring_store_prefill_longer_than_window_matches_full_recompute(prefill, rollback):
    g = torch.Generator().manual_seed(prefill)
    total = prefill + 5
    q, k, v = (torch.randn(1, H, total, D, generator=g, dtype=torch.float64) for _ in range(3))
    full = qkv.attention(q, k, v, mask=M.sliding_window(W - 1), backend="reference")  # (1, H, total, D)
    cache = KVCache([SlidingWindowSpec(W, H, D)], storage=Static(32), rollback=rollback)
    steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, total)]
    for a, b in steps:
        pos = torch.arange(a, b)[None]
        view = cache.update(0, k[:, :, a:b], v[:, :, a:b], positions=pos)
        out = qkv.attention(q[:, :, a:b], view.k, view.v, backend="reference",
                            mask=M.positions(view.q_positions, view.kv_positions, window=W))
        err = (out - full[:, :, a:b]).abs().max().item()
        assert err < 1e-12, f"step {a}:{b}: max error {err:.3g} against full recomputation"
        assert cache.layer_tokens(0) <= W + rollback
