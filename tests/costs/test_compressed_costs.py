"""qkv.costs.compressed: closed-form pair counts equal brute-force sums; scheme costs order as expected; bad input."""

from __future__ import annotations

import itertools

import pytest

from qkv.costs import compressed_pairs, csa_cost, dense_cost, dsa_cost, hca_cost, sliding_cost, sliding_pairs


def _brute(n, rate, topk, q_len):
    return sum((p + 1) // rate if topk is None else min((p + 1) // rate, topk) for p in range(n - (q_len or n), n))


@pytest.mark.parametrize("n, rate, topk, q_len", [c for c in itertools.product([1, 5, 37, 130], [1, 3, 4],
                                                                              [None, 1, 5, 30], [None, 1, 7])
                                                  if not c[3] or c[3] <= c[0]])
def test_pairs_equal_brute_force(n, rate, topk, q_len):
    assert compressed_pairs(n, rate=rate, topk=topk, q_len=q_len) == _brute(n, rate, topk, q_len)
    w = 3 * rate
    assert sliding_pairs(n, window=w, q_len=q_len) == sum(min(w, p + 1) for p in range(n - (q_len or n), n))


def test_schemes_at_long_context():
    n, shape = 1 << 20, dict(num_heads=16, head_dim=512)
    dense = dense_cost(n, **shape)
    sliding = sliding_cost(n, window=128, **shape)
    hca = hca_cost(n, window=128, rate=128, **shape)
    csa = csa_cost(n, window=128, rate=4, topk=512, index_n_heads=64, index_head_dim=128, **shape)
    assert sliding.decode_flops == 4 * 16 * 512 * 128 and sliding.kv_bytes == 128 * 512 * 2
    assert hca.decode_flops == 4 * 16 * 512 * (128 + n // 128)
    assert csa.decode_flops - csa.indexer_decode_flops == 4 * 16 * 512 * (128 + 512)
    assert csa.indexer_decode_flops == 2 * 64 * 129 * (n // 4)
    assert sliding.prefill_flops < hca.prefill_flops < csa.prefill_flops < dense.prefill_flops
    assert dense.kv_bytes == n * 512 * 2 and csa.kv_bytes < dense.kv_bytes / 3
    dsa = dsa_cost(n, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, topk=2048, index_n_heads=64,
                   index_head_dim=128)
    assert dsa.indexer_decode_flops == 2 * 64 * 129 * n


@pytest.mark.parametrize("call, match", [
    (lambda: compressed_pairs(0, rate=4), "context must be an int >= 1"),
    (lambda: compressed_pairs(8, rate=0), "rate must be an int >= 1"),
    (lambda: compressed_pairs(8, rate=4, topk=0), "topk must be an int >= 1"),
    (lambda: compressed_pairs(8, rate=4, q_len=9), "cannot exceed the context"),
    (lambda: sliding_pairs(8, window=0), "window must be an int >= 1"),
    (lambda: csa_cost(8, num_heads=0, head_dim=8, window=4, rate=4, topk=2, index_n_heads=1, index_head_dim=1),
     "num_heads must be an int >= 1"),
], ids=["context", "rate", "topk", "q_len", "window", "heads"])
def test_bad_inputs_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_v4_pro_against_v32_at_1m_tokens_near_the_report():
    """DeepSeek-V4's report: at 1M tokens V4-Pro needs about 27% of V3.2's single-token FLOPs and 10% of its KV.
    Assumed shapes (explicit here; the presets own them): both 61 layers, 128 heads; V4-Pro D = 512 shared KV,
    window 128, layers 2 x HCA then CSA / HCA alternating, CSA rate 4 top-1024 with a 64 x 128 indexer, HCA rate
    128, KV entries 1 byte per element (FP8) and indexer keys 0.5 (FP4); V3.2 MLA r = 512, dr = 64, DSA top-2048,
    64 x 128 indexer, FP8 latents and indexer keys; the rest of the model 2 FLOPs per active parameter (49B, 37B)."""
    n, layers = 1 << 20, 61
    kinds = ["hca", "hca"] + ["csa" if i % 2 == 0 else "hca" for i in range(layers - 2)]
    shape = dict(num_heads=128, head_dim=512, window=128, dtype_bytes=1)
    v4 = [csa_cost(n, rate=4, topk=1024, index_n_heads=64, index_head_dim=128, index_dtype_bytes=0.5, **shape)
          if k == "csa" else hca_cost(n, rate=128, **shape) for k in kinds]
    v32 = dsa_cost(n, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, topk=2048, index_n_heads=64,
                   index_head_dim=128, dtype_bytes=1, index_dtype_bytes=1)
    flops = (sum(c.decode_flops for c in v4) + 2 * 49e9) / (layers * v32.decode_flops + 2 * 37e9)
    kv = sum(c.kv_bytes for c in v4) / (layers * v32.kv_bytes)
    assert 0.24 < flops < 0.29, f"FLOPs ratio {flops:.3f}"
    assert 0.09 < kv < 0.12, f"KV ratio {kv:.3f}"
