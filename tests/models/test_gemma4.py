"""Gemma 4 on qkv against HF transformers (eager), and the options it brought: cross-layer KV sharing in the cache,
K = V, proportional RoPE, per-layer input embeddings.

Cases are tiny HF ``Gemma4ForCausalLM`` models whose weights are redrawn at unit scale (tests/_hf.py), layer scalars
included. Between them they exercise local and global layers with their own head widths and KV heads, K = V on the
global layers, proportional RoPE, the last layers sharing earlier layers' keys and values with a double-wide MLP,
per-layer input embeddings, final logit soft-capping and a tied or untied head.

- the shared parity suite (tests/_parity.py): qkv float32 within the error budget of HF float64, cached decode,
  left padding, greedy generation equal to HF ``generate``, and HF's own model with ``attn_implementation="qkv"``;
- float64 exactness: qkv in float64 against HF's eager code in float64 with its RMSNorm, rotary angles and softmax
  computed in float64 too (HF's Gemma 4 casts the three to float32 even in a float64 model, a 1e-7 floor): relative
  error < 1e-8;
- the cache: shared layers allocate nothing, the planner counts each pool once, cached decoding equals
  recomputation with crop, fork and prefix reuse on every storage;
- bad configs are refused with errors that name the problem.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from _hf import hf_causal_lm, two_row_prompt
from _parity import HFRouteParity, LogitParity
from qkv.cache import FullSpec, KVCache, Paged, SharedSpec, SlidingWindowSpec, Static, StreamingLLM, plan_memory
from qkv.models import CheckpointError, from_hf

N_PROMPT, N_PAD, N_NEW = 14, 4, 8
_S, _F = "sliding_attention", "full_attention"
_BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=64,
             rope_parameters={_S: {"rope_type": "default", "rope_theta": 10000.0},
                              _F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})

# id -> config overrides
CASES = {
    # E2B/E4B-like: per-layer inputs, the last 3 layers share keys and values (double-wide MLP), softcap, tied head
    "e2b-ple-shared3-wide-softcap": dict(
        num_hidden_layers=7, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=5,
        layer_types=[_S, _F, _S, _S, _F, _S, _F], num_kv_shared_layers=3, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=160, final_logit_softcapping=30.0),
    # 31B-like: K = V on the global layers with their own (fewer) KV heads, untied head, default 5:1 pattern
    "31b-keqv-Hkv1-untied": dict(
        num_hidden_layers=6, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, tie_word_embeddings=False),
    # every option at once: K = V on global layers that are also shared, per-layer inputs
    "all-keqv-shared2-ple": dict(
        num_hidden_layers=6, num_key_value_heads=1, head_dim=16, global_head_dim=24, num_global_key_value_heads=2,
        attention_k_eq_v=True, sliding_window=4, layer_types=[_S, _F, _S, _S, _F, _F], num_kv_shared_layers=2,
        hidden_size_per_layer_input=4, vocab_size_per_layer_input=160),
    # 26B-A4B-like: 8 experts (3 per token) beside the dense MLP on every layer, K = V global layers, softcap
    "26b-a4b-moe-keqv": dict(
        num_hidden_layers=6, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8,
        top_k_experts=3, moe_intermediate_size=24, final_logit_softcapping=30.0),
}

_MODELS: dict[str, tuple] = {}


def _models(case: str):
    """(hf float32, hf float64, qkv float32) for a case, built once per session."""
    if case not in _MODELS:
        hf = hf_causal_lm("Gemma4TextConfig", "Gemma4ForCausalLM", {**_BASE, **CASES[case]},
                          seed=40 + sorted(CASES).index(case), attn_implementation="eager",
                          experts_implementation="eager")
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():  # Gemma 4's norms scale by w, not 1 + w: weights around 1 (randomize_weights: around 0);
            for name, p in hf.named_parameters():  # so do the router's input scale and its per-expert scales
                if "norm" in name or name.endswith("scale"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            for layer in hf.model.layers:  # layer scalars away from 1, so that a missing one shows
                layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
        _MODELS[case] = (hf, copy.deepcopy(hf).double().eval(), from_hf(hf))
    return _MODELS[case]


def _prompt(case: str, *, padded: bool):
    return two_row_prompt(300 + sorted(CASES).index(case), _BASE["vocab_size"], N_PROMPT, pad=N_PAD if padded else 0)


class TestHFParity(LogitParity, HFRouteParity):
    """The shared parity suite (tests/_parity.py)."""

    CASES, N_NEW = CASES, N_NEW
    DECODE_TAIL = (3, 1)  # a multi-token cached step, then one token

    def models(self, case):
        return _models(case)

    def prompt(self, case, *, padded):
        return _prompt(case, padded=padded)


@contextlib.contextmanager
def _hf_in_float64():
    """HF's Gemma 4 RMSNorm, rotary angles and eager softmax computed in the input's dtype (HF casts the three to
    float32 even in a float64 model)."""
    from transformers.models.gemma4 import modeling_gemma4 as mg

    def norm(self, x):
        y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon, -0.5)
        return y * self.weight if self.with_scale else y

    def rotary(self, x, position_ids, layer_type):
        angles = position_ids[..., None].double() * getattr(self, f"{layer_type}_inv_freq").double()
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    softmax = torch.nn.functional.softmax

    def softmax_as_given(x, dim=None, _stacklevel=3, dtype=None):  # eager's softmax upcasts to float32 only
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    saved = mg.Gemma4RMSNorm.forward, mg.Gemma4TextRotaryEmbedding.forward
    mg.Gemma4RMSNorm.forward, mg.Gemma4TextRotaryEmbedding.forward = norm, rotary
    torch.nn.functional.softmax = softmax_as_given
    try:
        yield
    finally:
        mg.Gemma4RMSNorm.forward, mg.Gemma4TextRotaryEmbedding.forward = saved
        torch.nn.functional.softmax = softmax


def _qkv_float64(hf64):
    """qkv's model built and loaded in float64 (from_hf builds in the default dtype)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return from_hf(hf64, dtype=torch.float64, optimize=False)
    finally:
        torch.set_default_dtype(default)


