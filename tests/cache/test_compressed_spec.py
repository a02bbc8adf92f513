"""DeepSeek-V4's multi-pool cache spec (qkv.cache.compressed.CompressedSpec): each pool counted by hand, CSA and HCA,
plan_memory over a V4 config counting every pool, the runtime cache refused clearly, bad specs refused."""

from __future__ import annotations

import pytest

from qkv.cache import CompressedSpec, KVCache, SlidingWindowSpec, plan_memory
from qkv.cache.describe import cache_specs_of
from qkv.config import DecoderConfig
from qkv.config.compressed import CompressedAttentionConfig


def _config() -> DecoderConfig:
    cc = CompressedAttentionConfig(attention_types=("sliding", "csa", "hca"), q_lora_rank=16, o_groups=2,
                                   o_lora_rank=8, qk_rope_head_dim=4, index_n_heads=2, index_head_dim=8, index_topk=2,
                                   compress_rates={"csa": 4, "hca": 16})
    return DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, sliding_window=8,
                         layer_types=("sliding_attention",) * 3, attention_sinks=True, position="none", compressed=cc)


def test_csa_pools_by_hand():
    s = CompressedSpec(window=8, head_dim=16, rate=4, index_head_dim=8)
    pools = s.pools(30, "float32")  # 7 complete windows, 2 tokens pending
    carry = (2 * 2 * 16 * 3 + 2 * 2 * 8 * 3) + (2 * 16 * 4 + 2 * 8 * 4)  # pending (value, gate; 2 series) + last A
    assert pools == {"window": 8 * 16 * 4, "compressed": 7 * 16 * 4, "indexer": 7 * 8 * 4, "carry": carry * 4}
    assert s.bytes_for(30, "float32") == sum(pools.values())
    assert s.bytes_per_token("float32") == (16 + 8) * 4 / 4
    assert s.fixed_bytes("float32") == (8 * 16 + carry) * 4
    assert s.kind == "compressed" and s.tokens_for(30) == 7 and s.overlap


def test_hca_pools_by_hand():
    s = CompressedSpec(window=8, head_dim=16, rate=16)
    pools = s.pools(40, "bfloat16")
    assert pools == {"window": 8 * 16 * 2, "compressed": 2 * 16 * 2, "indexer": 0, "carry": 2 * 16 * 15 * 2}
    assert not s.overlap


def test_a_v4_config_declares_and_plans_every_pool():
    c = _config()
    specs = cache_specs_of(c)
    assert specs == [SlidingWindowSpec(8, 1, 16), CompressedSpec(8, 16, 4, 8), CompressedSpec(8, 16, 16, 0)]
    plan = plan_memory(c, batch=2, context=100, dtype="float32")
    want = [2 * 8 * 2 * 16 * 4, 2 * specs[1].bytes_for(100, "float32"), 2 * specs[2].bytes_for(100, "float32")]
    assert [lay.needed_bytes for lay in plan.layers] == want
    assert [lay.kind for lay in plan.layers] == ["sliding", "compressed", "compressed"]
    with pytest.raises(ValueError, match="CompressedSpec .*does not keep.*CompressedCache"):
        KVCache(specs)


@pytest.mark.parametrize("bad", [dict(window=0, head_dim=16, rate=4), dict(window=8, head_dim=16, rate=0),
                                 dict(window=8, head_dim=16, rate=4, index_head_dim=-1)])
def test_bad_specs_refused(bad):
    with pytest.raises(ValueError, match="must be an int >="):
        CompressedSpec(**bad)
