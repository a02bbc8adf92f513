"""``attn_implementation="qkv"`` inside HF transformers against HF's own eager attention.

Every family is a tiny HF model from a config (2-4 layers, hidden 32-64) whose weights are redrawn at unit
scale (HF's 0.02 init makes attention nearly uniform and would hide mask mistakes). Then, per family:

- logits with ``"qkv"`` (float32) are within the error budget of eager float64 (the reference), with eager
  float32 as the baseline; once plain, once with padding (left padding for decoders);
- ``output_attentions=True`` returns eager's probabilities (recomputed from the lse) within budget;
- greedy ``generate`` emits eager's tokens (float64 models, so near-ties cannot flip a token).

Mask translation is tested on its own: the qkv mask read from each HF mask composition equals the boolean
mask HF builds, element by element, and is analytic where claimed.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import hf_causal_lm
from qkv.masks.explicit import Dense
from qkv.testing import assert_within_budget

transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")
import qkv.integrations.transformers as qhf  # noqa: E402  (after transformers is known to be there)

N, N_PAD, N_NEW, V = 12, 3, 6, 96
_DEC = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64)

# id -> (config class, model class, overrides, kind): kind "dec" causal LM, "enc" masked LM, "s2s" encoder-decoder
CASES = {
    "llama-Hq4-Hkv2": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2), "dec"),
    "mistral-W5-shorter-than-prompt": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5), "dec"),
    "qwen2-MHA-W5-layer1": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        "dec"),
    "gemma2-L4-W5-softcap": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        query_pre_attn_scalar=12, attn_logit_softcapping=3.0, final_logit_softcapping=8.0), "dec"),
    "gemma3-L3-W4-MQA": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4,
        sliding_window_pattern=2, query_pre_attn_scalar=16), "dec"),
    "gpt2-H4": ("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
        "dec"),
    "gpt_oss-sinks-W4-moe": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4, num_local_experts=4,
        num_experts_per_tok=2, intermediate_size=32, layer_types=["sliding_attention", "full_attention"],
        experts_implementation="eager"), "dec"),
    "bert-H4-bidirectional": ("BertConfig", "BertForMaskedLM", dict(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "enc"),
    "t5-relbias-cross": ("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0), "s2s"),
}


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(eager float32, eager float64, qkv float32, qkv float64), built once per session."""
    if case not in _MODELS:
        cfg_cls, model_cls, overrides, kind = CASES[case]
        base = _DEC if kind == "dec" and not case.startswith("gpt2") else {}
        hf = hf_causal_lm(cfg_cls, model_cls, {**base, **overrides}, seed=sorted(CASES).index(case),
                          attn_implementation="eager")
        ref = copy.deepcopy(hf).double()
        cand, cand64 = copy.deepcopy(hf), copy.deepcopy(ref)
        qhf.use(cand)
        qhf.use(cand64)
        _MODELS[case] = (hf, ref, cand, cand64)
    return _MODELS[case]


