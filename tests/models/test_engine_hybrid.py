"""Hybrid models in the ``Engine``: recurrent-state rows (Gated DeltaNet in Qwen3-Next and Qwen3.5, Kimi Delta
Attention in Kimi-Linear) beside paged attention rows, admitted, chunked, recycled, aborted and freed like any row.
Each case is a tiny HF model with redrawn weights loaded by ``from_hf`` in float64; every request's tokens equal
those of ``generate`` on it alone (greedy, and seeded sampling)."""

from __future__ import annotations

import random

import pytest
import torch

from _hf import hf_causal_lm
from _toy_lm import single_thread  # noqa: F401 (autouse fixture)
from qkv.models import Engine, SamplingParams, from_hf, generate

VOCAB = 160
_QWEN = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=64,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
_KIMI = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=16,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, num_hidden_layers=4, num_local_experts=8, n_group=4,
             topk_group=2, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
             linear_attn_config={"num_heads": 3, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                                 "full_attn_layers": [3]})

CASES = {
    "qwen3_next-E6": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _QWEN, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        _QWEN, linear_num_value_heads=8, linear_value_head_dim=4, tie_word_embeddings=True)),
    "kimi_linear-KDA-MLA": ("KimiLinearConfig", "KimiLinearForCausalLM", _KIMI),
}

_MODELS: dict = {}


def _model(case: str):
    pytest.importorskip("transformers", reason="HF transformers builds these hybrid models")
    if case not in _MODELS:
        cfg, cls, fields = CASES[case]
        hf = hf_causal_lm(cfg, cls, fields, seed=60 + sorted(CASES).index(case), attn_implementation="eager",
                          experts_implementation="eager")
        _MODELS[case] = from_hf(hf).double().eval()
    return _MODELS[case]


def _requests(n: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 26))], rng.randint(1, 10)) for _ in range(n)]


def _free(engine) -> dict[str, int]:
    return {k: s.blocks_free for k, s in engine.cache.pool_stats().items()}


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_rows_equal_generate(case):
    """Seven requests through two rows (rows recycled), prompts read in chunks of 5 beside decoding rows, one
    request aborted while decoding, one sampled with a seed: every request's tokens are generate's."""
    model = _model(case)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=5)
    total = _free(engine)
    reqs = _requests(7, sorted(CASES).index(case))
    reqs[2] = (reqs[2][0], 10)
    ids = [engine.add(p, b) for p, b in reqs]
    sampled = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=11)
    sid = engine.add(reqs[0][0], params=sampled)
    victim, got = ids[2], 0
    while got < 2:  # abort it while decoding
        got += sum(len(u.tokens) for u in engine.step() if u.request_id == victim)
    assert engine.abort(victim)
    results = engine.run()
    assert _free(engine) == total
    for rid, (p, b) in zip(ids, reqs):
        alone = generate(model, torch.tensor([p]), max_new_tokens=b).new_tokens[0].tolist()
        if rid == victim:
            assert results[rid].finish_reason == "abort" and results[rid].tokens == alone[:len(results[rid].tokens)]
        else:
            assert results[rid].tokens == alone, f"request {rid} (prompt {len(p)}, budget {b})"
    want = generate(model, torch.tensor([reqs[0][0]]), params=sampled).new_tokens[0].tolist()
    assert results[sid].tokens == want


def test_hybrid_models_refuse_what_a_state_cannot_do():
    model = _model("qwen3_5_text")
    with pytest.raises(ValueError, match=r"Engine: layer 0 \(RecurrentSpec\) keeps one state per row, not its "
                                         r"tokens, .* prefix_caching=False"):
        Engine(model, num_blocks=16, block_size=4, max_batch=2, prefix_caching=True)
    with pytest.raises(ValueError, match=r"layer 0 \(RecurrentSpec\) cannot read padding .* mixed_steps=False"):
        Engine(model, num_blocks=16, block_size=4, max_batch=2, mixed_steps=True)


def test_a_failed_hybrid_pass_ends_its_rows_with_the_reason():
    """A recurrent state keeps no history, so a pass that raised after some layers advanced it cannot be undone: its
    requests end with the exception and the reason, their blocks return to the pool, and later requests run as
    generate has them."""
    model = _model("qwen3_5_text")
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=8, optimize=False)
    a, b = engine.add([5, 6, 7, 8], 6), engine.add([9, 10, 11], 5)
    engine.step()
    fired = []

    def boom(module, args):
        if not fired:
            fired.append(1)
            raise RuntimeError("injected")

    handle = model.layers[2].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    handle.remove()
    results = engine.run()
    for rid in (a, b):
        assert "a recurrent layer's state" in results[rid].finish_reason, results[rid].finish_reason
    assert all(s.blocks_in_use == 0 for s in engine.cache.pool_stats().values())
    late = engine.add([12, 13, 14], 4)
    want = generate(model, torch.tensor([[12, 13, 14]]), max_new_tokens=4).new_tokens[0].tolist()
    assert engine.run()[late].tokens == want
