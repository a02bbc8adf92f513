"""Qwen3, Qwen3-MoE, OLMo 2, OLMo 3, GPT-OSS and DeepSeek-V3 on qkv against HF transformers (eager).

Each case is a tiny HF model from a config whose weights are redrawn at unit scale (HF's 0.02 init makes
attention nearly uniform and routing a coin toss, hiding mistakes); sink logits, router biases and
DeepSeek-V3's routing correction bias are drawn large enough to change which experts win and where the
softmax mass goes. Per family:

- prefill logits, plain and left-padded, and a cached one-token decode step: qkv float32 within the error
  budget of HF float64 (the reference), with HF float32 as the baseline;
- cached greedy generation of a left-padded batch emits HF's ``generate`` tokens;
- HF with ``attn_implementation="qkv"`` gives eager's logits.

Configs vary GQA (4:1, 2:1), MQA, sliding layers shorter than the prompt, YaRN (GPT-OSS untruncated,
DeepSeek's mscale), q-LoRA, group-limited routing and ``norm_topk_prob``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from _hf import hf_causal_lm, two_row_prompt, within_budget
from _parity import HFRouteParity, LogitParity
from qkv.cache import KVCache, Static
from qkv.models import from_hf
from qkv.testing import assert_within_budget

N_PROMPT, N_PAD, N_NEW = 14, 4, 8
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64)

# id -> (HF config class, HF model class, config overrides, KV-cache storage for the generation test)
CASES = {
    "qwen3-Hq8-Hkv2-untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False), "dynamic"),
    "qwen3-MQA-W5-layer1-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, use_sliding_window=True, sliding_window=5,
        max_window_layers=1, tie_word_embeddings=True), "static"),
    "qwen3_moe-E6-k2-normtopk": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True), "dynamic"),
    "olmo2-Hq4-Hkv2": ("Olmo2Config", "Olmo2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2), "dynamic"),
    "olmo3-L4-MQA-W5": ("Olmo3Config", "Olmo3ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, sliding_window=5), "static"),
    "gpt_oss-Hq4-Hkv2-W5-yarn-sinks": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}), "dynamic"),
    "gpt_oss-L4-MQA-W4": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4,
        num_local_experts=6, num_experts_per_tok=3, intermediate_size=24, swiglu_limit=2.0, swiglu_alpha=1.2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}), "static"),
    "deepseek_v3-qlora24-noaux-yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
        n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0}), "dynamic"),
}


def _transformers():
    return pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    _transformers()
    if case not in _MODELS:
        cfg_cls, model_cls, overrides, _ = CASES[case]
        hf = hf_causal_lm(cfg_cls, model_cls, {**_BASE, **overrides}, seed=sorted(CASES).index(case),
                          attn_implementation="eager", experts_implementation="eager")
        ref = copy.deepcopy(hf).double().eval()
        _MODELS[case] = (hf, ref, from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return two_row_prompt(100 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT,
                          pad=N_PAD if padded else 0)


class TestHFParity(LogitParity, HFRouteParity):
    """The shared parity suite (tests/_parity.py); generation on the case's storage."""

    CASES, N_NEW = CASES, N_NEW

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)

    def generation_cache(self, case, model):
        storage = Static(N_PROMPT + N_NEW) if CASES[case][3] == "static" else None
        return KVCache(model.cache_specs(), storage=storage)


