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

The cache: QSA layers keep each token's raw indexer key in their value rows (``IndexedSpec``), the recurrent
layers keep PLE's n-gram context and convolution inputs beside their own state (``RecurrentSpec.side``); cached
float64 decoding equals full recomputation, greedy generation on the left-padded batch equals HF's per row, and the
Engine serves the model. HF's ``attn_implementation="qkv"`` route gives eager's logits (the selection reaches it as a
4-D mask).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import float64_throughout, hf_causal_lm, two_row_prompt
from _parity import engine_matches_generate
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


def _hf32():
    """HF float32 on the same weights, built once (greedy generation compares with it)."""
    if "hf32" not in _MODELS:
        _MODELS["hf32"] = hf_causal_lm("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", FIELDS, seed=47,
                                       attn_implementation="eager", experts_implementation="eager")
    return _MODELS["hf32"]


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


def test_cache_specs_keep_indexer_keys_and_ple_state():
    _, ours, _ = _models()
    specs = ours.cache_specs()
    assert [type(s).__name__ for s in specs] == ["RecurrentSpec", "IndexedSpec"] * 2
    assert specs[1].index_head_dim == FIELDS["indexer_head_dim"]
    wide = FIELDS["hc_count"] * FIELDS["hidden_size"]
    assert specs[0].side == ((2,), (wide, 3 * 3)) and specs[0].side_ints == 1  # n-gram 3, taps 4
    assert specs[0].fixed_bytes(torch.float32) - specs[0].side_bytes(torch.float32) > 0
    assert specs[0].side_bytes(torch.float32) == 2 * 8 + wide * 9 * 4


@pytest.mark.parametrize("chunks", [(15,), (9, 1, 1, 1, 1, 1, 1), (6, 4, 5)])
def test_float64_cached_decode_equals_recomputation(chunks):
    """The prompt in chunks on one cache (a prefill, then one-token or multi-token steps through QSA's cached
    indexer keys and PLE's cached n-gram context and convolution), float64: the last logits of every chunk equal
    the full recomputation's."""
    ref, ours, _ = _models()
    ids, _ = _prompt(False)
    cache = KVCache(ours.cache_specs())
    start = 0
    with torch.no_grad():
        for n in chunks:
            got = ours(ids[:, start:start + n], cache=cache).logits[:, -1]
            start += n
            full = ours(ids[:, :start]).logits[:, -1]
            assert _rel(got, full) < 1e-12, f"chunk ending at {start}: {_rel(got, full):.3g}"
        with float64_throughout():
            truth = ref(ids, use_cache=False).logits[:, -1]
    assert _rel(got, truth) < 1e-8


def test_cached_greedy_generation_matches_hf_per_row():
    """Left-padded batch, cached greedy decoding (float32 from from_hf) equals HF generate on each row alone."""
    from qkv.models.generate import generate

    ref, _, ours32 = _models()
    hf = _hf32()
    ids, mask = _prompt(True)
    real = mask.bool()
    out = generate(ours32, ids, attention_mask=mask, max_new_tokens=6)
    again = generate(ours32, ids, attention_mask=mask, max_new_tokens=6, use_cache=False)
    assert torch.equal(out.new_tokens, again.new_tokens)
    with torch.no_grad():
        for b in range(2):
            row = ids[b, real[b]][None]
            want = hf.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=6, do_sample=False)
            assert out.new_tokens[b].tolist() == want[0, row.shape[1]:].tolist(), f"row {b}"


def test_engine_serves_qwen4_exp():
    """The Engine (paged indexed layers, per-slot recurrent and PLE state) gives generate's tokens per request."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (12, 5, 9)]
    prompts[0][4] = 1  # an EOS inside a prompt
    engine_matches_generate(_models()[2], prompts, 5)


def test_hf_route_gives_eager_logits():
    """HF's own model with attn_implementation="qkv": its QSA layers hand the selection to the attention interface
    as a 4-D mask; the logits are within budget of HF float64 eager (HF float32 eager the baseline)."""
    import qkv.integrations.transformers as qhf
    from _hf import within_budget

    ref, _, _ = _models()
    hf = _hf32()
    cand = copy.deepcopy(hf)
    qhf.use(cand)
    ids, _ = _prompt(False)
    with torch.no_grad():
        with float64_throughout():
            truth = ref(ids, use_cache=False).logits
        within_budget(cand(ids, use_cache=False).logits, truth, hf(ids, use_cache=False).logits,
                      what="qwen4_exp attn_implementation='qkv'")


def test_recurrent_side_state_is_checked():
    from qkv.cache import RecurrentSpec

    _, ours, _ = _models()
    cache = KVCache(ours.cache_specs())
    spec = cache.specs[0]
    conv = torch.zeros(1, spec.conv_dim, spec.conv_kernel - 1)
    rec = torch.zeros(1, spec.num_heads, spec.head_k_dim, spec.head_v_dim)
    with pytest.raises(TypeError, match=r"4 tensors \(conv, recurrent and its side state"):
        cache.update_recurrent(0, (conv, rec), tokens=1)
    with pytest.raises(ValueError, match="side state 0 as int64"):
        cache.update_recurrent(0, (conv, rec, torch.zeros(1, 2), torch.zeros(1, *spec.side[1])), tokens=1)
    for bad, match in (({"side": ((2,), "x")}, "tuple of per-row shapes"), ({"side": ((2,),), "side_ints": 2},
                                                                             "counts more int64 parts")):
        with pytest.raises(ValueError, match=match):
            RecurrentSpec(4, 4, 2, 8, 8, **bad)


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
