"""Kimi Linear on qkv (``from_hf``: KDA layers beside NoPE MLA layers, DeepSeek-V3 routing) against HF transformers'
``KimiLinearForCausalLM`` (eager) with random weights.

The weights are redrawn at unit scale (HF's 0.02 init makes attention uniform and routing a coin toss); the
routing correction bias is as large as the spread of the sigmoid scores, and the KDA decay rates ``exp(A_log)``
spread over two decades, so some channels forget within a token and others carry the state across the prompt.
HF computes KDA in float32 even in a float64 model, so its float64 model is the reference to float32 accuracy
(HF float32 the baseline of the error budget).

- prefill logits, plain and left-padded, and a cached one-token decode step within the budget;
- cached greedy generation of a left-padded batch emits HF's ``generate`` tokens (padding must not reach the
  recurrent state);
- HF with ``attn_implementation="qkv"`` (the MLA layers through qkv) gives eager's logits;
- ``verify_cache``; a ``save_pretrained`` directory loads like the in-memory model; configs qkv refuses.

Cases: the checkpoint's ``linear_attn_config`` (layers counted from 1) and transformers' own fields with its
default layer pattern; a plain ``q_proj`` and q-LoRA; group-limited routing and one group.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import hf_causal_lm, two_row_prompt
from _parity import HFRouteParity, LogitParity
from qkv.cache import KVCache
from qkv.models import from_hf
from qkv.models.generate import generate

N_PROMPT, N_PAD, N_NEW = 14, 4, 8
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=16,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)

CASES = {
    # layers KDA, KDA, MLA, KDA (1-indexed in the checkpoint's linear_attn_config); 8 experts in 4 groups, 2 kept
    "L4-qproj-g4k2-checkpoint-names": dict(
        num_hidden_layers=4, num_local_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1,
        linear_attn_config={"num_heads": 3, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                            "full_attn_layers": [3]}),
    # transformers' default pattern (layer 4 of 5 is MLA), q-LoRA, one group, two dense layers
    "L5-qlora-default-pattern": dict(
        num_hidden_layers=5, q_lora_rank=24, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=2, linear_num_heads=2, linear_head_dim=12, linear_conv_kernel_dim=3),
}


def _redraw_decays(hf: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):  # decay rates 0.03 .. 3 per unit of softplus
                p.copy_(torch.empty(p.shape, dtype=torch.float64).uniform_(-3.5, 1.1, generator=gen).to(p.dtype))


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")
    if case not in _MODELS:
        seed = sorted(CASES).index(case)
        hf = hf_causal_lm("KimiLinearConfig", "KimiLinearForCausalLM", {**_BASE, **CASES[case]}, seed=seed,
                          attn_implementation="eager", experts_implementation="eager")
        _redraw_decays(hf, seed)
        _MODELS[case] = (hf, copy.deepcopy(hf).double().eval(), from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return two_row_prompt(100 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT,
                          pad=N_PAD if padded else 0, low=3)


def test_layers_are_what_the_config_says():
    for case, kinds in (("L4-qproj-g4k2-checkpoint-names", ["kda", "kda", "mla", "kda"]),
                        ("L5-qlora-default-pattern", ["kda", "kda", "kda", "kda", "mla"])):
        hf, _, model = _models(case)
        got = ["kda" if layer.recurrent else "mla" for layer in model.layers]
        assert got == kinds, case
        assert [s.kind for s in model.cache_specs()] == ["recurrent" if k == "kda" else "latent" for k in kinds]
        mla = model.layers[kinds.index("mla")].self_attn
        assert mla.rope is None and not mla.config.use_rope and model.ropes == {}
        moe = [type(layer.mlp).__name__ == "MoE" for layer in model.layers]
        assert moe == [t == "sparse" for t in hf.config.mlp_layer_types], case


class TestHFParity(LogitParity, HFRouteParity):
    """The shared parity suite (tests/_parity.py); qkv float64 also equals HF float64 closely, and padding leaves the
    padded row's tokens what the row alone generates."""

    CASES, N_NEW = CASES, N_NEW
    HF_PADDED_POSITIONS = False

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)

    def generation_cache(self, case, model):
        return KVCache(model.cache_specs())

    def check_prefill(self, case, model, ids, truth):
        with torch.no_grad():
            double = copy.deepcopy(model).double()(ids).logits
        torch.testing.assert_close(double, truth, rtol=1e-5, atol=1e-5)  # HF's float32 KDA bounds the agreement

    def check_generation(self, case, model, ids, mask, out, expected):
        alone = generate(model, ids[1:, N_PAD:], max_new_tokens=N_NEW)
        assert torch.equal(out.new_tokens[1], alone.new_tokens[0]), "padding changed the padded row's tokens"


@pytest.mark.parametrize("storage", ["dynamic", "static", "paged"])
@pytest.mark.parametrize("case", list(CASES))
def test_verify_cache(case, storage):
    """Cached decoding equals recomputation (decode, fork) under each storage. Cropping and paged prefix reuse are
    left out: a recurrent layer keeps one state, not its tokens, and refuses both."""
    from qkv.cache import Paged, Static
    from qkv.models import verify_cache

    model = _models(case)[2]
    make = {"dynamic": lambda: KVCache(model),
            "static": lambda: KVCache(model, storage=Static(64)),
            "paged": lambda: KVCache(model, storage=Paged(block_size=4, num_blocks=128))}[storage]
    report = verify_cache(model, make, crop=0)
    assert report.ok, str(report)


def test_checkpoint_directory_loads_like_the_model(tmp_path):
    """``save_pretrained`` files (per-expert tensors, the routing correction bias, the KDA layers) load into the same
    model as the in-memory HF model."""
    case = "L4-qproj-g4k2-checkpoint-names"
    hf, _, model = _models(case)
    hf.save_pretrained(tmp_path)
    loaded = from_hf(tmp_path)
    ids, _ = _prompt(case, padded=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_checkpoint_missing_a_kda_convolution_is_named():
    from qkv.models.family_kimi_linear import convert
    from qkv.models.loading import CheckpointError

    hf = _models("L4-qproj-g4k2-checkpoint-names")[0]
    state = dict(hf.state_dict())
    conv = state.pop("model.layers.1.self_attn.conv1d.weight")
    state["model.layers.1.self_attn.q_conv1d.weight"] = conv[: conv.shape[0] // 3]
    with pytest.raises(CheckpointError, match=r"lacks \['model.layers.1.self_attn.k_conv1d.weight', "):
        convert(state, hf.config.to_dict())


@pytest.mark.parametrize("change, match", [
    ({"hidden_act": "gelu"}, "KDA convolution is SiLU only"),
    ({"mla_use_nope": False}, "mla_use_nope=False"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"moe_router_activation_func": "softmax"}, "sigmoid scores"),
    ({"linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2]}}, r"for layers \[4\]"),
    ({"linear_attn_config": {"num_heads": 0, "kda_layers": [1, 2, 4], "full_attn_layers": [3]}},
     "linear_num_key_heads must be a positive int, got 0"),
], ids=["gelu", "rope-mla", "moe-every-2", "softmax-router", "layer-unnamed", "no-heads"])
def test_unsupported_configs_fail_clearly(change, match):
    from qkv.models.family_kimi_linear import decoder_config
    from qkv.models.loading import CheckpointError

    cfg = {**_models("L4-qproj-g4k2-checkpoint-names")[0].config.to_dict(), **change}
    if "linear_attn_config" in change:
        cfg.pop("layer_types")
    with pytest.raises(CheckpointError, match=match):
        decoder_config(cfg)
