"""MiniMax-M3 (``minimax_m3_vl_text`` and ``minimax_m3_vl``'s language model: MSA block-sparse attention layers
beside dense ones, MoE beside clamped-SwiGLU dense MLPs, Gemma-style norms, partial RoPE) on qkv against HF
transformers' ``MiniMaxM3VLForCausalLM``.

The float64 reference is HF's own source with its float32 casts lifted to float64 (tests/_hf_float64.py: the
norms, rotary table, eager softmax, router and indexer scores), so the bound is float64's: relative error < 1e-8.
Tiny random configs with every layer type (dense/MSA attention x dense/MoE MLP) and a prompt longer than the
blocks an MSA query keeps (the selection changes the logits; checked). MSA layers cache their indexer key beside
their keys and values (``IndexedSpec``); cached decoding equals full recomputation in float64 and through
``verify_cache`` (dynamic, static and paged storage: crop, fork, prefix reuse), and the Engine serves the model.
HF's indexer anchors its blocks to cache slots, so HF's left-padded batch differs from each row alone (its own
docstring says so); the padded row's reference is that row alone.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import hf_causal_lm, two_row_prompt
from _hf_float64 import float64_twin
from _parity import LogitParity, engine_matches_generate
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
    """The shared parity suite (a two-token then a one-token cached step after the prefill); the padded row's
    reference is the row alone (see the module)."""

    CASES, N_NEW, DECODE_TAIL = CASES, N_NEW, (2, 1)

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

    @pytest.mark.parametrize("cached", [True, False])
    def test_cached_greedy_generation_matches_hf(self, case, cached):
        """qkv's greedy tokens on the left-padded batch (cached, and by full recomputation) equal HF's for each row
        alone."""
        hf, _, model = _models(case)
        ids, mask = _prompt(case, padded=True)
        real = mask.bool()
        with torch.no_grad():
            out = generate(model, ids, max_new_tokens=N_NEW, attention_mask=mask, use_cache=cached)
            for b in range(ids.shape[0]):
                row = ids[b, real[b]][None]
                want = hf.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=N_NEW,
                                   do_sample=False)[0, row.shape[1]:]
                assert torch.equal(out.new_tokens[b], want), f"row {b}: qkv {out.new_tokens[b].tolist()}, hf " \
                                                              f"{want.tolist()}"


@pytest.mark.parametrize("case", list(CASES))
def test_float64_cached_decode_equals_recomputation(case):
    """Prefill then one-token steps on the cache, float64: every step's logits equal the full recomputation's to
    float64 rounding, and HF float64's (casts lifted) to < 1e-8; the cache holds the indexer keys
    (IndexedSpec) beside keys and values."""
    _, ref, model = _models(case)
    ours = copy.deepcopy(model).double()
    specs = ours.cache_specs()
    assert [type(s).__name__ for s in specs] == ["FullSpec", "IndexedSpec", "IndexedSpec", "FullSpec"]
    assert specs[1].index_head_dim == _BASE["index_head_dim"] and specs[1].dv == 16 + 8
    ids, _ = _prompt(case, padded=False)
    cache = KVCache(specs)
    with torch.no_grad():
        ours(ids[:, :6], cache=cache)
        for t in range(6, ids.shape[1]):
            step = ours(ids[:, t:t + 1], cache=cache).logits[:, -1]
            full = ours(ids[:, :t + 1]).logits[:, -1]
            assert _rel(step, full) < 1e-12, f"{case} step {t}: {_rel(step, full):.3g}"
        truth = ref(ids).logits[:, -1]
    assert _rel(step, truth) < 1e-8


@pytest.mark.parametrize("storage", ["dynamic", "static", "paged"])
def test_verify_cache_with_indexer_keys(storage):
    """Cached decoding equals recomputation on every storage: decode, crop, fork and (paged) prefix reuse carry
    the indexer keys with their tokens."""
    from qkv.cache import Paged, Static
    from qkv.models import verify_cache

    model = _models(next(iter(CASES)))[2]
    make = {"dynamic": lambda: KVCache(model, rollback=4),
            "static": lambda: KVCache(model, storage=Static(64), rollback=4),
            "paged": lambda: KVCache(model, storage=Paged(block_size=4, num_blocks=128, prefix_caching=True))}[storage]
    report = verify_cache(model, make, prompt_lengths=(15, 9), max_new_tokens=8)
    assert report.ok, str(report)


def test_engine_serves_msa_layers():
    """The continuous-batching Engine (paged pools) gives each request generate's tokens on that request alone."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, _BASE["vocab_size"], (n,), generator=g).tolist() for n in (13, 5, 9)]
    engine_matches_generate(_models(next(iter(CASES)))[2], prompts, 6, prefix_caching=True)


