"""Decoder families on qkv against HF transformers: Llama, Mistral, Qwen2, Gemma 2, Gemma 3 (text), DeepSeek-V2.

Every case is a tiny HF model built from a config (eager attention, eval mode) whose weights are redrawn at
unit scale, so attention is far from uniform and a wrong mask, RoPE or norm shows in the logits. Then:

- prefill logits are within the error budget: qkv float32 against HF float64 (the reference), with HF
  float32 as the baseline; once without padding, once left-padded with an attention mask;
- cached greedy generation (``qkv.models.generate`` with a ``qkv.cache.KVCache``) emits exactly the tokens
  of HF's ``generate(do_sample=False)``, left padding included.

Configs vary GQA ratio (4:1, 2:1, MQA, MHA), sliding windows shorter than the prompt, RoPE scaling
(llama3, linear, yarn) and per-layer-type RoPE bases, ``q_lora_rank`` None and set, MoE routing and
tied/untied heads. Checkpoints on disk and bad checkpoints are tested at the end.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from _hf import hf_causal_lm, two_row_prompt, within_budget
from _parity import LogitParity
from qkv.cache import AttentionCache, KVCache, LatentSpec, Paged, SlidingWindowSpec, Static
from qkv.models import CheckpointError, from_hf
from qkv.models.generate import generate

transformers = pytest.importorskip("transformers")

N_PROMPT, N_PAD, N_NEW = 14, 4, 10
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64,
             attn_implementation="eager", experts_implementation="eager")

# id -> (HF config class, HF model class, config overrides, KV-cache storage for the generation test)
CASES = {
    "llama-Hq8-Hkv2-llama3rope-untied": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), "dynamic"),
    "llama-MQA-D24-linearrope-tied-bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}), "static"),
    "mistral-Hq4-Hkv2-W5": ("MistralConfig", "MistralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, tie_word_embeddings=False), "static"),
    "qwen2-MHA-bias-W5-layer1": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, use_sliding_window=True, sliding_window=5, max_window_layers=1,
        tie_word_embeddings=True), "dynamic"),
    "gemma2-L4-W5-softcap": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=5,
        query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=8.0), "static"),
    "gemma3-L4-W5-qknorm-localbase": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=5,
        sliding_window_pattern=3, query_pre_attn_scalar=32, rope_theta=50000.0, rope_local_base_freq=500.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0}), "dynamic"),
    "deepseek-qlora0-yarn-moe": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 16, "mscale": 0.707,
                                                  "mscale_all_dim": 0.707}), "dynamic"),
    "deepseek-qlora24-grouprouting": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=16,
        first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5, tie_word_embeddings=True,
        norm_topk_prob=True), "static"),  # transformers' V2 router ignores it: from_hf must too
}


_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    if case not in _MODELS:
        cfg_cls, model_cls, overrides, _ = CASES[case]
        hf = hf_causal_lm(cfg_cls, model_cls, {**_BASE, **overrides}, seed=sorted(CASES).index(case))
        ref = copy.deepcopy(hf).double().eval()
        _MODELS[case] = (hf, ref, from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return two_row_prompt(100 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT,
                          pad=N_PAD if padded else 0)


@pytest.mark.parametrize("case", list(CASES))
def test_replaced_config_builds_the_same_model(case):
    """``config.replace`` keeps every field it is not told to change (RoPE base, scaling and pair layout
    included: it once reset them), and the input-major layout (``qkv.cpu.optimize(model, input_major=True)``)
    computes the same logits, prefill and a one-token decode step."""
    from qkv.cpu import optimize
    from qkv.models.loading import _family

    hf, ref, model = _models(case)
    config = model.config.replace(name="replaced")
    assert config == dataclasses.replace(model.config, name="replaced")
    assert dict(config.rope) == dict(model.config.rope)
    other = optimize(type(model)(config).eval(), input_major=True)
    other.load_state_dict(model.state_dict())
    assert any(not p.is_contiguous() for p in other.parameters())
    ids, _ = _prompt(case, padded=False)
    with torch.no_grad():
        within_budget(other(ids).logits, ref(ids).logits, hf(ids).logits, what=f"{case} input-major prefill logits")
        cache = KVCache(other.cache_specs())
        other(ids[:, :-1], cache=cache)
        step = other(ids[:, -1:], cache=cache).logits[:, -1]
        within_budget(step, ref(ids).logits[:, -1], hf(ids).logits[:, -1], what=f"{case} input-major decode step")
    assert _family(hf.config.to_dict()).decoder_config(hf.config.to_dict()) == model.config


class TestHFParity(LogitParity):
    """The shared parity suite (tests/_parity.py), prefill only (the decode steps are checked by verify_cache and by
    the generation). The left-padded reference is each row run alone (HF float64 turns fully masked padding rows
    into NaN, which leaks into real rows); the baseline must then differ from it by rounding only."""

    CASES, N_NEW = CASES, N_NEW
    DECODE_TAIL = ()

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)

    def generation_cache(self, case, model):
        storage = Static(N_PROMPT + N_NEW) if CASES[case][3] == "static" else None
        return KVCache(model.cache_specs(), storage=storage)

    def check_padded(self, case, budget, truth):
        # A baseline that let padding leak in would set an allowance large enough to hide the same leak in qkv.
        assert 0 < budget.baseline_error < 1e-3 * max(1.0, float(truth.abs().max())), f"implausible baseline: {budget}"


def _check_generation(case: str, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
    TestHFParity().generates_hf_tokens(case, ids, mask)


@pytest.mark.parametrize("case", ["deepseek-qlora0-yarn-moe", "llama-Hq8-Hkv2-llama3rope-untied"])
def test_batch1_cached_greedy_generation_matches_hf(case):
    """One sequence: the decode steps take the one-token paths (a single routed token through the experts,
    Nq = 1 attention over the cache) that a batch of two never reaches."""
    ids, _ = _prompt(case, padded=False)
    _check_generation(case, ids[:1], None)


@pytest.mark.parametrize("chunk", [None, 3], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("case", ["gemma3-L4-W5-qknorm-localbase", "deepseek-qlora0-yarn-moe"])
def test_rows_sharing_a_prompt_prefix_generate_hfs_tokens(case, chunk):
    """Paged prefix caching shares a common prompt prefix between rows of one batch (the longest row writes its
    blocks, the others point at them), left-padded and in chunks that end inside a shared block: HF's tokens."""
    hf, _, model = _models(case)
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(1, _BASE["vocab_size"], (10,), generator=gen).tolist()
    rows = [prefix + torch.randint(1, _BASE["vocab_size"], (n,), generator=gen).tolist() for n in (4, 1, 2)]
    N = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (N - len(r)) + r for r in rows])
    mask = (torch.arange(N) >= torch.tensor([N - len(r) for r in rows]).view(-1, 1)).long()
    cache = KVCache(model, storage=Paged(block_size=4, num_blocks=64, prefix_caching=True))
    out = generate(model, ids, max_new_tokens=N_NEW, attention_mask=mask, cache=cache, prefill_chunk_size=chunk)
    assert out.prefix_hits.tolist() == [0, 8, 8]  # two full blocks of the 10-token prefix, written by row 0
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)[:, N:]
    assert torch.equal(out.new_tokens, expected), f"{case}: qkv {out.new_tokens.tolist()}\nhf  {expected.tolist()}"


