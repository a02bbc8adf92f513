"""Mistral 4 (``mistral4``) on qkv against HF transformers (eager): MLA with interleaved RoPE, Llama 4's position
scale of the queries, and a softmax router over expert groups ranked by their two best scores.

Cases: HF's default YaRN RoPE with ``llama_4_scaling_beta`` and a short ``original_max_position_embeddings`` (8), so
the query scale changes inside the prompt, q-LoRA, 4 groups of which 2 are kept, a dense first layer, a shared expert
and ``routed_scaling_factor``; and YaRN at another base and factor with channel pairs not interleaved, a plain
``q_proj``, one group, two shared experts (HF's Mistral 4 runs its default RoPE on the whole head, so YaRN it is).
Weights are redrawn at unit scale (``tests/_hf.py``); the shared parity suite (``tests/_parity.py``) checks
prefill, cached decode, left padding, greedy generation and the HF route; qkv float64 equals HF float64 to a
relative 1e-8 once HF's float32 islands are made float64.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import float64_rope, float64_throughout, hf_causal_lm, two_row_prompt, within_budget
from _parity import HFRouteParity, LogitParity
from qkv.cache import KVCache, Paged, Static
from qkv.models import CheckpointError, from_hf
from qkv.models.verify import verify_cache

N_PROMPT, N_PAD, N_NEW = 14, 4, 8
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4,
         "partial_rotary_factor": 8 / 24}

CASES = {
    "mistral4-yarn-llama4scale-qlora24-G4k2-dense1": dict(
        q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.0, rope_parameters=_YARN),
    "mistral4-yarn500-pairs-split-shared2": dict(
        n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2, rope_interleave=False, norm_topk_prob=False,
        rope_parameters={**_YARN, "rope_theta": 500.0, "factor": 2.0, "original_max_position_embeddings": 32,
                         "llama_4_scaling_beta": 0.1}),
}


def _transformers():
    return pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    _transformers()
    if case not in _MODELS:
        hf = hf_causal_lm("Mistral4Config", "Mistral4ForCausalLM", {**_BASE, **CASES[case]},
                          seed=90 + sorted(CASES).index(case), attn_implementation="eager",
                          experts_implementation="eager")
        _MODELS[case] = (hf, copy.deepcopy(hf).double().eval(), from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return two_row_prompt(500 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT, pad=N_PAD if padded else 0)


class TestHFParity(LogitParity, HFRouteParity):
    """The shared parity suite (tests/_parity.py), generation on a static cache."""

    CASES, N_NEW = CASES, N_NEW

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)

    def generation_cache(self, case, model):
        return KVCache(model.cache_specs(), storage=Static(N_PROMPT + N_NEW))

    def test_hf_route_gives_eager_logits(self, case):
        """As the shared test, with the padded row's positions given to HF (HF's forward numbers a left-padded row
        from its padding, which Llama 4's query scale, unlike RoPE, does not forgive)."""
        import qkv.integrations.transformers as qhf
        from qkv.models.generate import prompt_positions

        hf, ref, _ = _models(case)
        cand = copy.deepcopy(hf)
        qhf.use(cand)
        ids, mask = _prompt(case, padded=True)
        pos, real = prompt_positions(mask).clamp_min(0), mask.bool()
        with torch.no_grad():
            ours = cand(ids, attention_mask=mask, position_ids=pos).logits
            base = hf(ids, attention_mask=mask, position_ids=pos).logits
            truth = torch.cat([ref(ids[b, real[b]][None]).logits[0] for b in range(ids.shape[0])])
        within_budget(ours[real], truth, base[real], what=f"{case} attn_implementation='qkv' logits")


def test_float64_logits_equal_hf_float64():
    """qkv float64 against HF float64 with its float32 islands kept float64 (``float64_throughout``, RoPE recomputed
    in float64; the plain-RoPE case, below the query scale's period): relative error < 1e-8."""
    case = "mistral4-yarn500-pairs-split-shared2"
    ref = float64_rope(copy.deepcopy(_models(case)[1]))
    model = from_hf(ref, dtype=torch.float64)
    ids, mask = _prompt(case, padded=True)
    row = ids[1, mask[1].bool()][None]
    with torch.no_grad():
        ours, padded = model(ids[:1]).logits, model(ids, attention_mask=mask).logits[1, N_PAD:]
        cache = KVCache(model.cache_specs())
        model(ids[:1, :-1], cache=cache)
        step = model(ids[:1, -1:], cache=cache).logits[:, -1]
        with float64_throughout():  # the reference only: qkv runs outside, its own casts unmasked
            truth, truth_row = ref(ids[:1]).logits, ref(row).logits[0]
    for what, got, want in (("prefill", ours, truth), ("left-padded row", padded, truth_row),
                            ("cached decode step", step, truth[:, -1])):
        rel = ((got - want).norm() / want.norm()).item()
        assert got.dtype == torch.float64 and rel < 1e-8, f"{case} {what}: relative error {rel:.2e}"


