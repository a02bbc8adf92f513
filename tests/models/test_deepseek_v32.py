"""DeepSeek-V3.2 (DeepSeek Sparse Attention over MLA) on qkv against HF transformers' ``DeepseekV32ForCausalLM``.

Tiny HF configs with weights redrawn at unit scale (and DeepSeek-V3's routing correction bias drawn large), so
routing and the indexer's choices matter; ``index_topk`` is smaller than the prompt, so each query attends to a
strict subset of its keys. The indexer has 16 heads: its score is a weighted sum of per-head ReLUs, and with few
heads many keys score exactly 0, a tie whose order HF's ``torch.topk`` leaves unspecified (qkv's stable sort
prefers the earlier key); with 16 heads no tie reaches the top-k boundary (checked below). Prefill and decode
logits, weight gradients, left-padded generation, cache checks, the cache bytes and the decode step's reads.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import hf_causal_lm, two_row_prompt, within_budget
from _parity import LogitParity
from qkv import attention
from qkv.backends.gather import split_selection
from qkv.cache import KVCache, Paged, Static
from qkv.models import CheckpointError, from_hf, verify_cache
from qkv.models.generate import generate

N_PROMPT, N_PAD, N_NEW = 14, 4, 8
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
             n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, routed_scaling_factor=2.5,
             index_n_heads=16, index_head_dim=16)

CASES = {
    "K5-Hi16-Di16": dict(index_topk=5),
    "K6-Hi16-Di16-yarn": dict(index_topk=6, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def _transformers():
    return pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    _transformers()
    if case not in _MODELS:
        hf = hf_causal_lm("DeepseekV32Config", "DeepseekV32ForCausalLM", {**_BASE, **CASES[case]},
                          seed=sorted(CASES).index(case), attn_implementation="eager", experts_implementation="eager")
        _MODELS[case] = (hf, copy.deepcopy(hf).double().eval(), from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return two_row_prompt(100 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT,
                          pad=N_PAD if padded else 0)


def _hf_selections(ref, ids) -> list[torch.Tensor]:
    """Per layer, HF float64's selected keys as a (B, N, N) boolean over the causally visible keys, plus the
    scores, to check that no tie sits at the top-k boundary."""
    picked = []

    def hook(mod, args, kwargs, out):
        B, N = out.shape[:2]
        sel = torch.zeros(B, N, N, dtype=torch.bool).scatter_(-1, out.long(), True)
        picked.append(sel & torch.ones(N, N, dtype=torch.bool).tril())

    hooks = [layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True) for layer in ref.model.layers]
    try:
        with torch.no_grad():
            ref(ids)
    finally:
        for h in hooks:
            h.remove()
    return picked


def _our_selections(model, ids) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, qkv's selected keys (B, N, N) and index scores (B, N, N), from a hook on each indexer."""
    picked, scores = [], []

    def hook(mod, args, out):
        B, N, S = out.scores.shape
        idx = out.indices
        sel = torch.zeros(B, N, S + 1, dtype=torch.bool).scatter_(-1, torch.where(idx < 0, S, idx), True)
        picked.append(sel[..., :S])
        scores.append(out.scores)

    hooks = [layer.self_attn.indexer.register_forward_hook(hook) for layer in model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return picked, scores


@pytest.mark.parametrize("case", list(CASES))
def test_indexer_selects_hf_keys_and_selection_matters(case):
    hf, ref, model = _models(case)
    ids, _ = _prompt(case, padded=False)
    ours64 = copy.deepcopy(model).double()
    theirs = _hf_selections(ref, ids)
    mine, scores = _our_selections(ours64, ids)
    K = CASES[case]["index_topk"]
    for i, (a, b, s) in enumerate(zip(theirs, mine, scores)):
        kth = s.sort(-1, descending=True).values[..., K - 1:K + 1]  # K-th and (K+1)-th best of full rows
        assert not bool((kth[..., 0] == kth[..., 1])[:, K:].any()), f"layer {i}: a score tie at the top-k boundary"
        assert torch.equal(a, b), f"layer {i}: qkv and HF select different keys"
        assert int(b.sum(-1).max()) == K < N_PROMPT, f"layer {i}: the selection must drop keys"
    dense = from_hf(hf)
    for layer in dense.layers:
        layer.self_attn.indexer.index_topk = N_PROMPT
    with torch.no_grad():
        gap = (dense(ids).logits - model(ids).logits).abs().max()
    assert gap > 0.1, f"attending to every key changes the logits by only {gap:.3g}; the selection does not matter"


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_within_budget(case):
    """Backward through the sparse attention (the gather backend) and the experts: weight gradients of a random
    linear function of the logits against HF float64; the indexer gets none (a top-k, as in HF and the paper)."""
    hf, ref, model = (copy.deepcopy(m) for m in _models(case))
    ids, _ = _prompt(case, padded=False)
    w = torch.randn(2, N_PROMPT, _BASE["vocab_size"], generator=torch.Generator().manual_seed(5))
    for m in (hf, ref, model):
        (m(ids).logits * w.to(m.lm_head.weight.dtype)).sum().backward()
    theirs, base, ours = (dict(m.named_parameters()) for m in (ref, hf, model))
    for name in ("layers.0.self_attn.kv_b_proj.weight", "layers.1.self_attn.q_a_proj.weight",
                 "layers.1.self_attn.kv_a_proj_with_mqa.weight", "embed_tokens.weight"):
        within_budget(ours[name].grad, theirs["model." + name].grad, base["model." + name].grad, what=f"{case} d{name}")
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)


