"""Whole-model cost arithmetic: parameter counts (the texts' and papers' figures, and sum(p.numel()) of models
from_hf builds), prefill/decode/training and generation FLOPs against FLOPs counted by torch on a real
forward, sparse-pattern pair counts against materialized masks, linear attention against counted matmuls."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from _hf import OptionalModule
from qkv import masks
from qkv.costs import (
    AMBIGUOUS,
    PRESETS,
    bigbird_pairs,
    crossover_context,
    fixed_pairs,
    forward_flops,
    generation_flops,
    get_preset,
    kv_cache_memory,
    linear_attention_flops,
    longformer_pairs,
    model_flops,
    num_parameters,
    pairs_flops,
    performer_flops,
    preset_from_hf_config,
    score_elements,
    strided_pairs,
    window_pairs,
)

transformers = OptionalModule("transformers")

@pytest.mark.parametrize("name, total", [
    ("gpt-2-small", 124_439_808),  # HF openai-community/gpt2
    ("gpt-2-medium", 354_823_168),
    ("llama-2-70b", 68_976_648_192),  # HF meta-llama/Llama-2-70b-hf
    ("llama-3-8b", 8_030_261_248),
    ("llama-3-70b", 70_553_706_496),
    ("mistral-7b-v0.1", 7_241_732_096),
    ("gemma-2-27b", 27_227_128_320),
])
def test_parameter_counts_of_released_checkpoints(name, total):
    assert num_parameters(PRESETS[name]).total == total


@pytest.mark.parametrize("name, billions, tol", [
    ("transformer-base", 0.065, 0.05),  # Vaswani et al. Table 3: 65M
    ("gpt-3-175b", 175.0, 0.01),  # Brown et al. Table 2.1
    ("deepseek-v2", 236.0, 0.01),  # DeepSeek-V2: 236B total
])
def test_parameter_counts_match_papers(name, billions, tol):
    got = num_parameters(PRESETS[name]).total / 1e9
    assert abs(got - billions) <= tol * billions, f"{name}: {got:.4f}B vs the paper's {billions}B"


def test_deepseek_v2_active_parameters():
    c = num_parameters(PRESETS["deepseek-v2"])
    assert abs(c.active / 1e9 - 21.0) <= 0.5, c  # 21B activated per token (the paper)
    assert c.total - c.active == 59 * (160 - 6) * 3 * 5120 * 1536  # unused routed experts of 59 MoE layers


def test_transformer_base_attention_shape():
    p = PRESETS["transformer-base"].config
    assert (p.hidden_size, p.num_attention_heads, p.head_dim) == (512, 8, 64)
    assert p.num_attention_heads * p.head_dim == p.hidden_size  # the heads' widths sum to d_model


def test_texts_head_counts():
    assert PRESETS["gpt-2-medium"].config.num_attention_heads == 16
    assert PRESETS["gpt-3-175b"].config.num_attention_heads == 96
    p = PRESETS["llama-2-70b"]
    assert p.config.num_attention_heads // p.config.num_key_value_heads == 8  # g = 8
    gqa = kv_cache_memory(p, context=128_000, dtype="fp16")
    assert kv_cache_memory(p.mha_equivalent(), context=128_000, dtype="fp16").total_bytes == 8 * gqa.total_bytes


def test_lecture_n_squared_at_128k_is_ten_times_its_figure():
    # The lecture says n^2 at n = 128K is 1.6 billion ("16억"); it is 16.4 billion (128,000) or 17.2 (131,072).
    lecture = 1.6e9
    assert score_elements(128_000) == 16_384_000_000
    assert score_elements(131_072) == 17_179_869_184
    assert 10 <= score_elements(128_000) / lecture < 11


def test_mistral_versions_differ_and_the_bare_name_asks():
    v1, v3 = PRESETS["mistral-7b-v0.1"], PRESETS["mistral-7b-v0.3"]
    at32k = [kv_cache_memory(p, context=32_768).total_bytes for p in (v1, v3)]
    assert at32k[1] == 8 * at32k[0]
    assert v1.config.sliding_window == 4096 and v3.config.sliding_window is None
    with pytest.raises(ValueError, match="mistral-7b-v0.1, mistral-7b-v0.2, mistral-7b-v0.3"):
        get_preset("mistral-7b")
    assert all(v in PRESETS for versions in AMBIGUOUS.values() for v in versions)


def test_every_preset_cites_a_source():
    for p in PRESETS.values():
        assert p.source, p.name


def test_attention_only_preset_refused():
    bare = preset_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError, match="missing vocab_size, intermediate_size"):
        num_parameters(bare)
    with pytest.raises(ValueError, match="missing vocab_size"):
        generation_flops(bare, 4, 4)


def test_bad_arguments():
    p = PRESETS["llama-3-8b"]
    with pytest.raises(TypeError, match="expected a ModelPreset, a preset name"):
        num_parameters(3)
    assert num_parameters("llama-3-8b") == num_parameters(p)
    assert generation_flops("gpt-2-small", 3, 3) == generation_flops(PRESETS["gpt-2-small"], 3, 3)
    with pytest.raises(ValueError, match="new_tokens must be a positive int"):
        generation_flops(p, 4, 0)
    with pytest.raises(TypeError, match="use_cache must be a bool"):
        generation_flops(p, 4, 4, use_cache="yes")
    with pytest.raises(ValueError, match="kv_len .* must be >= q_len"):
        forward_flops(p, 8, 4)
    with pytest.raises(ValueError, match="logits must be 'all' or 'last'"):
        forward_flops(p, 8, logits="none")
    with pytest.raises(ValueError, match="encoder-decoder"):
        model_flops(PRESETS["transformer-base"], context=8)
    with pytest.raises(ValueError, match="multiple of block"):
        bigbird_pairs(30, 8)
    with pytest.raises(ValueError, match="window_blocks must be odd"):
        bigbird_pairs(32, 8, window_blocks=2)
    with pytest.raises(ValueError, match="summary .* must be <= block"):
        fixed_pairs(8, 2, 3)
    with pytest.raises(ValueError, match="left must be an int >= 0"):
        window_pairs(8, -1)



_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=64)
HF_CASES = {
    "llama-Hq8-Hkv2-untied": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-MQA-D24-tied-bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True)),
    "mistral-W5": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, tie_word_embeddings=False)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "gemma2-D32": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=5)),
    "gemma3-qknorm": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=5)),
    "deepseek-qlora-moe": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=16,
        first_k_dense_replace=1)),
    "deepseek-noqlora": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=3, n_head=4, n_positions=48, vocab_size=160)),
}


def _hf(case):
    cfg_cls, model_cls, overrides = HF_CASES[case]
    base = {} if case == "gpt2" else _BASE
    cfg = getattr(transformers, cfg_cls)(**{**base, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg).eval()


@pytest.mark.parametrize("case", list(HF_CASES))
def test_num_parameters_equals_numel_of_from_hf_model(case):
    from qkv.models import from_hf

    hf = _hf(case)
    preset = preset_from_hf_config(hf.config.to_dict(), name=case)
    ours = from_hf(hf)
    numel = sum(p.numel() for p in ours.parameters())
    hf_numel = sum(p.numel() for p in hf.parameters())
    count = num_parameters(preset)
    assert count.total == numel == hf_numel, f"{case}: counted {count}, qkv model {numel}, HF {hf_numel}"


def _counted(model, ids) -> dict[str, int]:
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(ids)
    return {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}


def test_forward_flops_match_counted_matmuls_of_a_real_decoder():
    """A qkv decoder's forward under torch's FLOP counter: every matmul outside attention is ours."""
    from qkv.nn import DecoderConfig, DecoderLM

    cfg = DecoderConfig(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                        num_key_value_heads=2, intermediate_size=80, backend="reference")
    model = DecoderLM(cfg).eval()
    preset = preset_from_hf_config({"model_type": "llama", "vocab_size": 97, "hidden_size": 48,
                                    "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
                                    "intermediate_size": 80})
    n = 11
    ops = _counted(model, torch.randint(0, 97, (2, n)))
    ours = forward_flops(preset, n, batch=2, logits="all")
    linear = sum(v for k, v in ops.items() if k in ("aten.mm", "aten.addmm"))
    assert linear == ours.rest, (ops, ours)
    # The reference backend multiplies the full (not causal) score matrix: 2 bmm of N x N x D per head.
    full = sum(v for k, v in ops.items() if k in ("aten.bmm", "aten.matmul"))
    assert full == 3 * 4 * 2 * 6 * n * n * 8, ops


def test_model_flops_parts():
    p = PRESETS["llama-3-8b"]
    m = model_flops(p, context=4096)
    assert m.prefill.lm_head == 2 * 4096 * 128256  # logits of the last token only
    assert m.training.projections == 3 * 2 * 4096 * 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2)
    assert m.decode.ffn == 2 * 32 * 3 * 4096 * 14336
    assert m.training.attention == m.prefill.attention * 7 // 2


def test_crossover_is_where_attention_catches_up():
    for name in ("gpt-2-small", "llama-2-70b", "gpt-3-175b", "deepseek-v2"):
        p = PRESETS[name]
        n = crossover_context(p)
        before, at = forward_flops(p, n - 1), forward_flops(p, n)
        assert before.attention < before.rest and at.attention >= at.rest, name
    d = PRESETS["gpt-3-175b"].config.hidden_size
    assert abs(crossover_context(PRESETS["gpt-3-175b"]) - 12 * d) < 0.01 * 12 * d  # 2 N^2 d = 24 N d^2
    assert crossover_context(PRESETS["mistral-7b-v0.1"]) is None  # a 4096 window never catches up


def _brute_generation(preset, prompt, new, use_cache):
    """Step by step, each forward counted from its own definition."""
    attn = rest = 0
    seq = prompt
    for step in range(new):
        q = seq if (step == 0 or not use_cache) else 1
        f = forward_flops(preset, q, seq, logits="last")
        attn, rest = attn + f.attention, rest + f.rest
        seq += 1
    return attn, rest


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "recompute"])
def test_generation_flops_step_by_step(use_cache):
    p = PRESETS["gpt-2-small"]
    g = generation_flops(p, 7, 9, use_cache=use_cache)
    assert (g.attention, g.rest) == _brute_generation(p, 7, 9, use_cache)


def test_generation_cache_turns_cubic_into_quadratic():
    p = PRESETS["gpt-2-small"]
    att = {c: [generation_flops(p, 1, T, use_cache=c).attention for T in (256, 512)] for c in (True, False)}
    assert 3.9 < att[True][1] / att[True][0] < 4.1  # N^2
    assert 7.8 < att[False][1] / att[False][0] < 8.1  # N^3
    cached, recomputed = (generation_flops(p, 1, 1023, use_cache=c).total for c in (True, False))
    assert recomputed > 300 * cached


def _count(mask, n):
    return int(mask.dense(1, 1, n, n).sum())


SIZES = [1, 2, 13, 64, 113]


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("left, right", [(0, 0), (3, 0), (2, 5), (200, 0)], ids=lambda v: str(v))
def test_window_and_longformer_pairs(n, left, right):
    assert window_pairs(n, left, right) == _count(masks.sliding_window(left, right), n)
    for g in (1, 4):
        mask = masks.sliding_window(left, right) | masks.global_tokens(list(range(g)))
        assert longformer_pairs(n, left, right, num_global=g) == _count(mask, n), g


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"N{n}")
def test_strided_and_fixed_pairs(n):
    for stride in (1, 3, 8):
        assert strided_pairs(n, stride) == _count(masks.strided(stride), n), stride
    for block, summary in ((4, 1), (8, 3), (5, 5)):
        assert fixed_pairs(n, block, summary) == _count(masks.fixed(block, summary), n), (block, summary)


@pytest.mark.parametrize("n, block, w, g, r", [(64, 8, 3, 1, 1), (64, 4, 5, 2, 3), (96, 8, 1, 0, 2),
                                               (32, 8, 3, 2, 9)], ids=lambda v: str(v))
def test_bigbird_pairs(n, block, w, g, r):
    for seed in (0, 5):
        assert bigbird_pairs(n, block, w, g, r) == _count(masks.bigbird(block, w, g, r, seed=seed), n)


def test_pairs_flops_is_dense_attention_on_a_full_mask():
    from qkv.costs import attention_flops

    assert pairs_flops(window_pairs(50, 49), num_heads=3, head_dim=16, batch=2) == attention_flops(
        2, 3, 50, 50, 16, causal=True) + 2 * 2 * 3 * 25 * 32  # exact N(N+1)/2 vs the N^2/2 convention


def test_linear_and_performer_flops_match_counted_matmuls():
    B, H, N, D, Dv, F = 2, 3, 17, 8, 6, 10
    q, k = torch.randn(B, H, N, F).exp(), torch.randn(B, H, N, F).exp()  # positive features
    v = torch.randn(B, H, N, Dv)
    with FlopCounterMode(display=False) as fc:
        state = k.transpose(-1, -2) @ v  # (B, H, F, Dv)
        z = k.sum(dim=2, keepdim=True)  # (B, H, 1, F)
        (q @ state) / (q @ z.transpose(-1, -2))
    assert fc.get_total_flops() == linear_attention_flops(N, features=F, num_heads=H, v_head_dim=Dv, batch=B)
    proj = torch.randn(F, D)
    x = torch.randn(B, H, N, D)
    with FlopCounterMode(display=False) as fc:
        x @ proj.T
    assert performer_flops(N, num_features=F, head_dim=D, num_heads=H, v_head_dim=Dv, batch=B) == (
        linear_attention_flops(N, features=F, num_heads=H, v_head_dim=Dv, batch=B) + 2 * fc.get_total_flops())


def test_presets_are_frozen_and_replaceable():
    llama = PRESETS["llama-3-8b"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama.notes = "changed"
    p = dataclasses.replace(llama, config=llama.config.replace(num_hidden_layers=2, name="two"))
    assert num_parameters(p).total < num_parameters(PRESETS["llama-3-8b"]).total


_SHRINK = dict(hidden_size=64, vocab_size=97, intermediate_size=96, head_dim=16)


def _shrunk(name):
    p = PRESETS[name]
    c = p.config
    kw = dict(_SHRINK, num_hidden_layers=4 if c.sliding_window else 2, layer_types=None,
              num_attention_heads=8, num_key_value_heads=max(1, 8 * c.num_key_value_heads // c.num_attention_heads),
              max_position_embeddings=64 if c.position == "learned" else c.max_position_embeddings)
    kw.update(nope_layers=tuple(i for i in c.nope_layers if i < kw["num_hidden_layers"]))  # SmolLM3: the first ones
    if "local" in p.layer_counts and "global" in p.layer_counts:
        kw.update(layer_types=("sliding_attention", "full_attention") * 2, sliding_window=8)
    elif c.sliding_window:
        kw.update(sliding_window=8, layer_types=("sliding_attention",) * 4)
    if c.kv_shared_from is not None:  # Gemma 4: the last two layers read layers 0 and 1, per-type heads, PLE
        kw.update(kv_shared_from=(None, None, 0, 1), head_dim_by_type={"full_attention": 32},
                  kv_heads_by_type={"full_attention": kw["num_key_value_heads"]},
                  per_layer_input_size=8 if c.per_layer_input_size else None,
                  per_layer_vocab_size=97 if c.per_layer_input_size else None,
                  intermediate_sizes=(96, 96, 192, 192) if c.intermediate_sizes else None)
    if c.latent is not None:
        del kw["head_dim"]
        kw.update(num_key_value_heads=8, latent=dataclasses.replace(
            c.latent, hidden_size=64, num_attention_heads=8, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=12, q_lora_rank=24))
    if c.moe is not None:
        widths = dict(shared_expert_intermediate_size=24) if c.moe.shared_expert_intermediate_size else {}
        kw.update(moe=dataclasses.replace(c.moe, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                          **widths))
    if c.compressed is not None:  # DeepSeek-V4: a sliding-only, an HCA and two CSA layers, each its sliding branch
        kw.update(num_key_value_heads=1, compressed=dataclasses.replace(
            c.compressed, attention_types=("sliding", "hca", "csa", "csa"), q_lora_rank=24, o_groups=2, o_lora_rank=8,
            qk_rope_head_dim=8, index_n_heads=4, index_head_dim=8, index_topk=2, compress_rates={"csa": 2, "hca": 4}))
    if "recurrent" in p.layer_counts:  # hybrid: a recurrent layer and a full-attention one
        kw.update(layer_types=("linear_attention", "full_attention"), linear_attention=dataclasses.replace(
            c.linear_attention, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_num_value_heads=2 if c.linear_attention.mixer == "kda" else 4,  # KDA: as many key as value heads
            linear_value_head_dim=8))
    return dataclasses.replace(p, config=c.replace(name=f"{name}-small", **kw))


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if not p.encoder_layers])
def test_preset_shaped_model_has_the_counted_parameters(name):
    from qkv.config.decoder import decoder_config_from_preset
    from qkv.nn import DecoderLM

    small = _shrunk(name)
    model = DecoderLM(decoder_config_from_preset(small))
    numel = sum(p.numel() for p in model.parameters())
    assert numel == num_parameters(small).total, (name, numel, num_parameters(small))
    with torch.no_grad():
        assert model(torch.randint(0, 97, (1, 9))).logits.shape == (1, 9, 97)


def test_get_config_builds_a_small_model_shaped_like_a_preset():
    from qkv.nn import DecoderLM, get_config

    cfg = get_config("mistral-7b-v0.1", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=50)
    assert cfg.sliding_window == 4096 and cfg.layer_types == ("sliding_attention",) * 2
    assert DecoderLM(cfg)(torch.randint(0, 50, (1, 5))).logits.shape == (1, 5, 50)
    full = get_config("llama-2-70b")
    assert (full.num_key_value_heads, full.head_dim, full.intermediate_size) == (8, 128, 28672)
    with pytest.raises(ValueError, match="pick one of"):
        get_config("mistral-7b")
    with pytest.raises(ValueError, match="encoder-decoder"):
        get_config("transformer-base")
    with pytest.raises(ValueError, match="unknown preset 'llama-9'"):
        get_config("llama-9")


@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3"])
def test_get_config_carries_a_new_width_and_head_count_into_mla(name):
    """An MLA preset shrunk by get_config overrides builds a model of that width (the latent config follows the
    overrides; it used to keep the preset's width and fail at the first forward)."""
    from qkv.config.latent import LatentConfig
    from qkv.nn import DecoderLM, get_config

    cfg = get_config(name, num_hidden_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=50,
                     intermediate_size=64)  # one layer: the dense one (the experts come later)
    assert (cfg.latent.hidden_size, cfg.latent.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 4)
    with torch.no_grad():
        assert DecoderLM(cfg)(torch.randint(0, 50, (1, 5))).logits.shape == (1, 5, 50)
    wrong = dataclasses.replace(cfg.latent, hidden_size=32)
    with pytest.raises(ValueError, match=r"latent.hidden_size \(32\) must equal hidden_size \(64\)"):
        cfg.replace(latent=wrong)
    assert isinstance(cfg.replace(hidden_size=128).latent, LatentConfig)
    assert cfg.replace(hidden_size=128).latent.hidden_size == 128


def test_hf_experts_without_their_width_are_not_counted_as_a_dense_model():
    """A HF config naming routed experts but not their width describes attention only: the whole-model counts
    refuse it rather than count a dense feed-forward; its cache is still counted."""
    cfg = {"model_type": "deepseek_v2", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
           "vocab_size": 100, "intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2}
    p = preset_from_hf_config(cfg)
    assert p.config.attention_only and p.config.moe is None and not p.whole_model
    with pytest.raises(ValueError, match="describes attention only"):
        num_parameters(p)
    assert kv_cache_memory(p, context=16).total_bytes == 2 * 16 * 2 * 4 * 16 * 2
    dense = preset_from_hf_config({k: v for k, v in cfg.items() if not k.endswith(("_experts", "_per_tok"))})
    assert dense.whole_model and num_parameters(dense).total > 0


def test_get_config_takes_the_presets_context_length():
    from qkv.costs import get_preset
    from qkv.nn import get_config

    for name in ("llama-3-8b", "mistral-7b-v0.3", "gpt-2-small", "gemma-3-27b"):
        p = get_preset(name)
        want = p.context_limit
        assert get_config(name).max_position_embeddings == want, name