def test_switches_reach_the_model():
    _, _, model = _models("mistral4-yarn-llama4scale-qlora24-G4k2-dense1")
    c = model.config
    assert (c.latent.query_scale_beta, c.latent.query_scale_period) == (0.4, 8) and c.latent.q_lora_rank == 24
    assert c.rope_for("full_attention").interleaved and c.rope_for("full_attention").partial_rotary_factor == 1.0
    assert model.ropes["full_attention"].emb.rotary_dim == 8
    assert c.moe.topk_method == "group_limited_top2" and (c.moe.n_group, c.moe.topk_group) == (4, 2)
    assert c.moe.norm_topk_prob and c.moe.routed_scaling_factor == 2.0 and not c.moe.is_moe(0) and c.moe.is_moe(1)
    other = _models("mistral4-yarn500-pairs-split-shared2")[2].config
    assert not other.rope_for("full_attention").interleaved and not other.moe.norm_topk_prob


def test_query_scale_and_group_routing_matter():
    """Without the query scale, or with the groups not limited, the logits change: both options are live."""
    import dataclasses

    from qkv.nn import DecoderLM

    case = "mistral4-yarn-llama4scale-qlora24-G4k2-dense1"
    _, _, model = _models(case)
    ids, _ = _prompt(case, padded=False)
    c = model.config
    for changed in (c.replace(latent=dataclasses.replace(c.latent, query_scale_beta=None, query_scale_period=None)),
                    c.replace(moe=dataclasses.replace(c.moe, topk_group=4))):
        other = DecoderLM(changed)
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (other(ids).logits - model(ids).logits).abs().max() > 1e-3


def test_group_limited_top2_routing_equals_a_loop():
    """``group_limited_top2`` against a per-token loop written from the rule: groups ranked by their two best softmax
    scores, the top-k experts of the kept groups, renormalized, scaled."""
    from qkv.nn import MoEConfig
    from qkv.nn.moe import route_softmax

    m = MoEConfig(n_routed_experts=12, num_experts_per_tok=3, moe_intermediate_size=4, topk_method="group_limited_top2",
                  n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5)
    logits = torch.randn(20, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w, idx = route_softmax(logits, m)
    for t in range(20):
        s = logits[t].softmax(-1)
        groups = sorted(range(4), key=lambda gi: -float(s[3 * gi:3 * gi + 3].sort().values[-2:].sum()))[:2]
        allowed = [e for gi in groups for e in range(3 * gi, 3 * gi + 3)]
        top = sorted(allowed, key=lambda e: -float(s[e]))[:3]
        assert sorted(idx[t].tolist()) == sorted(top)
        want = {e: 1.5 * float(s[e]) / float(s[top].sum()) for e in top}
        assert all(abs(float(wt) - want[int(e)]) < 1e-12 for wt, e in zip(w[t], idx[t]))


@pytest.mark.parametrize("storage", ["dynamic", "static", "paged"])
def test_verify_cache(storage):
    model = _models("mistral4-yarn-llama4scale-qlora24-G4k2-dense1")[2]
    make = {"dynamic": lambda: KVCache(model, rollback=4),
            "static": lambda: KVCache(model, storage=Static(64), rollback=4),
            "paged": lambda: KVCache(model, storage=Paged(block_size=4, num_blocks=128, prefix_caching=True))}[storage]
    report = verify_cache(model, make)
    assert report.ok, str(report)


def test_checkpoint_directory_loads_like_the_model(tmp_path):
    hf, _, model = _models("mistral4-yarn-llama4scale-qlora24-G4k2-dense1")
    hf.save_pretrained(tmp_path)
    ids, _ = _prompt("mistral4-yarn-llama4scale-qlora24-G4k2-dense1", padded=False)
    with torch.no_grad():
        assert torch.equal(from_hf(tmp_path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("change, match", [
    (dict(rope_parameters={**_YARN, "partial_rotary_factor": 0.5}), "partial_rotary_factor 8/24; this config says 0.5"),
    (dict(rope_parameters={k: v for k, v in _YARN.items() if k != "original_max_position_embeddings"}),
     "llama_4_scaling_beta needs original_max_position_embeddings"),
    (dict(n_group=3), "needs n_group dividing n_routed_experts"),
    (dict(model_type="deepseek_v3"), "family_mistral4: model_type 'deepseek_v3' is not mistral4"),
    (dict(head_dim=8), r"head_dim=8 != qk_nope_head_dim \+ qk_rope_head_dim = 24: HF would draw its RoPE frequencies "
     "for 2 channels and rotate 8"),
], ids=["partial-rope", "scale-period", "groups", "wrong-type", "head-dim"])
def test_bad_configs_are_refused(change, match):
    from qkv.models import family_mistral4

    cfg = {**_models("mistral4-yarn-llama4scale-qlora24-G4k2-dense1")[0].config.to_dict(), **change}
    with pytest.raises(CheckpointError, match=match):
        family_mistral4.build(cfg)


@pytest.mark.parametrize("change, match", [
    (dict(query_scale_beta=0.1), "query_scale_beta and query_scale_period go together"),
    (dict(query_scale_beta=-1.0, query_scale_period=8), "query_scale_beta must be a float >= 0"),
    (dict(query_scale_beta=0.1, query_scale_period=0), "query_scale_period a positive int"),
], ids=["alone", "negative", "period-0"])
def test_latent_config_refuses_bad_query_scale(change, match):
    from qkv.nn import LatentConfig

    with pytest.raises(ValueError, match=match):
        LatentConfig(hidden_size=32, num_attention_heads=4, kv_lora_rank=8, **change)
