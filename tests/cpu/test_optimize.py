"""qkv.cpu.optimize: CPU products applied to a plain model from outside. The model builds plain nn.Linear
layers; optimize swaps in the rule's products (row blocks, oneDNN, F.linear) for every layer, the LM head
(untied and tied), the MoE experts and a FeedForward's fused activation; logits stay within the float64
error budget for prefill and decode, gradients are F.linear's, state_dict() keeps its names and values, a
second call changes nothing, and from_hf / generate call it by default (once), with an opt-out."""

from __future__ import annotations

import copy
import importlib
import pickle

import pytest
import torch
import torch.nn.functional as F

import qkv.cpu
from qkv.cache import KVCache
from qkv.cpu import LinearProducts, Optimized, PrepackedLinear, optimize, optimized
from qkv.cpu import gemm as gemm_module
from qkv.nn import DecoderConfig, DecoderLM, FeedForward
from qkv.nn.moe import Experts, MoEConfig
from qkv.testing import assert_within_budget

# widths where the rule takes every path at two threads: 2048 outputs of K = 64 ("short"), narrow ones too
BASE = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=1024)
CONFIGS = {
    "untied-gated": DecoderConfig(**BASE, tie_word_embeddings=False),
    "tied-gelu-ffn": DecoderConfig(**BASE, tie_word_embeddings=True, gated_mlp=False, hidden_act="gelu_tanh"),
    "moe": DecoderConfig(**BASE, tie_word_embeddings=True, moe=MoEConfig(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=1024, n_shared_experts=1)),
}


def _model(name: str) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(CONFIGS[name]).eval()


def _spy(monkeypatch, module, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_model_builds_plain_modules():
    for name in CONFIGS:
        model = _model(name)
        assert optimized(model) is None
        kinds = {type(m).__name__ for m in model.modules()}
        assert not kinds & {"PrepackedLinear", "SkinnyLinear", "InputMajorLinear"}, kinds
        assert model.linear_fn is F.linear
        assert all(p.is_contiguous() for p in model.parameters())


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_optimize_keeps_state_and_logits(two_threads, monkeypatch, name, stream, row_block_table):
    """Same state_dict (names, the same tensors), logits within budget of float64 for prefills and for a
    one-row and an 8-row decode step, through the weight-streaming kernel (one row, where it is built), row blocks
    (a table that takes them, the streaming kernel switched off) and (where it runs) oneDNN."""
    if not stream:
        monkeypatch.setattr(gemm_module, "_STREAMED_ROWS", {})
    elif qkv.cpu.ops.unavailable_reason() is not None:
        pytest.skip(f"the compiled kernels are off: {qkv.cpu.ops.unavailable_reason()}")
    model = _model(name)
    ref = copy.deepcopy(model).double()
    plain = copy.deepcopy(model)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert optimize(model) is model
    state = model.state_dict()
    assert list(state) == list(before) and all(state[k].data_ptr() == p for k, p in before.items())
    assert all(t.is_contiguous() for t in state.values())
    blocks, packed = _spy(monkeypatch, gemm_module, "rows_linear"), _spy(monkeypatch, gemm_module, "_pointwise")
    streamed = _spy(monkeypatch, qkv.cpu.ops, "weight_linear")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (8, 10), generator=g)
    with torch.inference_mode():
        for rows in (1, 8):  # a prefill of `rows` sequences (9 or 72 rows), then one decode step (1 or 8 rows)
            models = (model, ref, plain)
            caches = [KVCache(m.cache_specs()) for m in models]
            got, want, base = (m(ids[:rows, :9], cache=c).logits for m, c in zip(models, caches))
            assert_within_budget(got, want, base, what=f"{name} prefill of {rows} sequences")
            got, want, base = (m(ids[:rows, 9:], cache=c).logits for m, c in zip(models, caches))
            assert_within_budget(got, want, base, what=f"{name} decode step of {rows} rows")
    if stream:
        assert streamed, "a one-row step of float32 weights streams them through qkv_cpu::weight_linear"
    else:
        assert blocks and not streamed, "a one-row step of 2048-output weights takes row blocks at two threads"
    assert packed or not qkv.cpu.onednn_available(), "many-row products take oneDNN where it runs"


def test_optimize_reaches_head_experts_and_activation():
    untied, tied, moe = (optimize(_model(n)) for n in ("untied-gated", "tied-gelu-ffn", "moe"))
    assert type(untied.lm_head) is PrepackedLinear and untied.linear_fn is not F.linear
    assert isinstance(tied.linear_fn, LinearProducts)  # the tied head multiplies by the embedding
    experts = [m for m in moe.modules() if isinstance(m, Experts)]
    assert experts and all(isinstance(e.linear_fn, LinearProducts) for e in experts)
    ffns = [m for m in tied.modules() if isinstance(m, FeedForward)]
    assert ffns and all(type(f.up_proj) is PrepackedLinear for f in ffns)
    if qkv.cpu.onednn_available():  # the tanh-GELU moved into the up projection's oneDNN GEMM
        assert all(f.up_activation is None and f.up_proj.activation is not None for f in ffns)
    assert all(type(m) is not torch.nn.Linear for m in moe.modules())


