"""qkv.costs for sparse attention by selection: top-k pair counts equal the mask's allowed pairs, the indexer's
FLOPs equal a count of its matmuls, and DSA beats dense MLA at long context but not at short; DeepSeek-V3.2's
preset, parameter count and cache bytes count the indexer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkv import masks as M
from qkv.config.dsa import IndexerConfig
from qkv.costs import (
    PRESETS,
    ModelPreset,
    attention_flops,
    dsa_crossover_context,
    dsa_indexer_bytes,
    dsa_indexer_flops,
    dsa_layer_flops,
    dsa_model_flops,
    kv_cache_memory,
    num_parameters,
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


_V32 = dict(hidden_size=7168, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=1536,
            index_n_heads=64, index_head_dim=128, index_topk=2048)


@pytest.mark.parametrize("nq,nk,k", [(q, kv, k) for q in (1, 2, 5, 9) for kv in (1, 3, 8, 9) for k in (1, 2, 8, 20)],
                         ids=lambda x: str(x))
def test_topk_pairs_closed_form_equals_the_row_by_row_sum(nq, nk, k):
    kk = min(k, nk)
    rows = [min(max(i + nk - nq + 1, 0), kk) for i in range(nq)]  # query i sees p + 1 keys, reads at most K
    assert topk_pairs(nq, nk, k) == sum(rows)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_crossover_is_the_first_context_where_dsa_wins(decode):
    at = dsa_crossover_context(**_V32, decode=decode)
    q_len = 1 if decode else None
    before, after = dsa_layer_flops(1, at - 1, q_len=q_len, **_V32), dsa_layer_flops(1, at, q_len=q_len, **_V32)
    assert before.sparse >= before.dense and after.sparse < after.dense, (at, before, after)
    assert _V32["index_topk"] < at < 2 * _V32["index_topk"]
    later = [dsa_layer_flops(1, n, q_len=q_len, **_V32) for n in (at + 1, 4 * at, 1 << 20)]
    assert all(f.sparse < f.dense for f in later)


def test_an_indexer_as_wide_as_mla_never_wins():
    wide = {**_V32, "index_n_heads": 128, "index_head_dim": 2 * 512 + 64}
    assert dsa_crossover_context(**wide, decode=True) is None and dsa_crossover_context(**wide) is None


def test_dsa_model_flops_sum_the_layers_of_the_preset():
    p = PRESETS["deepseek-v3.2"]
    f = dsa_model_flops(p, context=131072, batch=2)
    layer = dsa_layer_flops(2, 131072, **_V32)
    assert f.prefill == tuple(61 * v for v in layer) and f.decode.dense == 61 * dsa_layer_flops(
        2, 131072, q_len=1, **_V32).dense
    assert (f.crossover_prefill, f.crossover_decode) == (dsa_crossover_context(**_V32),
                                                         dsa_crossover_context(**_V32, decode=True))
    with pytest.raises(ValueError, match="no lightning indexer"):
        dsa_model_flops(PRESETS["deepseek-v3"], context=1024)
    with pytest.raises(ValueError, match="context"):
        dsa_model_flops(p, context=0)
    with pytest.raises(ValueError, match="limit"):
        dsa_crossover_context(**_V32, limit=0)


def test_deepseek_v32_preset_is_transformers_config():
    """The preset's numbers are ``DeepseekV32Config()``'s defaults (the DeepSeek-V3.2-Exp checkpoint's)."""
    transformers = pytest.importorskip("transformers")
    from qkv.config import preset_from_hf_config

    read = preset_from_hf_config(transformers.DeepseekV32Config().to_dict(), name="deepseek-v3.2")
    ours = PRESETS["deepseek-v3.2"]
    fields = ("num_hidden_layers", "num_attention_heads", "hidden_size", "latent", "vocab_size", "intermediate_size",
              "moe", "max_position_embeddings", "indexer", "layer_types", "tie_word_embeddings")
    assert {f: getattr(ours.config, f) for f in fields} == {f: getattr(read.config, f) for f in fields}
    assert ours.config == read.config and ours.key_head_dim == read.key_head_dim == 192


def test_cache_bytes_count_the_indexer_key():
    from qkv.cache import IndexedLatentSpec, plan_memory
    from qkv.cache.plan import resolve_specs

    p = PRESETS["deepseek-v3.2"]
    m = kv_cache_memory(p, context=1000, dtype="bf16")
    assert m.bytes_per_token == 61 * (512 + 64 + 128) * 2 and m.total_bytes == 1000 * m.bytes_per_token
    assert resolve_specs("deepseek-v3.2")[0] == [IndexedLatentSpec(512, 64, 128)] * 61
    assert plan_memory("deepseek-v3.2", context=1000).needed_bytes == m.total_bytes
    llama = PRESETS["llama-3-8b"].config
    with pytest.raises(ValueError, match=r"indexer \(DeepSeek Sparse Attention\) needs latent"):
        llama.replace(indexer=IndexerConfig(index_n_heads=4, index_head_dim=8, index_topk=2))
    with pytest.raises(ValueError, match="IndexerConfig: index_topk must be a positive int, got None"):
        dataclasses.replace(p.config.indexer, index_topk=None)


def test_deepseek_v32_is_deepseek_v3_plus_its_indexers():
    indexer = 1536 * 64 * 128 + 7168 * 128 + 7168 * 64 + 2 * 128  # wq_b, wk, weights_proj, the key's LayerNorm
    v3, v32 = num_parameters(PRESETS["deepseek-v3"]), num_parameters(PRESETS["deepseek-v3.2"])
    assert v32.total - v3.total == v32.active - v3.active == 61 * indexer
    assert num_parameters(ModelPreset.from_config(PRESETS["deepseek-v3.2"].config)).total == v32.total


def test_num_parameters_equals_the_from_hf_model():
    transformers = pytest.importorskip("transformers")
    from qkv.config import preset_from_hf_config
    from qkv.models import from_hf

    cfg = transformers.DeepseekV32Config(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, index_n_heads=2, index_head_dim=16, index_topk=4)
    torch.manual_seed(0)
    hf = transformers.DeepseekV32ForCausalLM(cfg).eval()
    ours = from_hf(hf)
    count = num_parameters(preset_from_hf_config(cfg.to_dict(), name="tiny-v32"))
    numel = sum(p.numel() for p in ours.parameters())
    assert count.total == numel == sum(p.numel() for p in hf.parameters())
    assert count.total == num_parameters(ModelPreset.from_config(ours.config)).total