def test_config_switches_reach_the_model():
    """The families' switches land where declared: whole-projection QK-norm and no pre-norms (OLMo), sinks and
    the clamped experts (GPT-OSS), the correction bias (DeepSeek-V3), per-head QK-norm (Qwen3)."""
    olmo = _models("olmo2-Hq4-Hkv2")[2]
    attn = olmo.layers[0].self_attn
    assert attn.q_norm.weight.shape == (4 * 16,) and attn.k_norm.weight.shape == (2 * 16,)
    assert olmo.layers[0].attn_norm is None and olmo.layers[0].ffn_out_norm is not None
    oss = _models("gpt_oss-L4-MQA-W4")[2]
    assert oss.layers[0].self_attn.sinks.shape == (4,) and oss.config.layer_types[:2] == (
        "sliding_attention", "full_attention")
    assert type(oss.layers[0].mlp.experts).__name__ == "ClampedSwiGLUExperts"
    ds = _models("deepseek_v3-qlora24-noaux-yarn")[2]
    assert ds.layers[1].mlp.e_score_correction_bias.abs().sum() > 0
    assert _models("qwen3-Hq8-Hkv2-untied")[2].layers[0].self_attn.q_norm.weight.shape == (16,)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"model_type": "deepseek_v3", "topk_method": "greedy"}, "noaux_tc"),
    ({"model_type": "gpt_oss", "num_local_experts": None}, "gpt_oss"),
], ids=["qwen3moe-dense-layers", "deepseek-v3-routing", "gpt-oss-experts"])
def test_unsupported_configs_fail_clearly(change, match):
    from qkv.models import CheckpointError
    from qkv.models.loading import _family

    source = {"qwen3_moe": "qwen3_moe-E6-k2-normtopk", "deepseek_v3": "deepseek_v3-qlora24-noaux-yarn",
              "gpt_oss": "gpt_oss-L4-MQA-W4"}[change["model_type"]]
    cfg = {**_models(source)[0].config.to_dict(), **change}
    with pytest.raises(CheckpointError, match=match):
        _family(cfg).build(cfg)


def test_mxfp4_gpt_oss_checkpoint_is_refused():
    from qkv.models import CheckpointError
    from qkv.models.family_gpt_oss import convert

    cfg = _models("gpt_oss-L4-MQA-W4")[0].config.to_dict()
    with pytest.raises(CheckpointError, match="MXFP4"):
        convert({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1)}, cfg)


def _tiny(name: str):
    from qkv.nn import DecoderLM, get_config

    torch.manual_seed(0)
    return DecoderLM(get_config(name)).eval()


