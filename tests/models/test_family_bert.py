"""BERT's segment-batched self-attention (packed sentences batched by segment) equals the plain masked one."""

from __future__ import annotations

import pytest
import torch

from qkv import masks
from qkv.models.family_bert import PackedSelfAttention
from qkv.nn import MultiHeadAttention

SEGMENTS = {
    "ragged": [0, 0, 0, 1, 1, 2, 3, 3, 3, 3],
    "two": [5] * 6 + [7] * 4,
    "similar-lengths-padded-group": [0] * 16 + [1] * 15 + [2] * 3 + [3] * 14 + [4] * 16,
    "non-contiguous": [0, 1, 0, 1, 1, 2, 2, 0, 0, 0],
}


@pytest.mark.parametrize("ids", list(SEGMENTS.values()), ids=list(SEGMENTS))
def test_segment_batched_attention_equals_masked_attention(ids):
    torch.manual_seed(0)
    attn = PackedSelfAttention(32, 4)
    x = torch.randn(1, len(ids), 32, dtype=torch.float64)
    attn.double()
    mask = masks.document(torch.tensor(ids))
    fast = attn(x, mask=mask).out
    plain = MultiHeadAttention.forward(attn, x, mask=mask).out
    assert torch.allclose(fast, plain, atol=1e-12), (fast - plain).abs().max()
