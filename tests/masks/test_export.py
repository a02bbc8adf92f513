"""Mask exports (qkv.masks.export) against mask.dense() and FlexAttention's create_block_mask, on CPU."""

from __future__ import annotations

import pytest
import torch

from _helpers import mask_catalogue
from qkv import masks
from qkv.masks.base import block_map_from_dense

B, H, NQ, NK, BLK = 2, 2, 100, 130, 16
_CATALOGUE = {k: m for k, m in mask_catalogue(B, NQ, NK).items() if m is not None}
_CATALOGUE["documents"] = masks.document_from_cu_seqlens(torch.tensor([0, 40, 41, 100, 130])) & masks.causal()
_CATALOGUE["head_fn"] = masks.from_fn(lambda b, h, q, k: (k <= q) & ((k + h) % 2 == 0))
_lists = torch.randint(-1, NK, (B, H, NQ, 12), generator=torch.Generator().manual_seed(3))
_lists[0, 1, :20] = torch.arange(12) + 16  # whole rows of one key tile listed: FULL tiles exist
_CATALOGUE["topk_per_head"] = masks.topk(_lists) & masks.causal()
_CATALOGUE["topk_shared"] = masks.topk(_lists[:, :1])
_repeats = torch.full((B, H, NQ, 20), -1)
_repeats[:, 0, 30:50, :16] = 32  # one key 16 times (each head): a tile's width of entries, one key of it listed
_repeats[:, 1, 30:50, :16] = 33
_repeats[1, 1, 60:80] = torch.cat([torch.arange(48, 63), torch.tensor([48] * 5)])  # 15 of 16 keys, one repeated
_CATALOGUE["topk_repeats_per_head"] = masks.topk(_repeats)


def _dense_tiles(m):
    """(B, H, TQ, TK) tile classes from the dense mask: the ground truth."""
    d = m.materialize(B, H, NQ, NK).reshape(B * H, NQ, NK)
    return block_map_from_dense(d, BLK, BLK).view(B, H, *block_map_from_dense(d[:1], BLK, BLK).shape[-2:])


@pytest.mark.parametrize("name", list(_CATALOGUE))
def test_exports_cover_exactly_the_allowed_tiles(name):
    m = _CATALOGUE[name]
    truth = _dense_tiles(m)
    mask_cnt, mask_idx, full_cnt, full_idx = m.to_block_sparse(B, H, NQ, NK, block_q=BLK, block_k=BLK)
    tq, tk = truth.shape[-2:]
    got = torch.zeros(B, H, tq, tk, dtype=torch.int8)
    for cnt, idx, cls in ((mask_cnt, mask_idx, 1), (full_cnt, full_idx, 2)):
        cnt, idx = cnt.expand(B, H, tq), idx.expand(B, H, tq, tk)
        for b in range(B):
            for h in range(H):
                for r in range(tq):
                    got[b, h, r, idx[b, h, r, :cnt[b, h, r]].long()] = cls
    # FULL exactly where the dense mask fills a tile; a conservative map may call an empty tile PARTIAL, never
    # the reverse (a non-empty tile is always listed)
    assert torch.equal(got == 2, truth == 2), name
    assert bool(((truth != 0) <= (got != 0)).all()), name
    for b in range(B):
        for h in range(H):
            indptr, indices = m.to_bsr(NQ, NK, block=BLK, b=b, h=h, B=B, H=H)
            listed = m.to_block_list(NQ, NK, block=BLK, b=b, h=h, B=B, H=H)
            sel = torch.zeros(tq, tk, dtype=torch.bool)
            sel[listed[:, 0], listed[:, 1]] = True
            assert torch.equal(sel, got[b, h] != 0)
            assert indptr[-1] == len(indices) == len(listed)
            rows = torch.repeat_interleave(torch.arange(tq), (indptr[1:] - indptr[:-1]).long())
            assert torch.equal(torch.stack([rows, indices.long()], 1), listed)


@pytest.mark.parametrize("name", list(_CATALOGUE))
def test_flex_block_mask_equals_create_block_mask(name):
    from torch.nn.attention.flex_attention import create_block_mask
    m = _CATALOGUE[name]
    ours = m.to_flex_block_mask(B, H, NQ, NK, block_size=BLK)
    ref = create_block_mask(lambda b, h, q, k: m.allowed(b, h, q, k, NQ, NK), B, H, NQ, NK, device="cpu",
                            BLOCK_SIZE=BLK)
    d_ours, d_ref = ours.to_dense(), ref.to_dense()
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks), name
    # equal, or (composed masks whose analytic map is conservative) extra tiles that the dense mask leaves empty
    extra = d_ours.bool() & ~d_ref.bool()
    assert bool((d_ref.bool() <= d_ours.bool()).all()), name
    if bool(extra.any()):
        assert "&" in repr(m) or "~" in repr(m), f"{name}: only composed masks may be conservative"
        truth = _dense_tiles(m)
        assert bool((truth.expand_as(extra)[extra] == 0).all()), name
    else:
        assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks), name


def test_export_bad_inputs():
    with pytest.raises(ValueError, match="Nq must be a positive int"):
        masks.causal().to_block_sparse(1, 1, 0, 4)
    with pytest.raises(ValueError, match="b=3"):
        masks.causal().to_bsr(8, 8, block=4, b=3)
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        masks.causal().to_block_list(8, 8, block=(4, 0))
