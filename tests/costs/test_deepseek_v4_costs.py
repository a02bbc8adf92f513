"""DeepSeek-V4 presets in qkv.costs: parameter counts against the published sizes, the cache arithmetic of
``kv_cache_memory`` against the pools qkv's :class:`qkv.cache.CompressedSpec` plans (the ones the decoding cache
holds), and the report's KV comparison with DeepSeek-V3.2 at 1M tokens (DeepSeek-AI 2026, DeepSeek-V4 report:
V4-Pro about 10% of V3.2's KV cache)."""

from __future__ import annotations

import pytest

from qkv.cache.describe import cache_specs_of
from qkv.costs import PRESETS, kv_cache_memory, num_parameters

V4 = ("deepseek-v4-flash", "deepseek-v4-pro")


@pytest.mark.parametrize("name,total,active", [("deepseek-v4-flash", 284e9, 13e9), ("deepseek-v4-pro", 1.6e12, 49e9)])
def test_parameters_match_the_published_sizes(name, total, active):
    """qkv builds no multi-token-prediction module (about 1.7% of Pro), so Pro's total is 1.57T; active counts the
    embedding and the LM head, as the published figures do."""
    p = num_parameters(PRESETS[name])
    assert abs(p.total / total - 1) < 0.02, f"{name}: {p.total / 1e9:.1f}B"
    assert abs(p.active / active - 1) < 0.07, f"{name}: {p.active / 1e9:.2f}B active"
    n, d = 4, PRESETS[name].config.hidden_size
    assert p.residual == PRESETS[name].config.num_hidden_layers * 2 * (n * d * 24 + 27) + n * d * n + n + 1
    assert p.total == p.embedding + p.attention + p.ffn + p.norms + p.lm_head + p.residual


@pytest.mark.parametrize("name", V4)
@pytest.mark.parametrize("context", [1, 3, 127, 128, 129, 1000, 1 << 20])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kv_memory_equals_the_planned_pools(name, context, dtype):
    specs = cache_specs_of(PRESETS[name].config)
    planned = sum(s.bytes_for(context, {"bf16": "bfloat16", "fp32": "float32"}[dtype]) for s in specs)
    m = kv_cache_memory(PRESETS[name], context=context, batch=3, dtype=dtype)
    assert m.total_bytes == 3 * planned
    assert {g.kind for g in m.layers} == {"local", "csa", "hca", "carry"}


def test_pro_kv_is_about_a_tenth_of_v32_at_1m_tokens():
    v4 = kv_cache_memory(PRESETS["deepseek-v4-pro"], context=1 << 20).total_bytes
    v32 = kv_cache_memory(PRESETS["deepseek-v3.2"], context=1 << 20).total_bytes
    assert 0.08 < v4 / v32 < 0.13, f"{v4 / v32:.3f}"  # 0.111: 10.0 GB against 90.1 GB in BF16


def test_mha_equivalent_is_full_attention_without_compression():
    mha = PRESETS["deepseek-v4-pro"].mha_equivalent()
    c = mha.config
    assert c.compressed is None and c.hyper is None and c.num_key_value_heads == 128
    assert kv_cache_memory(mha, context=1000).total_bytes == 61 * 1000 * 128 * 2 * 512 * 2