def _inputs(case: str, *, padded: bool) -> dict:
    kind = CASES[case][3]
    gen = torch.Generator().manual_seed(100 + sorted(CASES).index(case))
    ids = torch.randint(1, V, (2, N), generator=gen)
    mask = torch.ones_like(ids)
    out = dict(input_ids=ids, attention_mask=mask)
    if padded:
        if kind == "dec":  # left padding, as for generation; positions count real tokens only
            mask[1, :N_PAD] = 0
            out["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
        else:  # encoders: right padding
            mask[1, -N_PAD:] = 0
        out["input_ids"] = ids.masked_fill(mask == 0, 0)
    if kind == "s2s":
        out["decoder_input_ids"] = torch.randint(1, V, (2, N - 4), generator=gen)
    return out


def _row(case: str, inputs: dict, b: int) -> dict:
    """Row ``b`` alone, without its padding: the float64 truth (eager float64 turns fully masked padding rows
    into NaN, which then leaks into real rows, so the padded batch cannot be the reference)."""
    real = inputs["attention_mask"][b].bool()
    out = dict(input_ids=inputs["input_ids"][b, real][None])
    if "decoder_input_ids" in inputs:
        out["decoder_input_ids"] = inputs["decoder_input_ids"][b][None]
    return out


def _out_rows(case: str, inputs: dict) -> torch.Tensor:
    """(B, N_out) output positions that exist in the row-alone truth."""
    if CASES[case][3] == "s2s":
        return torch.ones_like(inputs["decoder_input_ids"], dtype=torch.bool)
    return inputs["attention_mask"].bool()


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_within_budget_of_eager(case, padded):
    hf, ref, cand, _ = _models(case)
    inputs = _inputs(case, padded=padded)
    rows = _out_rows(case, inputs)
    with torch.no_grad():
        truth = torch.cat([ref(**_row(case, inputs, b)).logits[0] for b in range(rows.shape[0])])
        base = hf(**inputs).logits[rows]
        got = cand(**inputs).logits[rows]
    assert_within_budget(got, truth, base, what=f"{case} logits")


def _attentions(out, kind: str) -> dict[str, tuple]:
    if kind == "s2s":
        return {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions, "cross": out.cross_attentions}
    return {"self": out.attentions}


def _qk_rows(part: str, inputs: dict, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = inputs["attention_mask"][b].bool()
    if part == "decoder":
        dec = torch.ones(inputs["decoder_input_ids"].shape[1], dtype=torch.bool)
        return dec, dec
    if part == "cross":
        return torch.ones(inputs["decoder_input_ids"].shape[1], dtype=torch.bool), enc
    return enc, enc


@pytest.mark.parametrize("case", list(CASES))
def test_output_attentions_equal_eager(case):
    """Every layer's probabilities at real query rows and keys, against each row run alone in float64; the
    padding keys of real rows get exactly zero."""
    hf, ref, cand, _ = _models(case)
    kind = CASES[case][3]
    inputs = _inputs(case, padded=True)
    with torch.no_grad():
        base = _attentions(hf(**inputs, output_attentions=True), kind)
        got = _attentions(cand(**inputs, output_attentions=True), kind)
        truth = [_attentions(ref(**_row(case, inputs, b), output_attentions=True), kind) for b in range(2)]
    for part in base:
        assert len(got[part]) == len(base[part]) > 0, f"{case} {part}: {len(got[part])} layers returned"
        for i, (g, e) in enumerate(zip(got[part], base[part])):
            assert g is not None and g.shape == e.shape, f"{case} {part}[{i}]: {None if g is None else g.shape}"
            for b in range(2):
                qr, kr = _qk_rows(part, inputs, b)
                pick = (lambda t: t[b][:, qr][:, :, kr])  # noqa: E731
                assert_within_budget(pick(g), truth[b][part][i][0], pick(e), what=f"{case} {part}[{i}] row {b}")
                assert (g[b][:, qr][:, :, ~kr] == 0).all(), f"{case} {part}[{i}] row {b}: padding keys attended"


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][3] != "enc"])
def test_greedy_generate_equals_eager(case):
    """The padded batch on qkv (float64) emits the tokens eager emits for each row alone."""
    _, ref, _, cand64 = _models(case)
    inputs = _inputs(case, padded=True)
    inputs.pop("decoder_input_ids", None)
    inputs.pop("position_ids", None)  # generate derives positions from the attention mask
    kw = dict(max_new_tokens=N_NEW, do_sample=False)
    got = cand64.generate(**inputs, **kw)[:, -N_NEW:]
    expected = torch.cat([ref.generate(**_row(case, inputs, b), **kw)[:, -N_NEW:] for b in range(2)])
    assert got.tolist() == expected.tolist(), f"{case}: qkv {got.tolist()} != eager {expected.tolist()}"