def test_indexed_cache_refusals():
    """A cache built from other specs, a quantized or evicting cache, and a bad IndexedSpec are refused by name."""
    from qkv.cache import FullSpec, IndexedSpec, Int8, plan_memory

    model = _models(next(iter(CASES)))[2]
    ids, _ = _prompt(next(iter(CASES)), padded=False)
    plain = [FullSpec(s.n_kv_heads, s.head_dim) if isinstance(s, IndexedSpec) else s for s in model.cache_specs()]
    with pytest.raises(ValueError, match=r"layer 1 \(MSA\) caches its indexer key .* needs IndexedSpec"):
        model(ids, cache=KVCache(plain))
    with pytest.raises(ValueError, match=r"layers \[1, 2\] keep an indexer key in their value rows"):
        KVCache(model.cache_specs(), quant=Int8())
    with pytest.raises(ValueError, match=r"layers \[1, 2\] keep an indexer key"):
        plan_memory(model, batch=1, context=32, quant=Int8())
    for bad, match in ((dict(index_head_dim=0), r"index_head_dim\) must be an int >= 1"),
                       (dict(index_head_dim=8, values_only=True), "values_only is not defined")):
        with pytest.raises(ValueError, match=match):
            IndexedSpec(2, 16, **bad)
    spec = IndexedSpec(3, 4, index_head_dim=7)  # 7 channels over 3 heads: 3 each, the last padded
    assert (spec.index_tail, spec.dv, spec.row_elements()) == (3, 7, 3 * (4 + 7))
    v, keys = torch.randn(2, 3, 5, 4), torch.randn(2, 5, 7)
    back_v, back_keys = spec.split_values(spec.pack_values(v, keys))
    assert torch.equal(back_v, v) and torch.equal(back_keys, keys)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_route_gives_eager_logits(case):
    """HF's own model with attn_implementation="qkv": its MSA layers hand the block selection to the attention
    interface as a 4-D mask, which qkv takes densely; the logits are within budget of HF float64 eager (HF float32
    eager the baseline), unpadded (HF's padded selection is its own, see the module)."""
    import qkv.integrations.transformers as qhf
    from _hf import within_budget

    hf, ref, _ = _models(case)
    cand = copy.deepcopy(hf)
    qhf.use(cand)
    ids, _ = _prompt(case, padded=False)
    with torch.no_grad():
        within_budget(cand(ids).logits, ref(ids).logits, hf(ids).logits, what=f"{case} attn_implementation='qkv'")


def test_hf_route_block_indices_checked_and_read_as_blocks():
    """The attention function reads block_indices as key blocks per KV group (slots past the keys and -1 blocks
    dropped): equal to eager with HF's own block mask; bad shapes and a module without a block size refused."""
    import qkv.integrations.transformers as qhf

    hf, _, _ = _models(next(iter(CASES)))
    attn = hf.model.layers[1].self_attn
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 5, 16, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    blocks = torch.tensor([[[[0, -1], [0, 1], [1, 0], [1, -1], [0, 1]], [[0, 1], [-1, -1], [1, -1], [0, 1],
                                                                        [1, 0]]]])  # (1, Hi=2, 5, 2), block 3
    out, _ = qhf.attention_forward(attn, q, k, v, None, scaling=0.25, block_indices=blocks)
    keep = torch.zeros(1, 2, 5, 5, dtype=torch.bool)
    for h in range(2):
        for i in range(5):
            for b in blocks[0, h, i].tolist():
                if b >= 0:
                    keep[0, h, i, b * 3:b * 3 + 3] = True
    keep = keep & torch.ones(5, 5, dtype=torch.bool).tril()
    keep = keep.repeat_interleave(2, dim=1)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
    want = (scores.softmax(-1).nan_to_num() @ v.repeat_interleave(2, dim=1)).transpose(1, 2)
    got_rows = keep.any(-1).transpose(1, 2)  # queries with some key (the others: no key kept)
    assert torch.allclose(out[got_rows], want[got_rows], atol=1e-5)
    with pytest.raises(ValueError, match=r"block_indices .* must be \(B, Hi, Nq, K\)"):
        qhf.attention_forward(attn, q, k, v, None, block_indices=blocks[:, :, :3])
    with pytest.raises(ValueError, match="without a block size"):
        qhf.attention_forward(torch.nn.Module(), q, k, v, None, block_indices=blocks)


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
