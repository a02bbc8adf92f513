"""OLMo-hybrid (``olmo_hybrid``) on qkv against HF transformers (eager): Gated DeltaNet layers whose write strength
``beta = 2 sigmoid(b)`` lies in ``[0, 2]`` (negative eigenvalues of the transition) beside OLMo 3 attention layers.

Each case is a tiny HF model with weights redrawn at unit scale (``tests/_hf.py``), so the decay and write gates, the
output gate and the post-norms all move the logits. The shared parity suite (``tests/_parity.py``) checks prefill,
a cached decode continuing the recurrent state (a two-token step, then one token), left padding, greedy
generation and the HF route; qkv float64 equals HF float64 to a relative 1e-8 once HF's float32 islands (the delta
rule, norms, softmax, RoPE) are made float64. Cases: HF's default layer pattern, an explicit pattern with attention
first and MQA, and ``linear_allow_neg_eigval=False`` (beta in ``[0, 1]``, Qwen3.5's rule).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import float64_rope, float64_throughout, hf_causal_lm, two_row_prompt
from _parity import HFRouteParity, LogitParity
from qkv.cache import KVCache
from qkv.models import CheckpointError, from_hf
from qkv.models.generate import generate
from qkv.models.verify import verify_cache

N_PROMPT, N_PAD, N_NEW = 14, 4, 8
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=64,
             num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CASES = {
    "olmo_hybrid-L4-default-negeig": dict(),
    "olmo_hybrid-attn-first-MQA-Hv2-negeig-tied": dict(
        num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=2, linear_value_head_dim=16,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "olmo_hybrid-L4-beta01": dict(linear_allow_neg_eigval=False),
}


def _transformers():
    return pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    _transformers()
    if case not in _MODELS:
        hf = hf_causal_lm("OlmoHybridConfig", "OlmoHybridForCausalLM", {**_BASE, **CASES[case]},
                          seed=80 + sorted(CASES).index(case), attn_implementation="eager")
        _MODELS[case] = (hf, copy.deepcopy(hf).double().eval(), from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return two_row_prompt(400 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT, pad=N_PAD if padded else 0)


class TestHFParity(LogitParity, HFRouteParity):
    """The shared parity suite (tests/_parity.py); a chunked prefill generates HF's tokens too."""

    CASES, N_NEW = CASES, N_NEW
    DECODE_TAIL = (2, 1)

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)

    def check_generation(self, case, model, ids, mask, out, expected):
        chunked = generate(model, ids, max_new_tokens=N_NEW, attention_mask=mask, prefill_chunk_size=5)
        assert torch.equal(chunked.new_tokens, expected)


@pytest.mark.parametrize("case", list(CASES))
def test_float64_logits_equal_hf_float64(case):
    """qkv float64 against HF float64 with its float32 islands kept float64 (``float64_throughout``, and RoPE
    recomputed in float64): relative error < 1e-8 for a prompt, a left-padded row and a cached decode step."""
    ref = float64_rope(copy.deepcopy(_models(case)[1]))
    model = from_hf(ref, dtype=torch.float64)
    ids, mask = _prompt(case, padded=True)
    row = ids[1, mask[1].bool()][None]
    with torch.no_grad():
        ours, padded = model(ids[:1]).logits, model(ids, attention_mask=mask).logits[1, N_PAD:]
        cache = KVCache(model.cache_specs())
        model(ids[:1, :-3], cache=cache)
        model(ids[:1, -3:-1], cache=cache)
        step = model(ids[:1, -1:], cache=cache).logits[:, -1]
        with float64_throughout():  # the reference only: qkv runs outside, its own casts unmasked
            truth, truth_row = ref(ids[:1]).logits, ref(row).logits[0]
    for what, got, want in (("prefill", ours, truth), ("left-padded row", padded, truth_row),
                            ("cached decode step", step, truth[:, -1])):
        rel = ((got - want).norm() / want.norm()).item()
        assert got.dtype == torch.float64 and rel < 1e-8, f"{case} {what}: relative error {rel:.2e}"


