"""``masks.topk`` lists that repeat keys: a repeat counts once, so a tile whose keys are not all listed is never
FULL, however many entries name some of them (counting entries marked such a tile FULL: error 2.53 on the tiled
backend). The tiled and Flex paths equal the float64 reference, per-head lists included (#46: the missing test)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks

B, H, NQ, NK, D = 1, 2, 64, 96, 16


def _lists():
    idx = torch.full((B, H, NQ, 24), -1)
    idx[0, 0, :, :16] = 5  # key 5, sixteen times: a 16-key tile's worth of entries (a FULL tile needs every head)
    idx[0, 1, :, :16] = 7
    idx[0, :, 40:, :24] = torch.cat([torch.arange(32, 47), torch.tensor([40] * 9)])  # 15 of tile 32..47, repeats
    return idx


@pytest.mark.parametrize("backend", ["tiled", "flex", "auto", "gather", "sdpa"])
def test_repeated_keys_count_once(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (NQ, NK, NK))
    m = masks.topk(_lists())
    bm = m.block_map(NQ, NK, 16, 16, B=B, H=H)
    assert not bool((bm == 2).any()), "no tile is fully listed"
    ref = qkv.attention(q.double(), k.double(), v.double(), mask=m, backend="reference")
    try:
        out = qkv.attention(q, k, v, mask=m, backend=backend)
    except ValueError as e:
        assert backend == "flex" and "cannot run" in str(e), e
        return
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