@pytest.mark.parametrize("case", ["llama-Hq4-Hkv2", "mistral-W5-shorter-than-prompt", "gemma2-L4-W5-softcap"])
def test_packed_sequences_from_position_ids_equal_each_sequence_alone(case):
    """Padding-free batches (HF's DataCollatorWithFlattening): one row, positions restarting per sequence,
    no attention_mask, no cache (HF looks for packed sequences only then, as in training). HF finds the
    documents from position_ids; qkv reads them as a document mask."""
    hf, ref, cand, _ = _models(case)
    lengths = [5, 9, 3]
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, V, (1, sum(lengths)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        truth = torch.cat([ref(input_ids=chunk).logits[0] for chunk in ids.split(lengths, dim=1)])
        base = hf(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        got = cand(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    assert_within_budget(got, truth, base, what=f"{case} packed logits")
    reports = qhf.explain(cand, input_ids=ids, position_ids=pos, use_cache=False)
    assert all(r.mask_source == "analytic" and "document" in str(r) for r in reports), [str(r) for r in reports]


def test_pinned_tiled_backend_runs_analytic_masks():
    """Sliding windows, left padding and softcap through the tiled backend (which skips tiles by the mask)."""
    qhf.register("qkv_tiled", backend="tiled")
    for case in ("mistral-W5-shorter-than-prompt", "gemma2-L4-W5-softcap"):
        hf, ref, _, _ = _models(case)
        tiled = copy.deepcopy(hf)
        qhf.use(tiled, "qkv_tiled")
        inputs = _inputs(case, padded=True)
        rows = _out_rows(case, inputs)
        with torch.no_grad():
            truth = torch.cat([ref(**_row(case, inputs, b)).logits[0] for b in range(2)])
            assert_within_budget(tiled(**inputs).logits[rows], truth, hf(**inputs).logits[rows],
                                 what=f"{case} tiled logits")


@pytest.mark.parametrize("case,impl", [("mistral-W5-shorter-than-prompt", "qkv_tiled"), ("t5-relbias-cross", "qkv"),
                                       ("gpt_oss-sinks-W4-moe", "qkv"), ("gpt_oss-sinks-W4-moe", "qkv_tiled")])
def test_training_gradients_within_budget_of_eager(case, impl):
    """Every parameter's gradient, T5's relative-bias table (through the dense bias) and GPT-OSS's sinks
    included."""
    hf, ref, _, _ = _models(case)
    qhf.register("qkv_tiled", backend="tiled")
    models = {"ref": ref, "base": copy.deepcopy(hf), "cand": copy.deepcopy(hf)}
    qhf.use(models["cand"], impl)
    inputs = _inputs(case, padded=CASES[case][3] == "s2s")  # eager float64 cannot take left padding (NaN)
    labels = inputs.pop("decoder_input_ids") if "decoder_input_ids" in inputs else inputs["input_ids"]
    grads = {}
    for name, m in models.items():
        m.train()
        m.zero_grad()
        m(**inputs, labels=labels).loss.backward()
        grads[name] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.eval()
        m.zero_grad()
    assert any("sinks" in n for n in grads["ref"]) or not case.startswith("gpt_oss")
    for n, g in grads["ref"].items():
        assert_within_budget(grads["cand"][n], g, grads["base"][n], what=f"grad {n}")


def test_dropout_in_training_is_drawn_from_torch_rng():
    cfg = transformers.LlamaConfig(**_DEC, num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="qkv").train()
    ids = torch.randint(0, V, (2, N))
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model(ids).logits)
    assert torch.equal(runs[0], runs[1]), "the same torch seed must give the same dropout pattern"
    with torch.no_grad():
        plain = model.eval()(ids).logits
    assert (runs[0] - plain).abs().max() > 1e-3, "dropout 0.5 in training changed nothing"


def test_explain_states_mask_source_and_backend():
    _, _, cand, _ = _models("mistral-W5-shorter-than-prompt")
    inputs = _inputs("mistral-W5-shorter-than-prompt", padded=True)
    reports = qhf.explain(cand, **inputs)
    assert len(reports) == 2 and all(r.mask_source == "analytic" for r in reports), [str(r) for r in reports]
    text = str(reports[0])
    assert "sliding_window(4, 0)" in text and "padding(" in text and "chosen:" in text, text


def test_use_rejects_a_family_that_bypasses_the_interface():
    cfg = transformers.BloomConfig(vocab_size=V, hidden_size=32, n_layer=1, n_head=4)
    model = transformers.BloomForCausalLM(cfg)
    with pytest.raises(TypeError, match="Bloom.*AttentionInterface"):
        qhf.use(model)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        qhf.use(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not registered"):
        qhf.use(_models("llama-Hq4-Hkv2")[0], "nope")
    with pytest.raises(ValueError, match="unknown backend"):
        qhf.register("qkv_bad", backend="fastest")


def test_unreadable_attention_mask_is_a_clear_error():
    _, _, cand, _ = _models("llama-Hq4-Hkv2")
    attn = cand.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="cannot read attention_mask"):
        qhf.attention_forward(attn, q, k, k, torch.ones(3, 3))


def test_packed_lengths_without_a_mask_are_refused():
    _, _, cand, _ = _models("llama-Hq4-Hkv2")
    attn = cand.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        qhf.attention_forward(attn, q, k, k, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_4d_masks_from_the_caller_are_taken_as_dense():
    _, _, cand, _ = _models("llama-Hq4-Hkv2")
    attn = cand.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g) for h in (4, 2, 2))
    allowed = torch.rand(2, 1, 5, 5, generator=g) < 0.7
    allowed[..., 0] = True
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~allowed, torch.finfo(torch.float32).min)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    expected = torch.softmax((q @ kr.transpose(-1, -2)) * attn.scaling + additive, -1) @ vr
    for m in (allowed, additive):
        out, _ = qhf.attention_forward(attn, q, k, v, m, scaling=attn.scaling)
        assert torch.allclose(out.transpose(1, 2), expected, atol=1e-5), m.dtype