class TestHFParity(LogitParity):
    """The shared parity suite (tests/_parity.py). HF masks padded keys before its top-k (an additive finfo.min), so
    a row's selection ignores its padding: well-defined, and qkv's tokens equal HF's."""

    CASES, N_NEW = CASES, N_NEW

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)

    def generation_cache(self, case, model):
        return KVCache(model.cache_specs())


@pytest.mark.parametrize("storage", ["dynamic", "static", "paged"])
def test_verify_cache(storage):
    model = _models("K5-Hi16-Di16")[2]
    make = {"dynamic": lambda: KVCache(model, rollback=2),
            "static": lambda: KVCache(model, storage=Static(32), rollback=2),
            "paged": lambda: KVCache(model, storage=Paged(block_size=4, num_blocks=64, prefix_caching=True))}[storage]
    report = verify_cache(model, make, max_new_tokens=4)
    assert report.ok, str(report)


@pytest.mark.parametrize("storage", ["dynamic", "paged"])
def test_default_cache_keeps_the_indexer_key(storage):
    """``model.cache_specs()`` rows hold latent + RoPE key + indexer key; ``plan_memory`` of the model and of its
    HF config give the bytes the cache then holds."""
    from qkv.cache import IndexedLatentSpec, plan_memory

    hf, _, model = _models("K5-Hi16-Di16")
    specs = model.cache_specs()
    assert specs == [IndexedLatentSpec(16, 8, 16)] * 2
    assert specs[0].row_bytes(torch.float32) == 4 * (16 + 8 + 16)
    ids, _ = _prompt("K5-Hi16-Di16", padded=False)
    kw = {"storage": Paged(block_size=4, num_blocks=64)} if storage == "paged" else {}
    cache = KVCache(specs, **kw)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, -1:], cache=cache)
    held = [m.allocated_bytes for m in cache.memory().layers]
    for description in (model, hf.config):
        plan = plan_memory(description, batch=2, context=N_PROMPT + 1, new_tokens=1, dtype=torch.float32, **kw)
        assert [round(m.allocated_bytes) for m in plan.layers] == held, description


