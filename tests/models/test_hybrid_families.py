"""Qwen3-Next and Qwen3.5 (text, and the multimodal checkpoint's language model) on qkv against HF transformers.

Hybrid decoders: Gated DeltaNet layers (recurrent state in the KV cache) between gated full-attention layers
(output gate, QK-norm, partial RoPE); Qwen3-Next's feed-forward a mixture of experts with a gated shared expert.
Each case is a tiny HF model with weights redrawn at unit scale (``tests/_hf.py``), so output gates, decay gates,
write strengths, routing and the shared expert's gate all move the logits. HF eager float64 is the reference
(HF runs the delta rule, its norms and the softmax in float32 even then, so the reference is float32-accurate
there; qkv's float64 path is checked against itself by ``verify_cache`` and against HF's layers in
``tests/nn/test_gated_deltanet.py``), HF float32 the baseline of the error budget:

- prefill logits and a cached one-token decode step, plain and left-padded;
- cached greedy generation of a left-padded batch emits HF's ``generate`` tokens;
- HF with ``attn_implementation="qkv"`` (its full-attention layers through qkv) gives eager's logits;
- ``verify_cache`` (decode, fork; crop is refused naming the recurrent layer; so is paged prefix sharing).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from _hf import hf_causal_lm, two_row_prompt
from _parity import HFRouteParity, LogitParity
from qkv.cache import KVCache, Paged
from qkv.models import from_hf
from qkv.models.generate import generate
from qkv.models.loading import CheckpointError
from qkv.models.verify import verify_cache

N_PROMPT, N_PAD, N_NEW = 14, 4, 8
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=64,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

# id -> (HF config class, HF model class, config overrides)
CASES = {
    "qwen3_next-L4-interval4-E6-normtopk": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(**_MOE)),
    "qwen3_next-full-first-MQA-rot0.5": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        **{**_MOE, "num_experts_per_tok": 3}, num_key_value_heads=1, norm_topk_prob=False,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5})),
    "qwen3_5_text-L4-Hv8": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        linear_num_value_heads=8, linear_value_head_dim=4, tie_word_embeddings=True)),
    "qwen3_5_moe_text-E6-k3": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        **{**_MOE, "num_experts_per_tok": 3}, layer_types=["linear_attention", "full_attention"] * 2)),
}


def _transformers():
    return pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    _transformers()
    if case not in _MODELS:
        cfg_cls, model_cls, overrides = CASES[case]
        hf = hf_causal_lm(cfg_cls, model_cls, {**_BASE, **overrides}, seed=40 + sorted(CASES).index(case),
                          attn_implementation="eager", experts_implementation="eager")
        ref = copy.deepcopy(hf).double().eval()
        _MODELS[case] = (hf, ref, from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return two_row_prompt(200 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT,
                          pad=N_PAD if padded else 0)


class TestHFParity(LogitParity, HFRouteParity):
    """The shared parity suite (tests/_parity.py); the cached decode continues the recurrent state by a
    multi-token step before the last token, and a chunked prefill generates HF's tokens too."""

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
def test_verify_cache_and_what_recurrent_layers_refuse(case):
    _, _, model = _models(case)
    first_linear = model.config.layer_types.index("linear_attention")
    report = verify_cache(model, lambda: KVCache(model.cache_specs()), crop=0, max_new_tokens=4)
    assert [c.name for c in report.checks] == ["decode", "fork"] and report.ok
    report = verify_cache(model, lambda: KVCache(model.cache_specs()), crop=2, fork=False, max_new_tokens=3,
                          raise_on_failure=False)
    crop = report.checks[1]
    assert crop.name == "crop" and not crop.ok
    assert f"layer {first_linear} (RecurrentSpec): a recurrent layer keeps one state" in crop.detail
    ids, mask = _prompt(case, padded=True)
    paged = KVCache(model.cache_specs(), storage=Paged(block_size=4, num_blocks=64, prefix_caching=True))
    with pytest.raises(ValueError, match=rf"match_prefix: layer {first_linear} \(RecurrentSpec\)"):
        generate(model, ids, max_new_tokens=2, attention_mask=mask, cache=paged)
    plain_paged = KVCache(model.cache_specs(), storage=Paged(block_size=4, num_blocks=64))
    out = generate(model, ids, max_new_tokens=N_NEW, attention_mask=mask, cache=plain_paged)
    assert torch.equal(out.new_tokens, generate(model, ids, max_new_tokens=N_NEW, attention_mask=mask).new_tokens)