def _pos(ids_b: list[list[int]]) -> torch.Tensor:
    return torch.tensor(ids_b)


_PACKED_POS = _pos([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
_PACKED_IDS = mu.find_packed_sequence_indices(_PACKED_POS)
_LEFT = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10]).bool()
_RIGHT = torch.tensor([[1] * 10, [1] * 7 + [0] * 3]).bool()
_BLOCKS = torch.tensor([[-1, -1, 0, 0, 0, -1, 1, 1, -1, -1], [-1] * 10])

# id -> (mask_function, attention_mask, (q_length, kv_length, q_offset, kv_offset), expected qkv mask type name)
MASK_CASES = {
    "causal": (mu.causal_mask_function, None, (10, 10, 0, 0), "Causal"),
    "causal-left-padding": (mu.causal_mask_function, _LEFT, (10, 10, 0, 0), "And"),
    "causal-right-padding": (mu.causal_mask_function, _RIGHT, (10, 10, 0, 0), "And"),
    "causal-decode": (mu.causal_mask_function, _LEFT, (1, 10, 9, 0), "And"),
    "causal-static-cache-unaligned": (mu.causal_mask_function, None, (3, 10, 4, 0), "Positions"),
    "sliding4": (mu.sliding_window_causal_mask_function(4), _LEFT, (10, 10, 0, 0), "And"),
    "sliding4-cache-offset": (mu.sliding_window_causal_mask_function(4), None, (1, 4, 9, 6), "SlidingWindow"),
    "sliding4-static-unaligned": (mu.sliding_window_causal_mask_function(4), None, (2, 10, 3, 0), "And"),
    "packed-causal": (mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, _PACKED_POS),
                                   mu.packed_sequence_mask_function(_PACKED_IDS)), None, (10, 10, 0, 0), "And"),
    "packed-sliding3": (mu.and_masks(mu.remap_positions_for_packed_sequence(
        mu.sliding_window_causal_mask_function(3), _PACKED_POS), mu.packed_sequence_mask_function(_PACKED_IDS)),
        None, (10, 10, 0, 0), "And"),
    "chunked3": (mu.chunked_causal_mask_function(3, torch.tensor([2, 0])), _LEFT, (10, 10, 0, 0), "And"),
    "bidirectional-padding": (mu.bidirectional_mask_function, _RIGHT, (10, 10, 0, 0), "Padding"),
    "bidirectional-cross": (mu.bidirectional_mask_function, _RIGHT, (4, 10, 0, 0), "Padding"),
    "sliding-bidirectional2": (mu.sliding_window_bidirectional_mask_function(2), None, (10, 10, 0, 0), "SlidingWindow"),
    "blockwise": (mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(_BLOCKS)), None, (10, 10, 0, 0), "Or"),
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_mask_translation_equals_hf_boolean_mask(case):
    fn, attention_mask, (nq, nk, q_off, kv_off), kind = MASK_CASES[case]
    args = dict(batch_size=2, q_length=nq, kv_length=nk, q_offset=q_off, kv_offset=kv_off, mask_function=fn,
                attention_mask=attention_mask)
    expected = mu.sdpa_mask(**args, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    got = qhf.hf_mask(**args)
    assert got.source == "analytic", got.source
    assert type(got.mask).__name__ == kind, f"{case}: {got.mask!r}"
    dense = got.mask.materialize(2, 1, nq, nk)
    assert torch.equal(dense, expected.expand_as(dense)), f"{case}: {got.mask!r}\n{dense.int()}\n{expected.int()}"


def test_unknown_mask_composition_is_taken_dense_and_says_so():
    fn = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: k == 0)
    got = qhf.hf_mask(batch_size=2, q_length=6, kv_length=6, mask_function=fn, attention_mask=_LEFT[:, :6])
    assert isinstance(got.mask, Dense) and got.source.startswith("dense") and "analytic" in got.source, got.source
    expected = mu.sdpa_mask(batch_size=2, q_length=6, kv_length=6, mask_function=fn, attention_mask=_LEFT[:, :6],
                            allow_is_causal_skip=False, use_vmap=True)
    assert torch.equal(got.mask.materialize(2, 1, 6, 6), expected)