def test_switches_reach_the_model():
    hf, _, model = _models("olmo_hybrid-L4-default-negeig")
    c = model.config
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) == tuple(hf.config.layer_types)
    lin = model.layers[0].linear_attn
    assert type(lin).__name__ == "SplitGatedDeltaNet" and lin.allow_neg_eigval and lin.norm.eps == 1e-5
    assert model.layers[0].attn_norm is not None and model.layers[0].attn_out_norm is None
    assert model.layers[3].attn_norm is None and model.layers[3].ffn_out_norm is not None
    assert model.layers[3].self_attn.q_norm.weight.shape == (4 * 16,)
    assert not _models("olmo_hybrid-L4-beta01")[2].layers[0].linear_attn.allow_neg_eigval
    assert [s.kind for s in model.cache_specs()] == ["recurrent"] * 3 + ["full"]


def test_negative_eigenvalues_matter():
    """The same weights with beta = sigmoid(b) (the option off) give other logits: the factor 2 is live."""
    _, _, model = _models("olmo_hybrid-L4-default-negeig")
    off = copy.deepcopy(model)
    for layer in off.layers[:3]:
        layer.linear_attn.allow_neg_eigval = False
    ids, _ = _prompt("olmo_hybrid-L4-default-negeig", padded=False)
    with torch.no_grad():
        assert (off(ids).logits - model(ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["olmo_hybrid-L4-default-negeig", "olmo_hybrid-attn-first-MQA-Hv2-negeig-tied"])
def test_verify_cache(case):
    """Cached decode and fork equal recomputation (crop is refused for recurrent layers, as for every hybrid)."""
    model = _models(case)[2]
    report = verify_cache(model, lambda: KVCache(model.cache_specs()), crop=0, max_new_tokens=4)
    assert [ch.name for ch in report.checks] == ["decode", "fork"] and report.ok, str(report)


def test_plan_memory_and_param_count_equal_the_model():
    from qkv.cache import plan_memory
    from qkv.costs import ModelPreset, num_parameters

    model = _models("olmo_hybrid-attn-first-MQA-Hv2-negeig-tied")[2]
    ids, _ = _prompt("olmo_hybrid-attn-first-MQA-Hv2-negeig-tied", padded=False)
    cache = KVCache(model.cache_specs())
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, -1:], cache=cache)
    plan = plan_memory(model, batch=2, context=N_PROMPT + 1, new_tokens=1)
    assert [round(layer.allocated_bytes) for layer in plan.layers] == [m.allocated_bytes for m in cache.memory().layers]
    count = num_parameters(ModelPreset.from_config(model.config))
    assert count.total == sum(p.numel() for p in model.parameters())


def test_checkpoint_directory_loads_like_the_model(tmp_path):
    hf, _, model = _models("olmo_hybrid-attn-first-MQA-Hv2-negeig-tied")
    hf.save_pretrained(tmp_path)
    ids, _ = _prompt("olmo_hybrid-attn-first-MQA-Hv2-negeig-tied", padded=False)
    with torch.no_grad():
        assert torch.equal(from_hf(tmp_path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("change, match", [
    (dict(layer_types=["linear_attention"] * 4), "needs both linear_attention and full_attention layers"),
    (dict(layer_types=["full_attention"] * 4), "needs both linear_attention and full_attention layers"),
    (dict(model_type="olmo3"), "family_olmo_hybrid: model_type 'olmo3' is not olmo_hybrid"),
    (dict(linear_num_value_heads=3), "must be a multiple of linear_num_key_heads"),
], ids=["all-linear", "all-attention", "wrong-type", "heads"])
def test_bad_configs_are_refused(change, match):
    from qkv.models import family_olmo_hybrid

    cfg = {**_models("olmo_hybrid-L4-default-negeig")[0].config.to_dict(), **change}
    with pytest.raises(CheckpointError, match=match):
        family_olmo_hybrid.build(cfg)


def test_bad_options_are_refused():
    from qkv.config.linear import LinearAttentionConfig
    from qkv.nn import GatedDeltaNet

    with pytest.raises(TypeError, match="allow_neg_eigval must be True or False, got 1"):
        GatedDeltaNet(32, num_k_heads=2, num_v_heads=2, head_k_dim=8, head_v_dim=8, allow_neg_eigval=1)
    with pytest.raises(ValueError, match="allow_neg_eigval is an option of the gated_deltanet mixers"):
        LinearAttentionConfig(mixer="kda", linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                              linear_value_head_dim=8, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="norm_eps must be a positive float or None, got 0"):
        LinearAttentionConfig(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                              linear_value_head_dim=8, norm_eps=0)