@pytest.mark.parametrize("case, storage", [
    ("gemma3-L4-W5-qknorm-localbase", "paged"),
    ("mistral-Hq4-Hkv2-W5", "static"),
    ("deepseek-qlora0-yarn-moe", "paged"),
])
def test_verify_cache_decode_crop_fork(case, storage):
    """Cached decoding equals recomputation under paged blocks (prefix reuse) and static rings, including
    rollback (crop) and forked rows."""
    from qkv.models import verify_cache

    model = _models(case)[2]
    make = {"paged": lambda: KVCache(model, storage=Paged(block_size=4, num_blocks=128, prefix_caching=True)),
            "static": lambda: KVCache(model, storage=Static(64), rollback=4)}[storage]
    report = verify_cache(model, make)
    assert report.ok, str(report)


class _ProtocolOnlyCache(AttentionCache):
    """A cache offering only the protocol, saying that it re-positions keys (``keeps_absolute_positions``
    False): the model must hand it un-rotated keys with ``rope`` and rotate queries where it says. The
    no-op ``observe``/``prepare`` and ``prefix_caching`` come from the protocol's defaults."""

    def __init__(self, inner: KVCache) -> None:
        self.inner = inner

    @property
    def seq_length(self) -> int:
        return self.inner.seq_length

    def keeps_absolute_positions(self, layer_idx: int) -> bool:
        return False

    def update(self, layer_idx, k, v, *, positions, rope=None):
        assert rope is not None, "un-rotated keys must come with rope"
        return self.inner.update(layer_idx, k, v, positions=positions, rope=rope)

    def update_latent(self, layer_idx, c_kv, k_rope, *, positions, rope=None):
        return self.inner.update_latent(layer_idx, c_kv, k_rope, positions=positions, rope=rope)

    def cross_kv(self, layer_idx, compute):
        return self.inner.cross_kv(layer_idx, compute)


@pytest.mark.parametrize("case", ["llama-Hq8-Hkv2-llama3rope-untied", "gemma3-L4-W5-qknorm-localbase"])
def test_caches_that_reposition_keys_get_unrotated_keys(case):
    model = _models(case)[2]
    ids, mask = _prompt(case, padded=True)
    runs = [generate(model, ids, max_new_tokens=4, attention_mask=mask, cache=c, return_logits=True)
            for c in (KVCache(model.cache_specs()), _ProtocolOnlyCache(KVCache(model.cache_specs())))]
    assert torch.equal(runs[0].new_tokens, runs[1].new_tokens)
    torch.testing.assert_close(runs[1].logits, runs[0].logits, rtol=0, atol=1e-5)