def test_full_bidirectional_without_padding_is_no_mask():
    got = qhf.hf_mask(batch_size=2, q_length=5, kv_length=5, mask_function=mu.bidirectional_mask_function,
                      attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert got.mask is None and got.source == "analytic"


def test_falcon_dispatches_through_the_interface_and_matches_eager():
    """Falcon calls HF's AttentionInterface in this transformers: built with "qkv" it is not refused, every
    attention call of a forward goes through qkv, and the logits are within budget of eager in float64 (eager in
    float32 the baseline)."""
    fields = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                  new_decoder_architecture=True, hidden_dropout=0.0, attention_dropout=0.0)
    base = hf_causal_lm("FalconConfig", "FalconForCausalLM", fields, seed=3, attn_implementation="eager")
    ref = copy.deepcopy(base).double()
    cand = hf_causal_lm("FalconConfig", "FalconForCausalLM", fields, seed=3, attn_implementation="qkv")
    ids = torch.randint(1, V, (2, N), generator=torch.Generator().manual_seed(0))
    reports = qhf.explain(cand, input_ids=ids)
    assert len(reports) == fields["num_hidden_layers"], [str(r) for r in reports]
    with torch.no_grad():
        assert_within_budget(cand(input_ids=ids).logits, ref(input_ids=ids).logits, base(input_ids=ids).logits,
                             what="falcon logits")
