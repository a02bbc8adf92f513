"""MiniMax-M3 (``minimax_m3_vl_text`` and ``minimax_m3_vl``'s language model: MSA block-sparse attention layers
beside dense ones, MoE beside clamped-SwiGLU dense MLPs, Gemma-style norms, partial RoPE) on qkv against HF
transformers' ``MiniMaxM3VLForCausalLM``.

The float64 reference is HF's own source with its float32 casts lifted to float64 (tests/_hf_float64.py: the
norms, rotary table, eager softmax, router and indexer scores), so the bound is float64's: relative error < 1e-8.
Tiny random configs with every layer type (dense/MSA attention x dense/MoE MLP) and a prompt longer than the
blocks an MSA query keeps (the selection changes the logits; checked). MSA layers keep no cache yet, so decoding
is by full recomputation (``use_cache=False``) and a cache is refused. HF's indexer anchors its blocks to cache
slots, so HF's left-padded batch differs from each row alone (its own docstring says so); the padded row's
reference is that row alone.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import hf_causal_lm, two_row_prompt
from _hf_float64 import float64_twin
from _parity import LogitParity
from qkv.cache import KVCache
from qkv.models import CheckpointError, from_hf
from qkv.models.generate import generate

M3_CASTS = {".float()": 9, "dtype=torch.float32": 5, "dtype=torch.float)": 4}
N_PROMPT, N_PAD, N_NEW = 14, 4, 6
_BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=16, dense_intermediate_size=24, shared_intermediate_size=20,
             num_local_experts=6, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16,
             max_position_embeddings=64, layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse",
                                                      "full_attention"],
             mlp_layer_types=["dense", "sparse", "dense", "sparse"], bos_token_id=None, eos_token_id=None)
CASES = {
    "block3-top2-local1-rot0.5": dict(index_block_size=3, index_topk_blocks=2, index_local_blocks=1,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                       "partial_rotary_factor": 0.5}),
    "block2-top3-local2-rot1": dict(index_block_size=2, index_topk_blocks=3, index_local_blocks=2,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 1.0}),
}

_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64 with its float32 casts lifted, qkv float32), built once per session."""
    pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")
    if case not in _MODELS:
        hf = hf_causal_lm("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", {**_BASE, **CASES[case]},
                          seed=30 + sorted(CASES).index(case), attn_implementation="eager",
                          experts_implementation="eager")
        ref = float64_twin(hf, "minimax_m3_vl", M3_CASTS)
        _MODELS[case] = (hf, ref, from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool):
    return two_row_prompt(300 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT,
                          pad=N_PAD if padded else 0)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_float64_logits_equal_hf_eager(case):
    """Prefill logits and the last step of a full-recompute decode, float64 vs HF float64 (casts lifted): < 1e-8;
    reading every block instead moves the logits (the selection is live)."""
    _, ref, model = _models(case)
    ours = copy.deepcopy(model).double()
    ids, _ = _prompt(case, padded=False)
    with torch.no_grad():
        truth = ref(ids).logits
        got = ours(ids).logits
        dense = copy.deepcopy(ours)
        for i in dense.config.msa.layers:
            dense.layers[i].self_attn.indexer.topk_blocks = N_PROMPT
        unselected = dense(ids).logits
    assert _rel(got, truth) < 1e-8, f"{case}: relative error {_rel(got, truth):.3g}"
    assert (unselected - truth).abs().max() > 0.1, "the block selection must change the logits"


class TestHFParity(LogitParity):
    """The shared parity suite on the prefill (DECODE_TAIL empty: MSA layers keep no cache); the padded row's
    reference is the row alone (see the module)."""

    CASES, N_NEW, DECODE_TAIL = CASES, N_NEW, ()

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)

    def test_left_padded_prefill_within_budget(self, case):
        hf, ref, model = _models(case)
        ids, mask = _prompt(case, padded=True)
        from qkv.models.generate import prompt_positions

        pos, real = prompt_positions(mask), mask.bool()
        with torch.no_grad():
            ours = model(ids, positions=pos).logits.double()
            truth = torch.cat([ref(ids[b, real[b]][None]).logits[0] for b in range(ids.shape[0])])
        assert _rel(ours[real], truth) < 1e-5, f"{case}: relative error {_rel(ours[real], truth):.3g}"

    def test_cached_greedy_generation_matches_hf(self, case):
        """qkv's greedy tokens on the left-padded batch (full recomputation) equal HF's for each row alone."""
        hf, _, model = _models(case)
        ids, mask = _prompt(case, padded=True)
        real = mask.bool()
        with torch.no_grad():
            out = generate(model, ids, max_new_tokens=N_NEW, attention_mask=mask, use_cache=False)
            for b in range(ids.shape[0]):
                row = ids[b, real[b]][None]
                want = hf.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=N_NEW,
                                   do_sample=False)[0, row.shape[1]:]
                assert torch.equal(out.new_tokens[b], want), f"row {b}: qkv {out.new_tokens[b].tolist()}, hf " \
                                                              f"{want.tolist()}"


def test_msa_layers_refuse_a_cache():
    model = _models(next(iter(CASES)))[2]
    ids, _ = _prompt(next(iter(CASES)), padded=False)
    with pytest.raises(ValueError, match=r"\(MSA\) keeps no cache yet"):
        model(ids, cache=KVCache(model.cache_specs()))


def test_multimodal_config_reads_its_language_model():
    """``minimax_m3_vl``'s text_config and ``model.language_model.*`` tensors load the same model."""
    from qkv.models.family_minimax_m3 import convert, decoder_config

    hf = _models(next(iter(CASES)))[0]
    text = hf.config.to_dict()
    outer = {"model_type": "minimax_m3_vl", "text_config": text}
    assert decoder_config(outer) == decoder_config(text)
    state = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
             for k, v in hf.state_dict().items()}
    state["model.visual.patch_embed.weight"] = torch.zeros(1)
    ours, theirs = convert(state, outer), convert(hf.state_dict(), text)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _config(**change) -> dict:
    cfg = {**_BASE, **CASES["block3-top2-local1-rot0.5"], "model_type": "minimax_m3_vl_text"}
    cfg.update(change)
    return cfg


@pytest.mark.parametrize("change, match", [
    (dict(model_type="minimax"), "model_type"),
    (dict(layer_types=["full_attention"] * 3), "layer_types"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    (dict(mlp_layer_types=["dense", "moe", "dense", "dense"]), "mlp_layer_types"),
    (dict(index_n_heads=1), "one indexer head per KV head"),
    (dict(index_local_blocks=3), "do not fit"),
    (dict(index_head_dim=4), "must fit the indexer head"),
    (dict(hidden_act="gelu"), "clamped SwiGLU"),
], ids=["model-type", "layer-count", "sliding", "mlp-kind", "indexer-heads", "local-blocks", "narrow-indexer",
        "activation"])
def test_bad_configs_fail_clearly(change, match):
    from qkv.models.family_minimax_m3 import build

    with pytest.raises((CheckpointError, ValueError), match=match):
        build(_config(**change))