@pytest.mark.parametrize("source", ["gpt_oss-L4-MQA-W4", "olmo3-L4-MQA-W5", "tiny-gemma", "tiny-mistral"])
def test_default_cache_keeps_only_the_window_in_sliding_layers(source):
    """Bytes held per layer after prefills of 24 and 160 tokens (then 3 decode steps): sliding layers hold the
    same (flat in the context), full layers grow; the planner's dynamic-storage figure agrees per layer."""
    from qkv.cache import plan_memory

    model = _tiny(source) if source.startswith("tiny") else _models(source)[2]
    vocab = model.config.vocab_size
    held = {}
    for n in (24, 160):
        cache = KVCache(model.cache_specs())
        ids = torch.randint(1, vocab, (2, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            model(ids, cache=cache)
            for _ in range(3):
                model(ids[:, -1:], cache=cache)
        held[n] = [(m.kind, m.allocated_bytes) for m in cache.memory().layers]
        plan = plan_memory(model, batch=2, context=n + 3, new_tokens=3, dtype=torch.float32)
        assert [round(layer.allocated_bytes) for layer in plan.layers] == [b for _, b in held[n]], (n, plan)
    kinds = [k for k, _ in held[24]]
    assert "sliding" in kinds
    for i, kind in enumerate(kinds):
        if kind == "sliding":
            assert held[24][i] == held[160][i], f"layer {i} grew with the context: {held}"
            window = model.config.window_for(i)
            assert held[160][i][1] <= 2 * 4 * max(16, window) * _row_bytes(model, i), held[160][i]  # 2 rows
        else:
            assert held[160][i][1] > held[24][i][1]


def _row_bytes(model, i: int) -> int:
    spec = model.cache_specs()[i]
    return spec.row_bytes(torch.float32) + 8


_ONE_PER_TYPE = ["qwen3-MQA-W5-layer1-tied", "qwen3_moe-E6-k2-normtopk", "olmo2-Hq4-Hkv2", "olmo3-L4-MQA-W5",
                 "gpt_oss-Hq4-Hkv2-W5-yarn-sinks", "deepseek_v3-qlora24-noaux-yarn"]


@pytest.mark.parametrize("storage", ["dynamic", "static", "paged"])
@pytest.mark.parametrize("case", _ONE_PER_TYPE)
def test_verify_cache_every_family_and_storage(case, storage):
    """Cached decoding equals recomputation (decode, crop, fork; paged: prefix reuse) for each new family
    under each storage."""
    from qkv.cache import Paged
    from qkv.models import verify_cache

    model = _models(case)[2]
    make = {"dynamic": lambda: KVCache(model, rollback=4),
            "static": lambda: KVCache(model, storage=Static(64), rollback=4),
            "paged": lambda: KVCache(model, storage=Paged(block_size=4, num_blocks=128, prefix_caching=True))}[storage]
    report = verify_cache(model, make)
    assert report.ok, str(report)


@pytest.mark.parametrize("case", ["qwen3_moe-E6-k2-normtopk", "olmo3-L4-MQA-W5", "gpt_oss-L4-MQA-W4",
                                  "deepseek_v3-qlora24-noaux-yarn"])
def test_checkpoint_directory_loads_like_the_model(case, tmp_path):
    """``save_pretrained`` files (per-expert tensors where transformers writes them, the routing correction
    bias, sinks) load into the same model as the in-memory HF model."""
    hf, _, model = _models(case)
    hf.save_pretrained(tmp_path)
    loaded = from_hf(tmp_path)
    ids, _ = _prompt(case, padded=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_clamped_experts_single_token_path_equals_a_float64_loop():
    """GPT-OSS experts: the one-token path and the grouped path against a float64 per-token loop written from
    the formula (clamps, ``(up + 1) * gate * sigmoid(alpha * gate)``)."""
    from qkv.nn.moe import ClampedSwiGLUExperts

    torch.manual_seed(0)
    ex = ClampedSwiGLUExperts(5, 16, 8, alpha=1.3, limit=1.0)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(16))
    x, idx, w = torch.randn(3, 16), torch.tensor([[4, 1], [0, 4], [2, 3]]), torch.rand(3, 2)

    def expert(e, v):  # gate rows first, then up rows
        gu = ex.gate_up_proj[e].double() @ v + ex.gate_up_proj_bias[e].double()
        g, u = gu[:8].clamp(max=1.0), gu[8:].clamp(-1.0, 1.0)
        return ex.down_proj[e].double() @ ((u + 1) * g * torch.sigmoid(1.3 * g)) + ex.down_proj_bias[e].double()

    with torch.no_grad():
        want = torch.stack([sum(w[t, j].double() * expert(e, x[t].double()) for j, e in enumerate(idx[t].tolist()))
                            for t in range(3)])
        grouped = ex(x, idx, w)
        assert want.abs().max() > 0.1
        for t in range(3):
            assert_within_budget(ex(x[t:t + 1], idx[t:t + 1], w[t:t + 1])[0], want[t], grouped[t],
                                 what=f"token {t}")
        torch.testing.assert_close(grouped.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["deepseek_v3-qlora24-noaux-yarn", "qwen3-MQA-W5-layer1-tied",
                                  "gpt_oss-Hq4-Hkv2-W5-yarn-sinks"])
def test_plan_memory_equals_the_cache_from_hf_builds(case):
    """``plan_memory`` on the loaded model, before anything is allocated, gives each layer's bytes (MLA latents,
    window and full layers) that the default cache then holds after a prefill and decode steps."""
    from qkv.cache import plan_memory

    model = _models(case)[2]
    ids, _ = _prompt(case, padded=False)
    cache = KVCache(model.cache_specs())
    with torch.no_grad():
        model(ids, cache=cache)
        for _ in range(5):
            model(ids[:, -1:], cache=cache)
    plan = plan_memory(model, batch=2, context=N_PROMPT + 5, new_tokens=5)
    assert [round(layer.allocated_bytes) for layer in plan.layers] == [m.allocated_bytes for m in cache.memory().layers]
    assert [layer.kind for layer in plan.layers] == [m.kind for m in cache.memory().layers]


@pytest.mark.parametrize("change, match", [
    (dict(qk_norm=True, qk_norm_scope="heads"), "qk_norm_scope must be 'head' or 'projection'"),
    (dict(pre_norms=False), "pre_norms=False needs sandwich_norms=True"),
], ids=["qk-norm-scope", "no-norm-at-all"])
def test_decoder_config_refuses_bad_switches(change, match):
    from qkv.nn import DecoderConfig

    with pytest.raises(ValueError, match=match):
        DecoderConfig(vocab_size=10, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=8,
                      **change)


def test_sinks_with_latent_attention_are_refused():
    from qkv.nn import DecoderConfig, LatentConfig

    latent = LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=8, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match="attention_sinks are not supported with latent attention"):
        DecoderConfig(vocab_size=10, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=8,
                      latent=latent, attention_sinks=True)


@pytest.mark.parametrize("change, match", [
    (dict(topk_method="sigmoid"), "topk_method must be one of"),
    (dict(topk_method="noaux_tc", n_group=3), "noaux_tc needs n_group dividing"),
    (dict(swiglu_limit=0.0), "swiglu_limit must be > 0"),
    (dict(topk_method="noaux_tc", n_group=8), "two best experts"),
], ids=["method", "noaux-groups", "swiglu-limit", "noaux-one-per-group"])
def test_moe_config_refuses_bad_routing(change, match):
    from qkv.nn import MoEConfig

    with pytest.raises(ValueError, match=match):
        MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, **{"topk_group": 1, **change})


