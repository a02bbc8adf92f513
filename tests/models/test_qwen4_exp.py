"""Qwen4-Exp (``qwen4_exp_text``) on qkv against HF transformers' eager model with random weights.

One tiny config exercises every layer kind: Gated DeltaNet layers with Per-Layer Embedding (hashed n-grams, EOS
inside the prompt), QSA indexed-attention layers whose budget is smaller than the context, the gated residual with
two streams and the read-out without a final norm, and the mixture of experts with its gated shared expert.

The reference is HF float64 with its float32 islands (norms, softmax, ``.float()`` casts) lifted
(``tests/_hf.float64_throughout``) and its RoPE angles computed in float64. QSA keeps the best blocks by
ReLU-summed scores; where several blocks tie at zero HF's ``torch.topk`` picks among them in an unspecified order
and qkv the earliest, so the config uses 8 indexer heads (a block scores 0 only when all 8 are negative).

The float64 bar is the issue's 1e-8 (measured 1.8e-15, left-padded 6.6e-16): qkv's MoE router computes in float64
for a float64 model, as the lifted HF reference does. The QSA layer alone agrees to 1e-10 (``tests/nn/test_qsa.py``).

Not covered (see the family module): a KV cache (QSA's indexer keys and PLE's state have no cache spec yet: a
cached step is refused) and HF's ``attn_implementation="qkv"`` route.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import float64_throughout, hf_causal_lm, two_row_prompt
from qkv.cache import KVCache
from qkv.models import from_hf
from qkv.models.family_qwen4_exp import convert, decoder_config
from qkv.models.loading import CheckpointError, check_and_load
from qkv.nn import DecoderLM

VOCAB, N_PROMPT, N_PAD = 97, 15, 4
FIELDS = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=16, hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=16,
              ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8,
              eos_token_id=1, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
              indexer_compress_ratio=2,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
              layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"])

_MODELS: dict[str, tuple] = {}


def _float64_rope(model) -> None:
    """HF's multimodal rotary module in float64 (text positions: its three axes agree, so plain RoPE)."""
    emb = model.model.rotary_emb
    dim = 2 * emb.inv_freq.numel()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def forward(x, position_ids):
        freqs = position_ids[0][..., None].double() * inv_freq
        full = torch.cat((freqs, freqs), dim=-1)
        return full.cos().to(x.dtype), full.sin().to(x.dtype)

    emb.forward = forward


def _models():
    """(hf float64 reference, qkv float64, qkv float32 from from_hf), built once."""
    if not _MODELS:
        hf = hf_causal_lm("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", FIELDS, seed=47, attn_implementation="eager",
                          experts_implementation="eager")
        ref = copy.deepcopy(hf).double().eval()
        _float64_rope(ref)
        cfg = hf.config.to_dict()
        ours64 = DecoderLM(decoder_config(cfg)).double().eval()
        check_and_load(ours64, convert(dict(hf.state_dict()), cfg))
        _MODELS["m"] = (ref, ours64, from_hf(hf))
    return _MODELS["m"]


def _prompt(padded: bool):
    ids, mask = two_row_prompt(147, VOCAB, N_PROMPT, pad=N_PAD if padded else 0, low=2)
    ids[0, 6] = 1  # an EOS inside the prompt: PLE's n-grams restart after it
    return ids, mask


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_prefill_logits_match_hf_float64():
    ref, ours, _ = _models()
    ids, _ = _prompt(False)
    with torch.no_grad(), float64_throughout():
        truth = ref(ids, use_cache=False).logits
    with torch.no_grad():
        got = ours(ids).logits
    assert truth.std() > 0.5, "logits must be O(1) for the comparison to mean anything"
    assert _rel(got, truth) < 1e-8, f"float64 relative logit error {_rel(got, truth):.2e}"


def test_float32_from_hf_and_left_padding_give_each_row_alone():
    ref, ours, ours32 = _models()
    ids, mask = _prompt(True)
    real = mask.bool()
    with torch.no_grad(), float64_throughout():
        truth = torch.cat([ref(ids[b, real[b]][None], use_cache=False).logits[0] for b in range(2)])
    with torch.no_grad():
        got64 = ours(ids, attention_mask=mask).logits[real]
        got32 = ours32(ids, attention_mask=mask).logits[real]
    assert _rel(got64, truth) < 1e-8, f"left-padded float64 relative error {_rel(got64, truth):.2e}"
    assert _rel(got32.double(), truth) < 1e-4, f"float32 relative error {_rel(got32.double(), truth):.2e}"


def test_a_cache_is_refused_clearly():
    _, _, ours32 = _models()
    ids, _ = _prompt(False)
    with pytest.raises(ValueError, match="keeps no state in a KV cache yet|keeps no cache yet"):
        ours32(ids, cache=KVCache(ours32.cache_specs()))


def test_qsa_selection_matters():
    """A dense model on the same weights (budget large enough to keep every block) gives other logits: the
    prefill parity above cannot pass with the selection ignored."""
    _, ours, _ = _models()
    ids, _ = _prompt(False)
    c = ours.config
    dense = DecoderLM(c.replace(qsa=type(c.qsa)(index_n_heads=8, index_head_dim=8, budget=32, block=2))).double()
    dense.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert _rel(dense(ids).logits, ours(ids).logits) > 1e-3


@pytest.mark.parametrize("change,match", [
    ({"output_gate_type": "sigmoid"}, "gates its output norm with SiLU only"),
    ({"indexer_n_heads": None, "indexer_kv_heads": None, "indexer_head_dim": None, "indexer_budget": None,
      "indexer_compress_ratio": None}, "lacks their indexer"),
    ({"indexer_kv_heads": 2}, "one key head"),
    ({"indexer_budget": 5}, "budget=5 must be a multiple of block=2"),
    ({"ple_layer_ids": [2]}, "linear_attention layers only"),
    ({"ple_layer_ids": [9]}, "count layers from 1 to num_hidden_layers=4"),
    ({"eos_token_id": None}, "need eos_token_id"),
], ids=["sigmoid-gate", "no-indexer", "two-index-kv-heads", "budget-not-blocks", "ple-on-attention", "ple-out-of-range",
        "ple-without-eos"])
def test_unsupported_configs_fail_clearly(change, match):
    cfg = {"model_type": "qwen4_exp_text", **FIELDS, **change}
    with pytest.raises(CheckpointError, match=match):
        decoder_config(cfg)


def test_multimodal_config_reads_its_text_config_and_hash_buffers_are_checked():
    ref, ours, _ = _models()
    text = {"model_type": "qwen4_exp_text", **FIELDS}
    c = decoder_config({"model_type": "qwen4_exp", "text_config": text})
    assert c == decoder_config(text) and c.ple.layers == (0, 2) and c.gated_residual.streams == 2
    state = {k: v for k, v in ref.state_dict().items()}
    state["model.layers.0.ple.ple_embedding.layer_multipliers"] = state[
        "model.layers.0.ple.ple_embedding.layer_multipliers"] + 2
    with pytest.raises(CheckpointError, match="layer_multipliers .* differs from what the config gives"):
        convert(state, text)
