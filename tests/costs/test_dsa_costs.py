"""qkv.costs for sparse attention by selection: top-k pair counts equal the mask's allowed pairs, the indexer's
FLOPs equal a count of its matmuls, and DSA beats dense MLA at long context but not at short."""

from __future__ import annotations

import pytest
import torch

from qkv import masks as M
from qkv.costs import (
    attention_flops,
    dsa_indexer_bytes,
    dsa_indexer_flops,
    dsa_layer_flops,
    topk_attention_bytes,
    topk_attention_flops,
    topk_pairs,
)


@pytest.mark.parametrize("nq,nk,k", [(1, 1, 1), (7, 7, 3), (5, 13, 4), (13, 5, 2), (16, 16, 64), (1, 100, 10)],
                         ids=lambda x: str(x))
def test_topk_pairs_equal_the_allowed_pairs_of_full_causal_lists(nq, nk, k):
    # Lists naming the k most recent visible keys: exactly min(k, p + 1) allowed keys per causal row.
    p = torch.arange(nq) + nk - nq
    idx = (p.view(-1, 1) - torch.arange(k).view(1, -1)).clamp_min(-1).view(1, 1, nq, k)
    idx = torch.where(idx > nk - 1, -1, idx)
    allowed = (M.topk(idx) & M.causal()).dense(1, 1, nq, nk).sum().item()
    assert topk_pairs(nq, nk, k) == allowed
    assert topk_pairs(nq, nk, k, causal=False) == nq * min(k, nk)


def test_topk_attention_flops_floor_and_dense_limit():
    assert topk_attention_flops(2, 8, 100, 100, 100, 64) == attention_flops(2, 8, 100, 100, 64, causal=True) + \
        2 * 2 * 8 * 50 * 128  # the exact causal count is N/2 pairs above FlashAttention's N^2/2 convention
    n, k = 32768, 2048
    floor = 4 * 1 * 16 * n * k * 64
    assert floor * 0.9 < topk_attention_flops(1, 16, n, n, k, 64) <= floor
    assert topk_attention_bytes(1, 1, 1, 4096, 2048, 64) == 2048 * 128 * 2 + 2048 * 8 + 128 * 2


def test_indexer_flops_count_its_matmuls():
    d, qr, hi, di, n = 32, 16, 4, 8, 10
    proj = 2 * n * (qr * hi * di + d * di + d * hi)
    pairs = n * (n + 1) // 2
    assert dsa_indexer_flops(1, n, n, hidden_size=d, q_lora_rank=qr, index_n_heads=hi, index_head_dim=di) == \
        proj + 2 * pairs * hi * (di + 1) - n * hi * (di + 1)  # FlashAttention's N^2/2 causal convention
    assert dsa_indexer_bytes(1, 1, 100, index_head_dim=128) == 100 * 128 * 2 + 8 * 100


def test_dsa_beats_dense_mla_only_at_long_context():
    cfg = dict(hidden_size=7168, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=1536,
               index_n_heads=64, index_head_dim=128, index_topk=2048)
    short, long = dsa_layer_flops(1, 2048, **cfg), dsa_layer_flops(1, 131072, **cfg)
    assert short.sparse > short.dense and long.sparse < long.dense / 3
    step = dsa_layer_flops(1, 131072, q_len=1, **cfg)
    assert step.selected == 2 * 128 * 2048 * (2 * 512 + 64), "a decode step attends to K latents"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="topk"):
        topk_pairs(4, 4, 0)
    with pytest.raises(ValueError, match="index_head_dim"):
        dsa_indexer_flops(1, 4, 4, hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=0)