def test_deepseek_v3_without_shared_experts_matches_hf():
    """``n_shared_experts=0``: transformers builds zero-width shared experts (empty tensors, adding zero); from_hf
    drops them and the model still gives HF's logits."""
    _transformers()
    _, _, overrides, _ = CASES["deepseek_v3-qlora24-noaux-yarn"]
    hf = hf_causal_lm("DeepseekV3Config", "DeepseekV3ForCausalLM", {**_BASE, **overrides, "n_shared_experts": 0},
                      seed=7, attn_implementation="eager", experts_implementation="eager")
    assert any(p.numel() == 0 for n, p in hf.named_parameters() if "shared_experts" in n)
    model = from_hf(hf)
    assert all(layer.mlp.shared_experts is None for layer in model.layers[1:])
    ids, _ = two_row_prompt(7, _BASE["vocab_size"], N_PROMPT)
    with torch.no_grad():
        within_budget(model(ids).logits, copy.deepcopy(hf).double()(ids).logits, hf(ids).logits,
                      what="deepseek_v3 without shared experts")



def test_one_expert_renormalized_weighs_one_as_in_qwen_routers():
    """Qwen's routers renormalize the top-k weights whatever k is: with one expert per token its weight is 1. A
    Qwen3-MoE with ``num_experts_per_tok=1`` and ``norm_topk_prob`` gives HF's logits."""
    _transformers()
    _, _, overrides, _ = CASES["qwen3_moe-E6-k2-normtopk"]
    hf = hf_causal_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**_BASE, **overrides, "num_experts_per_tok": 1},
                      seed=8, attn_implementation="eager", experts_implementation="eager")
    model = from_hf(hf)
    ids, _ = two_row_prompt(8, _BASE["vocab_size"], N_PROMPT)
    with torch.no_grad():
        within_budget(model(ids).logits, copy.deepcopy(hf).double()(ids).logits, hf(ids).logits,
                      what="qwen3_moe with one expert per token")