def test_switches_reach_the_model():
    _, _, nxt = _models("qwen3_next-full-first-MQA-rot0.5")
    c = nxt.config
    assert c.layer_types == ("full_attention", "linear_attention", "linear_attention", "full_attention")
    assert c.attn_output_gate and c.qk_norm and c.norm_offset == 1.0
    assert nxt.ropes["full_attention"].emb.rotary_dim == 8  # half of head_dim 16
    assert c.moe.shared_expert_gate and c.moe.shared_width == 48 and not c.moe.norm_topk_prob
    assert nxt.layers[1].mlp.shared_expert_gate.weight.shape == (1, 64)
    assert type(nxt.layers[1].linear_attn).__name__ == "GatedDeltaNet"
    assert [s.kind for s in nxt.cache_specs()] == ["full", "recurrent", "recurrent", "full"]
    _, _, q35 = _models("qwen3_5_text-L4-Hv8")
    assert q35.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)  # HF's interval 4
    assert type(q35.layers[0].linear_attn).__name__ == "SplitGatedDeltaNet" and q35.config.moe is None
    assert q35.ropes["full_attention"].emb.rotary_dim == 4 and q35.lm_head is None
    _, _, moe = _models("qwen3_5_moe_text-E6-k3")
    assert type(moe.layers[0].linear_attn).__name__ == "SplitGatedDeltaNet"
    assert moe.config.moe.norm_topk_prob and moe.config.moe.shared_expert_gate  # HF always renormalizes here


def test_qwen3_5_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A ``qwen3_5`` checkpoint (text config nested, ``model.language_model.*``, vision and MTP weights beside):
    its language model loads, vision and MTP weights are left out, the outer config's tying decides."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    hf, _, text_model = _models("qwen3_5_text-L4-Hv8")
    text_cfg = hf.config.to_dict()
    state = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v.contiguous()
             for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    state["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text_cfg,
           "vision_config": {"model_type": "qwen3_5_vision", "depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = from_hf(tmp_path)
    ids, _ = _prompt("qwen3_5_text-L4-Hv8", padded=False)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, text_model(ids).logits, rtol=0, atol=0)
    cfg["tie_word_embeddings"] = False  # then the checkpoint lacks lm_head.weight: named
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing tensors \['lm_head.weight'\]"):
        from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": None}))
    with pytest.raises(CheckpointError, match=r"a qwen3_5 config needs its language model's text_config"):
        from_hf(tmp_path)


@pytest.mark.parametrize("change, match", [
    ({"mlp_only_layers": [0]}, r"qwen3_next with dense layers \(mlp_only_layers=\[0\]"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2\) is not supported"),
    ({"layer_types": ["linear_attention", "chunked_attention", "full_attention", "full_attention"]},
     r"layer types \['chunked_attention'\] \(Llama 4's chunked attention\) not supported"),
])
def test_unsupported_configs_fail_clearly(change, match):
    hf, _, _ = _models("qwen3_next-L4-interval4-E6-normtopk")
    cfg = {**hf.config.to_dict(), **change}
    from qkv.models import family_qwen3_next

    with pytest.raises(CheckpointError, match=match):
        family_qwen3_next.decoder_config(cfg)


def test_linear_layers_of_other_families_are_refused():
    from qkv.models import family_llama

    cfg = dict(model_type="llama", vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=2, layer_types=["linear_attention", "full_attention"])
    with pytest.raises(CheckpointError, match=r"'linear_attention' layers are read for \['kimi_linear', 'olmo_hybrid', "
                                              r"'qwen3_5_moe_text', 'qwen3_5_text', 'qwen3_next', 'qwen4_exp_text'\] "
                                              r"only"):
        family_llama.decoder_config(cfg)


def test_gated_q_proj_of_the_wrong_height_is_named():
    hf, _, _ = _models("qwen3_5_text-L4-Hv8")
    state = dict(hf.state_dict())
    state["model.layers.3.self_attn.q_proj.weight"] = state["model.layers.3.self_attn.q_proj.weight"][:64]
    from qkv.models import family_qwen3_next

    with pytest.raises(CheckpointError, match=r"model.layers.3.self_attn.q_proj.weight has 64 rows; gated attention "
                                              r"needs 2 \* heads \* head_dim = 128"):
        family_qwen3_next.convert(state, hf.config.to_dict())