def test_optimize_is_idempotent_and_marks_the_model():
    model = optimize(_model("moe"))
    modules = dict(model.named_modules())
    fns = {n: m.linear_fn for n, m in modules.items() if isinstance(m, qkv.cpu.LinearHost)}
    mark = optimized(model)
    screened = qkv.cpu.greedy.screen_unavailable_reason() is None  # the DecoderLM's greedy head
    assert mark == Optimized(onednn=qkv.cpu.onednn_available(), input_major=None, screen=screened)
    assert optimize(model) is model
    assert dict(model.named_modules()) == modules, "a second call swaps nothing"
    assert {n: m.linear_fn for n, m in model.named_modules() if isinstance(m, qkv.cpu.LinearHost)} == fns
    assert optimized(model) == mark
    optimize(model, onednn=False)  # new options are applied
    assert optimized(model) == Optimized(onednn=False, input_major=None, screen=screened)
    assert all(not m.pack for m in model.modules() if isinstance(m, PrepackedLinear))


def test_gradients_are_f_linear_s():
    plain, model = _model("tied-gelu-ffn"), optimize(_model("tied-gelu-ffn"))
    model.train()
    plain.train()
    ids = torch.randint(0, 2048, (2, 7), generator=torch.Generator().manual_seed(2))
    for m in (plain, model):
        m(ids).logits.logsumexp(-1).sum().backward()
    for (n, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), f"{n}: gradients differ"


def test_input_major_round_trip_and_bare_linear():
    model = _model("untied-gated")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    optimize(model, input_major=True)
    qkv_proj = model.layers[0].self_attn.qkv_proj
    assert qkv_proj.weight.t().is_contiguous() and not qkv_proj.weight.is_contiguous()
    assert model.layers[0].mlp.down_proj.weight.is_contiguous()  # fewer outputs than inputs: standard
    state = model.state_dict()
    assert all(t.is_contiguous() and torch.equal(t, want[k]) for k, t in state.items())
    optimize(model)  # the default keeps layouts: nothing moves (generate's call replaces no parameter)
    assert model.layers[0].self_attn.qkv_proj.weight is qkv_proj.weight
    optimize(model, input_major=False)  # back to the standard layout, same values
    assert all(p.is_contiguous() for p in model.parameters())
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    lin = torch.nn.Linear(8, 4)
    fast = optimize(lin)
    assert type(fast) is PrepackedLinear and fast.weight is lin.weight and fast.bias is lin.bias


def test_expert_slices_are_packed_once_and_follow_writes():
    if not qkv.cpu.onednn_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    stacked = torch.randn(3, 2048, 64)
    products = LinearProducts()
    x = torch.randn(16, 64)
    with torch.no_grad():
        for e in (0, 1, 0, 1):
            torch.testing.assert_close(products(x, stacked[e]), F.linear(x, stacked[e]), rtol=1e-5, atol=1e-4)
        slots = products._packs._by_base[stacked]
        assert len(slots) == 2, "one packed copy per expert slice, not per call"
        stacked[1].mul_(-1)  # an in-place write: the version counter moves
        torch.testing.assert_close(products(x, stacked[1]), F.linear(x, stacked[1]), rtol=1e-5, atol=1e-4)
    restored = pickle.loads(pickle.dumps(products))
    assert restored.pack and copy.deepcopy(products).pack


def test_a_users_linear_fn_is_kept():
    model = _model("moe")
    experts = next(m for m in model.modules() if isinstance(m, Experts))

    def mine(x, w, b=None):
        return F.linear(x, w, b)

    experts.linear_fn = mine
    optimize(model)
    assert experts.linear_fn is mine and isinstance(model.linear_fn, LinearProducts)


def test_copies_and_pickles_compute_the_same():
    model = optimize(_model("tied-gelu-ffn"))
    ids = torch.randint(0, 2048, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model(ids).logits
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert optimized(other) == optimized(model)
            torch.testing.assert_close(other(ids).logits, want)


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="optimize: model must be a torch.nn.Module, got str"):
        optimize("model")
    with pytest.raises(TypeError, match="optimize: onednn must be None"):
        optimize(torch.nn.Linear(2, 2), onednn="yes")
    with pytest.raises(TypeError, match="optimize: onednn must be None"):
        optimize(torch.nn.Linear(2, 2), onednn=1)
    with pytest.raises(TypeError, match="optimize: input_major must be None"):
        optimize(torch.nn.Linear(2, 2), input_major=1)
    from qkv.models import from_hf, generate

    with pytest.raises(TypeError, match="from_hf: optimize must be True or False"):
        from_hf("no/such/checkpoint", optimize="no")
    with pytest.raises(TypeError, match="generate: optimize must be True or False"):
        generate(_model("untied-gated"), torch.zeros(1, 3, dtype=torch.long), max_new_tokens=1, optimize=None)


def test_generate_optimizes_once_and_can_opt_out(monkeypatch):
    gen = importlib.import_module("qkv.models.generate")  # the module (qkv.models.generate is the function)

    calls = _spy(monkeypatch, gen, "cpu_optimize")
    model = _model("untied-gated")
    ids = torch.randint(0, 2048, (2, 5), generator=torch.Generator().manual_seed(4))
    plain = gen.generate(model, ids, max_new_tokens=3, optimize=False)
    assert calls == [] and optimized(model) is None
    fast = gen.generate(model, ids, max_new_tokens=3)
    gen.generate(model, ids, max_new_tokens=3)
    assert calls == [1] and optimized(model) is not None
    assert torch.equal(plain.new_tokens, fast.new_tokens)


def test_from_hf_optimizes_by_default():
    transformers = pytest.importorskip("transformers", reason="from_hf of an in-memory HF model needs transformers")
    from qkv.models import from_hf

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    fast, plain = from_hf(hf), from_hf(hf, optimize=False)
    assert optimized(fast) is not None and optimized(plain) is None
    assert any(isinstance(m, PrepackedLinear) for m in fast.modules())
    assert not any(isinstance(m, PrepackedLinear) for m in plain.modules())
    assert list(fast.state_dict()) == list(plain.state_dict())
