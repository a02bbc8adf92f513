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


@pytest.mark.parametrize("q_len,kv_len", [(1, 3), (1, 4099), (300, 300), (37, 5000)])
def test_attention_flops_count_window_entries_and_indexer(q_len, kv_len):
    """Attention FLOPs of forward_flops against a per-query enumeration: the window (up to 128 keys), the visible
    compressed entries (CSA: at most index_topk of them) at 4 H D each, and the indexer's 2 Hi Di per visible CSA
    entry."""
    from qkv.costs.model_flops import forward_flops

    p = PRESETS["deepseek-v4-flash"]
    c = p.config
    cc, H, D = c.compressed, c.num_attention_heads, c.head_dim
    want = 0
    for kind in cc.attention_types:
        for v in range(kv_len - q_len + 1, kv_len + 1):  # v = p + 1 of each query
            want += min(v, c.sliding_window) * 4 * H * D
            if kind == "sliding":
                continue
            seen = v // cc.compress_rates[kind]
            want += min(seen, cc.index_topk if kind == "csa" else seen) * 4 * H * D
            if kind == "csa":
                want += seen * 2 * cc.index_n_heads * cc.index_head_dim
    assert forward_flops(p, q_len, kv_len).attention == want


def test_decode_attention_at_1m_tokens_is_a_small_part_of_v32s_dense_count():
    """At 1M tokens one V4-Pro decode step reads 128 window keys, 512 + 8192 entries and the indexer's 262,144
    scores per layer: a few percent of DeepSeek-V3.2 counted dense (qkv.costs.dsa_model_flops counts its top-k)."""
    from qkv.costs import model_flops

    v4 = model_flops(PRESETS["deepseek-v4-pro"], context=1 << 20).decode
    v32 = model_flops(PRESETS["deepseek-v3.2"], context=1 << 20).decode
    assert v4.attention < 0.05 * v32.attention and v4.total < 0.1 * v32.total


def test_presets_name_the_compressed_attention():
    """V4's presets are not labelled MQA (one shared KV head) but by their compressed attention, and the MHA
    equivalent they are compared with is plain MHA."""
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        assert PRESETS[name].attention_kind == "csa/hca"
        assert PRESETS[name].mha_equivalent().attention_kind == "mha"
    assert PRESETS["deepseek-v3.2"].attention_kind == "mla"