def _exact_inv_freq(model):
    """HF computes inv_freq in float32: the reference's, in float64, from the config (plain RoPE on local layers;
    proportional on global ones: the first ``int(f * D / 2)`` of the head's ``D / 2`` frequencies turn)."""
    rot, cfg = model.model.rotary_emb, model.config
    for kind in rot.layer_types:
        params, dim = cfg.rope_parameters[kind], cfg.per_layer_config[kind].head_dim
        inv = params["rope_theta"] ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        if params["rope_type"] == "proportional":
            inv[int(params["partial_rotary_factor"] * dim // 2):] = 0.0
        setattr(rot, f"{kind}_inv_freq", inv)


@pytest.mark.parametrize("case", list(CASES))
def test_float64_logits_equal_hf(case):
    """Prefill, and a cached decode of the same tokens, within 1e-8 relative of HF's float64 eager logits."""
    _, ref, _ = _models(case)
    ref = copy.deepcopy(ref)
    _exact_inv_freq(ref)
    ours = _qkv_float64(ref)
    ids, _ = _prompt(case, padded=False)
    with torch.no_grad(), _hf_in_float64():
        truth = ref(ids).logits
    with torch.no_grad():
        full = ours(ids).logits
        cache = KVCache(ours.cache_specs())
        steps = [ours(ids[:, :9], cache=cache).logits]
        steps += [ours(ids[:, t:t + 1], cache=cache).logits for t in range(9, N_PROMPT)]
    rel = ((full - truth).norm() / truth.norm()).item()
    assert rel < 1e-8, f"{case}: relative logit error {rel:.2e}"
    cached = torch.cat(steps, dim=1)
    assert ((cached - truth).norm() / truth.norm()).item() < 1e-8
    assert truth.std() > 0.5


def test_layout_and_switches_reach_the_model():
    """Per-type head shapes, K = V (no value rows), shared layers (queries only), double-wide MLP, per-layer inputs."""
    e2b = _models("e2b-ple-shared3-wide-softcap")[2]
    c = e2b.config
    assert c.kv_shared_from == (None, None, None, None, 1, 3, 1)
    specs = e2b.cache_specs()
    assert specs[:4] == [SlidingWindowSpec(5, 2, 16), FullSpec(2, 32), SlidingWindowSpec(5, 2, 16),
                         SlidingWindowSpec(5, 2, 16)]
    assert specs[4:] == [SharedSpec(1, None, 2, 32), SharedSpec(3, 5, 2, 16), SharedSpec(1, None, 2, 32)]
    assert e2b.layers[4].self_attn.qkv_proj.weight.shape == (4 * 32, 64) and e2b.layers[4].self_attn.k_norm is None
    assert e2b.layers[4].mlp.down_proj.weight.shape == (64, 192)
    assert e2b.layers[3].mlp.down_proj.weight.shape == (64, 96)
    assert e2b.embed_per_layer.embed.weight.shape == (160, 7 * 8)
    big = _models("31b-keqv-Hkv1-untied")[2]
    assert big.config.layer_types == (_S,) * 5 + (_F,)
    assert big.layers[5].self_attn.qkv_proj.weight.shape == ((4 + 1) * 32, 64)  # q and k only: K = V
    assert big.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    assert big.embed_per_layer is None and big.lm_head is not None


def test_shared_layers_allocate_nothing_and_pools_are_counted_once():
    model = _models("e2b-ple-shared3-wide-softcap")[2]
    ids, _ = _prompt("e2b-ple-shared3-wide-softcap", padded=False)
    cache = KVCache(model.cache_specs())
    with torch.no_grad():
        model(ids, cache=cache)
    mem = cache.memory()
    assert [m.kind for m in mem.layers[4:]] == ["shared"] * 3
    assert all(m.allocated_bytes == 0 for m in mem.layers[4:])
    assert cache.layer_tokens(4) == cache.layer_tokens(1) == N_PROMPT
    plan = plan_memory(model, batch=2, context=N_PROMPT, dtype=torch.float32)
    assert [round(layer.allocated_bytes) for layer in plan.layers] == [m.allocated_bytes for m in mem.layers]
    unshared = [FullSpec(2, 32) if isinstance(s, SharedSpec) and s.window is None else
                SlidingWindowSpec(5, 2, 16) if isinstance(s, SharedSpec) else s for s in model.cache_specs()]
    alone = plan_memory(unshared, batch=2, context=N_PROMPT, dtype=torch.float32)
    assert plan.allocated_bytes < alone.allocated_bytes


@pytest.mark.parametrize("storage", ["dynamic", "static", "paged"])
def test_verify_cache_through_shared_layers(storage):
    """Cached decoding equals recomputation through shared layers: decode, crop, fork and (paged) prefix reuse."""
    from qkv.models import verify_cache

    model = _models("all-keqv-shared2-ple")[2]
    make = {"dynamic": lambda: KVCache(model, rollback=4),
            "static": lambda: KVCache(model, storage=Static(64), rollback=4),
            "paged": lambda: KVCache(model, storage=Paged(block_size=4, num_blocks=128, prefix_caching=True))}[storage]
    report = verify_cache(model, make)
    assert report.ok, str(report)


def test_left_padded_generation_with_paged_cache_matches_hf():
    case = "all-keqv-shared2-ple"
    ids, mask = _prompt(case, padded=True)
    suite = TestHFParity()
    model = _models(case)[2]
    suite.generation_cache = lambda c, m: KVCache(m.cache_specs(), storage=Paged(block_size=4, num_blocks=64))
    suite.generates_hf_tokens(case, ids, mask)
    assert model.config.kv_shared_from[-2:] == (1, 1)


def test_multimodal_gemma4_reads_its_language_model(tmp_path):
    """``gemma4`` (vision/audio towers absent here): from_hf reads the language model, in memory and from a folder."""
    transformers = pytest.importorskip("transformers")
    text = {**_BASE, **CASES["e2b-ple-shared3-wide-softcap"]}
    cfg = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    ids, _ = _prompt("e2b-ple-shared3-wide-softcap", padded=False)
    with torch.no_grad():
        truth = hf(input_ids=ids).logits
        ours = from_hf(hf)(ids).logits
        hf.save_pretrained(tmp_path)
        again = from_hf(tmp_path)(ids).logits
    assert torch.allclose(ours, truth, atol=1e-4, rtol=1e-4)
    assert torch.equal(again, ours)


def test_proportional_rope_matches_hf_frequencies():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from qkv.pos import RotaryEmbedding

    hf = _models("e2b-ple-shared3-wide-softcap")[0]
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](hf.config.per_layer_config[_F], None, layer_type=_F)
    emb = RotaryEmbedding(32, theta=1e6, partial_rotary_factor=0.25, scaling={"rope_type": "proportional"})
    got = emb.inv_freq()
    assert got.shape == (16,) and torch.equal(got[4:], torch.zeros(12))
    assert torch.allclose(got.float(), want, rtol=1e-6, atol=0)


def _decoder(**changes):
    from qkv.nn import DecoderConfig

    kw = dict(vocab_size=32, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, sliding_window=4, layer_types=(_S, _F, _S, _F))
    return DecoderConfig(**{**kw, **changes})


@pytest.mark.parametrize("changes, match", [
    ({"kv_shared_from": (None, None, 3, None)}, "earlier layer"),
    ({"kv_shared_from": (None, None, None, 2)}, "of its own type"),
    ({"kv_shared_from": (None, 0, 1, None), "layer_types": (_S,) * 4}, "itself shared"),
    ({"kv_shared_from": (None, None)}, "2 entries for 4 layers"),
    ({"head_dim_by_type": {"linear_attention": 8}}, "head_dim_by_type"),
    ({"kv_heads_by_type": {_F: 3}}, "multiple"),
    ({"k_eq_v_types": ("bogus",)}, "k_eq_v_types"),
    ({"intermediate_sizes": (64, 64)}, "intermediate_sizes"),
], ids=["forward", "other-type", "chain", "length", "type", "kv-heads", "keqv-type", "widths"])
def test_bad_decoder_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        _decoder(**changes)


@pytest.mark.parametrize("specs, match", [
    ([FullSpec(2, 8), SharedSpec(1, None, 2, 8)], "not an earlier layer"),
    ([SlidingWindowSpec(4, 2, 8), SharedSpec(0, None, 2, 8)], "same window"),
    ([FullSpec(2, 8), SharedSpec(0, None, 1, 8)], "same window, KV heads"),
    ([FullSpec(2, 8, 4), SharedSpec(0, None, 2, 8)], "head width"),
], ids=["forward", "window", "heads", "value-width"])
def test_bad_shared_specs_are_refused(specs, match):
    with pytest.raises(ValueError, match=match):
        KVCache(specs)


def test_shared_cache_refuses_policies_and_writes():
    specs = [FullSpec(2, 8), SharedSpec(0, None, 2, 8)]
    with pytest.raises(ValueError, match="policy"):
        KVCache(specs, policy=StreamingLLM(n_sink=1, window=4))
    cache = KVCache(specs)
    with pytest.raises(ValueError, match="SharedSpec layer stores nothing"):
        cache.update(1, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), positions=torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.parametrize("change, match", [
    ({"enable_moe_block": True, "num_experts": None}, "num_experts"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8},
     "num_experts_per_tok"),
    ({"use_bidirectional_attention": "all"}, "bidirectional"),
    ({"num_kv_shared_layers": 6}, "no earlier layer"),
], ids=["moe-without-experts", "moe-top-k-over-experts", "bidirectional", "all-shared"])
def test_unsupported_gemma4_configs_fail_clearly(change, match):
    from qkv.models.family_gemma4 import decoder_config

    cfg = {**_models("31b-keqv-Hkv1-untied")[0].config.to_dict(), **change}
    with pytest.raises(CheckpointError, match=match):
        decoder_config(cfg)


