"""SmolLM3 (``smollm3``) on qkv against HF transformers (eager): NoPE layers in a GQA decoder.

Every ``no_rope_layer_interval``-th layer rotates nothing (or as HF's ``no_rope_layers`` lists); the option is the
description's ``nope_layers``, honoured by the one attention module. Cases: the default interval, an explicit
``no_rope_layers`` list with NoPE on the first layer, a sliding window on the NoPE layers (HF's
``use_sliding_window``, shorter than the prompt), biases, an untied head. Weights are redrawn at unit scale
(``tests/_hf.py``); the shared parity suite (``tests/_parity.py``) checks prefill, cached decode, left padding,
greedy generation and the HF route, and qkv float64 is checked against HF float64 to a relative 1e-8.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import float64_rope, float64_throughout, hf_causal_lm, two_row_prompt
from _parity import HFRouteParity, LogitParity
from qkv.cache import KVCache, Paged, Static
from qkv.models import CheckpointError, from_hf
from qkv.models.verify import verify_cache

N_PROMPT, N_PAD, N_NEW = 14, 4, 8
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=64,
             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# id -> (config overrides, NoPE layers qkv must read)
CASES = {
    "smollm3-L4-interval4-Hkv2-tied": (dict(), (3,)),
    "smollm3-L5-list-nope0-3-MQA-bias-untied": (dict(
        num_hidden_layers=5, num_key_value_heads=1, no_rope_layers=[0, 1, 1, 0, 1], attention_bias=True,
        mlp_bias=True, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
        (0, 3)),
    "smollm3-L4-interval2-W5-on-nope": (dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5),
                                        (1, 3)),
}


def _transformers():
    return pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    _transformers()
    if case not in _MODELS:
        hf = hf_causal_lm("SmolLM3Config", "SmolLM3ForCausalLM", {**_BASE, **CASES[case][0]},
                          seed=60 + sorted(CASES).index(case), attn_implementation="eager")
        _MODELS[case] = (hf, copy.deepcopy(hf).double().eval(), from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return two_row_prompt(300 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT, pad=N_PAD if padded else 0)


class TestHFParity(LogitParity, HFRouteParity):
    """The shared parity suite (tests/_parity.py), generation on a static cache."""

    CASES, N_NEW = CASES, N_NEW

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)

    def generation_cache(self, case, model):
        return KVCache(model.cache_specs(), storage=Static(N_PROMPT + N_NEW))


@pytest.mark.parametrize("case", list(CASES))
def test_float64_logits_equal_hf_float64(case):
    """qkv built from HF's float64 model gives its logits to a relative 1e-8 (prefill and a left-padded row); HF's
    RoPE tables recomputed in float64 and its float32 casts kept float64 (``float64_rope``, ``float64_throughout``:
    HF's own float32 RoPE, norms and softmax leave a 1e-7 error)."""
    ref = float64_rope(copy.deepcopy(_models(case)[1]))
    model = from_hf(ref, dtype=torch.float64)
    ids, mask = _prompt(case, padded=True)
    row = ids[1, mask[1].bool()][None]
    with torch.no_grad():
        ours, padded = model(ids[:1]).logits, model(ids, attention_mask=mask).logits[1, N_PAD:]
        with float64_throughout():  # the reference only: qkv runs outside, its own casts unmasked
            truth, truth_row = ref(ids[:1]).logits, ref(row).logits[0]
    for what, got, want in (("prefill", ours, truth), ("left-padded row", padded, truth_row)):
        rel = ((got - want).norm() / want.norm()).item()
        assert got.dtype == torch.float64 and rel < 1e-8, f"{case} {what}: relative error {rel:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_nope_layers_reach_the_model(case):
    """The NoPE layers are HF's (``no_rope_layers`` 0 / every interval-th), hold no RoPE table, and the others
    do; the sliding ones are exactly the NoPE ones when HF slides."""
    hf, _, model = _models(case)
    want = CASES[case][1]
    assert model.config.nope_layers == want == tuple(i for i, f in enumerate(hf.config.no_rope_layers) if not f)
    for i, layer in enumerate(model.layers):
        assert (layer.self_attn.rope is None) == (i in want), i
        assert (model.config.window_for(i) is not None) == (hf.config.layer_types[i] == "sliding_attention"), i


def test_nope_layers_matter():
    """Giving a NoPE layer RoPE (the description without ``nope_layers``) changes the logits: the option is live."""
    hf, _, model = _models("smollm3-L4-interval4-Hkv2-tied")
    from qkv.nn import DecoderLM

    rotated = DecoderLM(model.config.replace(nope_layers=()))
    rotated.load_state_dict(model.state_dict())
    ids, _ = _prompt("smollm3-L4-interval4-Hkv2-tied", padded=False)
    with torch.no_grad():
        assert (rotated(ids).logits - model(ids).logits).abs().max() > 1e-2


@pytest.mark.parametrize("storage", ["dynamic", "static", "paged"])
def test_verify_cache(storage):
    model = _models("smollm3-L4-interval2-W5-on-nope")[2]
    make = {"dynamic": lambda: KVCache(model, rollback=4),
            "static": lambda: KVCache(model, storage=Static(64), rollback=4),
            "paged": lambda: KVCache(model, storage=Paged(block_size=4, num_blocks=128, prefix_caching=True))}[storage]
    report = verify_cache(model, make)
    assert report.ok, str(report)


def test_window_only_cache_keeps_the_window_on_sliding_nope_layers():
    model = _models("smollm3-L4-interval2-W5-on-nope")[2]
    assert [s.kind for s in model.cache_specs()] == ["full", "sliding", "full", "sliding"]


def test_checkpoint_directory_loads_like_the_model(tmp_path):
    hf, _, model = _models("smollm3-L5-list-nope0-3-MQA-bias-untied")
    hf.save_pretrained(tmp_path)
    ids, _ = _prompt("smollm3-L5-list-nope0-3-MQA-bias-untied", padded=False)
    with torch.no_grad():
        assert torch.equal(from_hf(tmp_path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("change, match", [
    (dict(no_rope_layers=[1, 1, 0]), r"no_rope_layers must list 1 \(RoPE\) or 0 \(NoPE\) for each of the 4 layers"),
    (dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers must list 1"),
    (dict(no_rope_layers=None, no_rope_layer_interval=0), "no_rope_layer_interval must be a positive int, got 0"),
    (dict(model_type="llama"), "family_smollm3: model_type 'llama' is not smollm3"),
], ids=["short-list", "not-a-flag", "interval-0", "wrong-type"])
def test_bad_configs_are_refused(change, match):
    from qkv.models import family_smollm3

    cfg = {**_models("smollm3-L4-interval4-Hkv2-tied")[0].config.to_dict(), **change}
    with pytest.raises(CheckpointError, match=match):
        family_smollm3.build(cfg)


@pytest.mark.parametrize("change, error, match", [
    (dict(nope_layers=(4,)), ValueError, r"nope_layers must be increasing distinct layer indices in \[0, 4\)"),
    (dict(nope_layers=(2, 1)), ValueError, "increasing distinct"),
    (dict(nope_layers=(1.0,)), TypeError, "nope_layers must be a tuple of layer indices"),
    (dict(nope_layers=(1,), position="alibi"), ValueError, "need position='rope'"),
], ids=["out-of-range", "unsorted", "not-int", "alibi"])
def test_decoder_config_refuses_bad_nope_layers(change, error, match):
    from qkv.nn import DecoderConfig

    with pytest.raises(error, match=match):
        DecoderConfig(vocab_size=10, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=8,
                      **change)


def test_nope_on_a_recurrent_or_latent_layer_is_refused():
    from qkv.config.linear import LinearAttentionConfig
    from qkv.nn import DecoderConfig, LatentConfig

    base = dict(vocab_size=10, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=8)
    latent = LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=8, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match=r"LatentConfig\(use_rope=False\)"):
        DecoderConfig(**base, latent=latent, nope_layers=(0,))
    linear = LinearAttentionConfig(mixer="gated_deltanet", linear_num_key_heads=2, linear_num_value_heads=2,
                                   linear_key_head_dim=8, linear_value_head_dim=8)
    with pytest.raises(ValueError, match=r"nope_layers \[0\] are 'linear_attention' layers"):
        DecoderConfig(**base, layer_types=("linear_attention", "full_attention"), linear_attention=linear,
                      nope_layers=(0,))
