"""The 2025 presets (GPT-OSS, Qwen3, DeepSeek-V3, OLMo 2/3): ``qkv.costs.num_parameters`` equals the parameter
count of the HF model built (on the meta device, no memory) from the published config values, and reading
the same config through ``preset_from_hf_config`` gives the registry preset's count and layout."""

from __future__ import annotations

import pytest
import torch

from qkv.costs import PRESETS, num_parameters, preset_from_hf_config

_YARN_OSS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
             "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
_OSS = dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
            num_experts_per_tok=4, vocab_size=201088, sliding_window=128, max_position_embeddings=131072,
            rope_parameters=_YARN_OSS, attention_bias=True, tie_word_embeddings=False)
_QWEN3 = dict(head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

# preset -> (HF config class, HF model class, the published config.json values)
PUBLISHED = {
    "gpt-oss-20b": ("GptOssConfig", "GptOssForCausalLM", dict(_OSS, num_hidden_layers=24, num_local_experts=32)),
    "gpt-oss-120b": ("GptOssConfig", "GptOssForCausalLM", dict(_OSS, num_hidden_layers=36, num_local_experts=128)),
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        _QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=12288)),
    "qwen3-32b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        _QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=25600)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _QWEN3, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        intermediate_size=12288, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5, vocab_size=129280,
        max_position_embeddings=163840, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096})),
    "olmo-2-32b": ("Olmo2Config", "Olmo2ForCausalLM", dict(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
        intermediate_size=27648, vocab_size=100352, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "olmo-3-7b": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=100278, max_position_embeddings=65536, sliding_window=4096,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
}


def _hf(name: str):
    transformers = pytest.importorskip("transformers", reason="the HF model is the reference count")
    cfg_cls, model_cls, values = PUBLISHED[name]
    cfg = getattr(transformers, cfg_cls)(**values)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg)
    return cfg, model


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_count_equals_the_hf_model(name):
    cfg, model = _hf(name)
    hf_total = sum(p.numel() for p in model.parameters())
    preset = PRESETS[name]
    assert num_parameters(preset).total == hf_total, (name, num_parameters(preset), hf_total)
    read = preset_from_hf_config({**cfg.to_dict(), "model_type": cfg.model_type})
    assert num_parameters(read).total == hf_total
    assert read.config.layer_types == preset.config.layer_types
    assert read.config.sliding_window == preset.config.sliding_window
    assert (read.config.num_key_value_heads, read.key_head_dim, read.config.latent) == (
        preset.config.num_key_value_heads, preset.key_head_dim, preset.config.latent)


@pytest.mark.parametrize("name, billions", [("gpt-oss-20b", 20.9), ("gpt-oss-120b", 116.8), ("qwen3-8b", 8.2),
                                            ("qwen3-32b", 32.8), ("qwen3-235b-a22b", 235.1), ("deepseek-v3", 671.0),
                                            ("olmo-2-32b", 32.2), ("olmo-3-7b", 7.3)])
def test_preset_sizes_are_the_published_ones(name, billions):
    """The totals round to the sizes the model cards state (a wrong width would move them)."""
    assert round(num_parameters(PRESETS[name]).total / 1e9, 1) == pytest.approx(billions, abs=0.1)


def test_new_presets_have_versioned_sources():
    for name in PUBLISHED:
        assert "config.json (preset format 1)" in PRESETS[name].source, name