def test_engine_serves_shared_layers():
    """Five requests through two paged rows (prompts read in chunks of 5 beside decoding rows): each request's
    tokens are ``generate``'s on it alone, and every block comes back."""
    from qkv.models import Engine, generate

    model = _models("all-keqv-shared2-ple")[2]
    engine = Engine(model, num_blocks=96, block_size=4, max_batch=2, prefill_chunk=5)
    free = {k: s.blocks_free for k, s in engine.cache.pool_stats().items()}
    gen = torch.Generator().manual_seed(5)
    common = torch.randint(1, 160, (8,), generator=gen).tolist()
    reqs = [(common + torch.randint(1, 160, (n,), generator=gen).tolist(), b) for n, b in ((3, 6), (5, 4), (1, 7),
                                                                                          (6, 5), (2, 6))]
    ids = [engine.add(p, b) for p, b in reqs]
    results = engine.run()
    for rid, (p, b) in zip(ids, reqs):
        assert results[rid].tokens == generate(model, torch.tensor([p]), max_new_tokens=b).new_tokens[0].tolist()
    assert {k: s.blocks_free for k, s in engine.cache.pool_stats().items()} == free


@pytest.mark.parametrize("case", sorted(CASES))
def test_cost_arithmetic_counts_the_built_model(case):
    """qkv.costs counts Gemma 4's per-layer shapes: the parameter count equals the built model's (and HF's), and one
    token's FLOPs are two per weight of the built projections and feed-forwards, plus 4 Hq D_i per attended pair
    (a uniform head shape, what the arithmetic took before, fails all three)."""
    from qkv.costs import forward_flops, num_parameters

    hf, _, model = _models(case)
    c = model.config
    built = sum(p.numel() for p in model.parameters())
    assert num_parameters(c).total == built == sum(p.numel() for p in hf.parameters())
    layers = model.layers

    def weights(part):
        linear = sum(m.weight.numel() for layer in layers for m in getattr(layer, part).modules()
                     if isinstance(m, torch.nn.Linear))
        if part == "mlp" and c.moe is not None:  # the top-k of the stacked experts (26B-A4B), beside the dense MLP
            experts = [layer.mlp.experts for layer in layers]
            linear += sum((e.gate_up_proj.numel() + e.down_proj.numel()) * c.moe.num_experts_per_tok
                          // c.moe.n_routed_experts for e in experts)
        return linear

    proj, ffn = weights("self_attn"), weights("mlp")
    pairs = sum(3 * 4 * layer.self_attn.o_proj.in_features for layer in layers)  # 3 keys (inside every window)
    f = forward_flops(c, 1, 3)  # one token decoded after two
    assert (f.projections, f.ffn, f.attention) == (2 * proj, 2 * ffn, pairs)
    assert len({layer.self_attn.o_proj.in_features for layer in layers}) == 2  # per-type head widths are exercised


@pytest.mark.parametrize("case", sorted(CASES))
def test_kv_cache_memory_counts_each_pool_once(case):
    """qkv.costs.kv_cache_memory of a Gemma 4 description equals the planner on the built model's cache specs:
    per-type KV heads and head widths, windows, and shared layers costing nothing."""
    from qkv.costs import ModelPreset, kv_cache_memory, num_parameters, preset_from_hf_config

    hf, _, model = _models(case)
    from_dict = preset_from_hf_config(hf.config.to_dict())  # what `qkv memory config.json` reads
    assert num_parameters(from_dict).total == sum(p.numel() for p in model.parameters())
    for context in (3, 40):
        plan = plan_memory(model, batch=2, context=context, dtype=torch.float32)
        for preset in (ModelPreset.from_config(model.config), from_dict):
            est = kv_cache_memory(preset, context=context, batch=2, dtype="fp32")
            assert est.total_bytes == round(plan.needed_bytes) > 0
        shared = sum(g.num_layers for g in est.layers if g.kind == "shared")
        assert shared == sum(s is not None for s in (model.config.kv_shared_from or ()))


def test_model_attention_flops_use_each_type_head_width():
    """Global layers twice as wide as local ones: the attention FLOPs sum each layer at its own width and window."""
    from qkv.costs import ModelPreset, attention_flops, model_attention_flops

    c = _models("31b-keqv-Hkv1-untied")[2].config
    f = model_attention_flops(ModelPreset.from_config(c), context=40)
    want = sum(attention_flops(1, c.num_attention_heads, 40, 40, c.head_dim_for(i), causal=True, window=c.window_for(i))
               for i in range(c.num_hidden_layers))
    assert f.prefill == want
    assert len({c.head_dim_for(i) for i in range(c.num_hidden_layers)}) == 2


@pytest.mark.parametrize("n_layers", [12, 18, 30])
def test_layout_reads_the_same_from_config_json_and_to_dict(n_layers):
    """``to_dict()`` states the global layers' head width per layer, keyed by zero-padded indices once a model has 10
    layers or more ('05' of 12); both forms of a config give the same per-type shapes and sharing."""
    import transformers

    from qkv.config.hf_config import read_layout

    cfg = transformers.Gemma4TextConfig(**{**_BASE, "num_hidden_layers": n_layers, "num_key_value_heads": 1,
                                           "head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
                                           "num_kv_shared_layers": 4})
    as_dict = cfg.to_dict()
    json_form = {k: v for k, v in as_dict.items() if k != "per_layer_config"}
    json_form.update(head_dim=16, global_head_dim=32)
    a, b = read_layout(as_dict), read_layout(json_form)
    assert a.head_dim_by_type == b.head_dim_by_type == {_F: 32}
    assert a.kv_shared_from == b.kv_shared_from and a.kv_shared_from[-1] is not None
