"""The GLM-5 preset: its numbers are transformers' ``GlmMoeDsaConfig()`` defaults (checkpoint ``zai-org/GLM-5``), its
parameter count equals HF's model built on the meta device and the published 744B, and its KV bytes per token
count the indexer key beside MLA's latent."""

from __future__ import annotations

import pytest
import torch

from qkv.costs import PRESETS, kv_cache_memory, num_parameters


def test_glm5_preset_is_transformers_config_and_hfs_parameter_count():
    transformers = pytest.importorskip("transformers")
    from qkv.config import preset_from_hf_config

    cfg = transformers.GlmMoeDsaConfig()
    read = preset_from_hf_config(cfg.to_dict(), name="glm-5")
    ours = PRESETS["glm-5"]
    assert ours.config == read.config
    with torch.device("meta"):
        hf = transformers.GlmMoeDsaForCausalLM(cfg)
    total = sum(p.numel() for p in hf.parameters())
    n = num_parameters(ours)
    assert n.total == total == 743_911_199_232, (n, total)
    assert round(n.total / 1e9) == 744  # Z.ai: 744B parameters
    assert 40e9 < n.active < 42e9  # Z.ai: 40B active; qkv counts the embedding and LM head rows too (41.8B)


def test_glm5_kv_bytes_per_token_count_the_indexer_key():
    from qkv.cache import IndexedLatentSpec, plan_memory
    from qkv.cache.plan import resolve_specs

    m = kv_cache_memory(PRESETS["glm-5"], context=1000, dtype="bf16")
    assert m.bytes_per_token == 78 * (512 + 64 + 128) * 2 == 109_824
    assert resolve_specs("glm-5")[0] == [IndexedLatentSpec(512, 64, 128)] * 78
    assert plan_memory("glm-5", context=1000).needed_bytes == m.total_bytes


def test_glm5_preset_builds_the_family_config():
    """from_hf's reading of the default config has the preset's shape, plus what only the model needs (GLM-5's
    interleaved indexer RoPE and noaux_tc routing)."""
    transformers = pytest.importorskip("transformers")
    from qkv.models.family_glm_moe_dsa import decoder_config

    got = decoder_config(transformers.GlmMoeDsaConfig().to_dict())
    want = PRESETS["glm-5"].config
    for f in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size", "max_position_embeddings"):
        assert getattr(got, f) == getattr(want, f), f
    assert (got.latent.kv_lora_rank, got.latent.q_lora_rank, got.latent.v_head_dim) == (512, 2048, 256)
    assert got.indexer.interleaved_rope and got.moe.topk_method == "noaux_tc" and got.moe.n_routed_experts == 256