def test_decode_step_attends_to_k_latents_through_the_gather_backend():
    """The attention call of a decode step gets one list of ``index_topk`` cached latents per query (not the
    whole cache) and the gather backend, which reads only the listed rows; its output equals the reference
    backend's dense masked attention."""
    model = copy.deepcopy(_models("K5-Hi16-Di16")[2])
    K = CASES["K5-Hi16-Di16"]["index_topk"]
    ids, _ = _prompt("K5-Hi16-Di16", padded=False)
    calls = []
    for layer in model.layers:
        inner = layer.self_attn.attention_fn

        def record(q, k, v, *, mask=None, backend="auto", _inner=inner, **kw):
            out = _inner(q, k, v, mask=mask, backend=backend, **kw)
            calls.append((q, k, v, mask, backend, kw.get("scale"), out))
            return out

        layer.self_attn.attention_fn = record
    cache = KVCache(model.cache_specs())
    with torch.no_grad():
        model(ids, cache=cache)
        calls.clear()
        model(ids[:, -1:], cache=cache)
    assert len(calls) == len(model.layers)
    for q, k, v, mask, backend, scale, out in calls:
        lists, _ = split_selection(mask)
        assert lists is not None, f"the decode step's mask holds no top-k lists: {mask!r}"
        assert k.shape[-2] == N_PROMPT + 1 > K
        assert lists.indices.shape[-1] == K and bool((lists.indices >= 0).all())
        assert backend == "gather"
        ref = attention(q.double(), k.double(), v.double(), mask=mask, scale=scale, backend="reference")
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_directory_loads_like_the_model(case, tmp_path):
    hf, _, model = _models(case)
    hf.save_pretrained(tmp_path)
    loaded = from_hf(tmp_path)
    ids, _ = _prompt(case, padded=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def _config(**change) -> dict:
    cfg = {**_BASE, **CASES["K5-Hi16-Di16"], "model_type": "deepseek_v32"}
    cfg.update(change)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize("change, match", [
    (dict(mlp_layer_types=["sparse", "sparse"]), "mlp_layer_types"),
    (dict(index_n_heads=None, index_head_dim=None, index_topk=None, model_type="deepseek_v3"), "model_type"),
    (dict(index_head_dim=4), "index_head_dim >= its qk_rope_head_dim"),
    (dict(index_topk=0), "index_topk must be a positive int"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(topk_method="greedy"), "noaux_tc"),
], ids=["mlp-layer-types", "model-type", "narrow-indexer", "topk-0", "no-q-lora", "routing"])
def test_bad_configs_fail_clearly(change, match):
    from qkv.models.family_deepseek_v32 import decoder_config

    with pytest.raises(CheckpointError, match=match):
        decoder_config(_config(**change))


def test_matching_mlp_layer_types_and_hf_defaults_are_read():
    from qkv.models.family_deepseek_v32 import decoder_config

    cfg = decoder_config(_config(mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention"] * 2))
    assert cfg.indexer.index_topk == 5 and cfg.moe.is_moe(1) and not cfg.moe.is_moe(0)
    defaults = decoder_config(_config(index_n_heads=None, index_head_dim=None, index_topk=None))
    assert (defaults.indexer.index_n_heads, defaults.indexer.index_head_dim, defaults.indexer.index_topk) == \
        (64, 128, 2048)  # DeepseekV32Config's defaults


def test_engine_tokens_equal_each_request_alone():
    """Continuous batching over the paged cache, prompts prefilled in chunks shorter than ``index_topk`` and the
    prompt (each chunk's queries select among the cached latents): each request's tokens equal generating it alone."""
    from qkv.models import Engine

    model = copy.deepcopy(_models("K5-Hi16-Di16")[2]).double()
    g = torch.Generator().manual_seed(0)
    requests = [(torch.randint(1, _BASE["vocab_size"], (n,), generator=g).tolist(), 5) for n in (9, 13, 6, 11)]
    engine = Engine(model, num_blocks=40, block_size=4, max_batch=3, prefill_chunk=4)
    ids = [engine.add(p, n) for p, n in requests]
    results = engine.run()
    for rid, (prompt, n) in zip(ids, requests, strict=True):
        alone = generate(model, torch.tensor([prompt]), max_new_tokens=n).new_tokens[0].tolist()
        assert results[rid].tokens == alone, rid