def test_cache_specs_follow_layer_types():
    specs = _models("gemma3-L4-W5-qknorm-localbase")[2].cache_specs()
    assert [type(s).__name__ for s in specs] == ["SlidingWindowSpec", "SlidingWindowSpec", "FullSpec",
                                                 "SlidingWindowSpec"]
    assert specs[0] == SlidingWindowSpec(5, 1, 32)
    qwen = _models("qwen2-MHA-bias-W5-layer1")[2].cache_specs()
    assert [type(s).__name__ for s in qwen] == ["FullSpec", "SlidingWindowSpec"]
    assert _models("deepseek-qlora0-yarn-moe")[2].cache_specs() == [LatentSpec(16, 8)] * 2


def test_gemma3_config_json_before_transformers5_gives_the_same_model():
    """Old config.json files carry rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern
    instead of per-layer-type rope_parameters and layer_types."""
    from qkv.models.family_gemma import decoder_config

    new = _models("gemma3-L4-W5-qknorm-localbase")[0].config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=50000.0, rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
               sliding_window_pattern=3)
    assert decoder_config(old) == decoder_config(new)


@pytest.mark.parametrize("case", ["deepseek-qlora0-yarn-moe", "gemma2-L4-W5-softcap"])
def test_checkpoint_directory_loads_like_the_model(case, tmp_path):
    """save_pretrained writes per-expert tensors (DeepSeek) and drops the tied head (Gemma)."""
    hf, _, model = _models(case)
    hf.save_pretrained(tmp_path)
    loaded = from_hf(tmp_path)
    ids, _ = _prompt(case, padded=False)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def _saved(case: str, tmp_path):
    from safetensors.torch import load_file, save_file

    _models(case)[0].save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    return load_file(str(path)), (lambda state: save_file(state, str(path), metadata={"format": "pt"}))


def test_missing_tensor_is_named(tmp_path):
    state, save = _saved("mistral-Hq4-Hkv2-W5", tmp_path)
    del state["model.layers.1.self_attn.k_proj.weight"]
    save(state)
    with pytest.raises(CheckpointError, match=r"lacks \['layers.1.self_attn.k_proj.weight'\]"):
        from_hf(tmp_path)


def test_missing_expert_is_named(tmp_path):
    state, save = _saved("deepseek-qlora0-yarn-moe", tmp_path)
    for name in [n for n in state if ".experts.3." in n]:
        del state[name]
    save(state)
    with pytest.raises(CheckpointError, match="expert 3 of 4"):
        from_hf(tmp_path)


def test_config_that_does_not_fit_the_weights_is_named(tmp_path):
    import json

    _saved("llama-Hq8-Hkv2-llama3rope-untied", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # the weights have 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"shape mismatches: layers.0.self_attn.qkv_proj.weight"):
        from_hf(tmp_path)


@pytest.mark.parametrize("change, match", [
    ({"hidden_act": "gelu_fast"}, "hidden_act 'gelu_fast' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "unsupported rope_type 'longrope'"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "multiple of num_key_value_heads"),
], ids=["activation", "rope-type", "heads"])
def test_unsupported_config_fails_clearly(change, match):
    cfg = {**_models("mistral-Hq4-Hkv2-W5")[0].config.to_dict(), **change}
    from qkv.models.family_llama import build

    with pytest.raises((CheckpointError, ValueError), match=match):
        build(cfg)


def test_a_new_family_is_one_module_and_a_registry_line(tmp_path, monkeypatch):
    """A family defined in this test only (a Llama renamed): its module reads the config through
    qkv.models.hf and registers one line in FAMILIES; from_hf then loads it with no change to qkv."""
    import json
    import sys
    import types

    from qkv.models.hf import decoder_config, rename_decoder
    from qkv.models.loading import FAMILIES
    from qkv.nn import DecoderLM

    family = types.ModuleType("qkv_test_family_toy")
    family.build = lambda cfg: DecoderLM(decoder_config(cfg, hidden_act=cfg.get("hidden_act", "silu")))
    family.convert = lambda state, cfg: rename_decoder(state, decoder_config(cfg), norms={
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"})
    monkeypatch.setitem(sys.modules, family.__name__, family)
    monkeypatch.setitem(FAMILIES, "toy", family.__name__)  # the registry line
    hf, _, llama = _models("llama-Hq8-Hkv2-llama3rope-untied")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "toy"}))
    toy = from_hf(tmp_path)
    ids, _ = _prompt("llama-Hq8-Hkv2-llama3rope-untied", padded=False)
    with torch.no_grad():
        assert torch.equal(toy(ids).logits, llama(ids).logits)
