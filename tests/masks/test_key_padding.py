"""``masks.padding`` with a (B, Nk) boolean key mask (HF's ``attention_mask``: left or any padding)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.masks.base import block_map_from_dense


def test_key_mask_allows_exactly_the_valid_keys_and_its_block_map_is_exact():
    g = torch.Generator().manual_seed(0)
    valid = torch.rand(3, 300, generator=g) < 0.8
    valid[0, :140] = False  # left padding over whole tiles
    valid[2] = True
    m = M.padding(valid)
    dense = m.materialize(3, 2, 70, 300)
    assert torch.equal(dense, valid[:, None, None, :].expand(3, 2, 70, 300))
    for bq, bk in ((64, 64), (32, 128), (70, 7)):
        got = m.block_map(70, 300, bq, bk)[:, 0]
        assert torch.equal(got, block_map_from_dense(m.dense(3, 1, 70, 300)[:, 0], bq, bk)), (bq, bk)


def test_key_mask_matches_lengths_for_right_padding_and_accepts_01_integers():
    lengths = torch.tensor([5, 9])
    valid = (torch.arange(9) < lengths.view(-1, 1)).long()
    q = k = v = torch.randn(2, 2, 9, 8)
    a = qkv.attention(q, k, v, mask=M.padding(valid) & M.causal(), backend="tiled")
    b = qkv.attention(q, k, v, mask=M.padding(lengths) & M.causal(), backend="tiled")
    assert torch.allclose(a, b, atol=1e-6)
    assert "valid keys of shape (2, 9)" in repr(M.padding(valid))


@pytest.mark.parametrize("valid,match", [
    (torch.rand(2, 9), "bool or 0/1"),
    (torch.full((2, 9), 2), "bool or 0/1"),
], ids=["float", "values"])
def test_bad_key_masks_are_named(valid, match):
    with pytest.raises(TypeError, match=match):
        M.padding(valid)


def test_key_mask_length_must_match_the_keys():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="has 5 keys but the keys have length 4"):
        qkv.attention(q, q, q, mask=M.padding(torch.ones(1, 5, dtype=torch.bool)))
