"""qkv.cpu.gemm: the oneDNN packed linear equals F.linear (float64 reference, error budget), is used only
for float32 CPU inference where the product rule takes it, follows in-place weight changes, and use_onednn
(optimize with oneDNN required) swaps layers without changing parameters."""

from __future__ import annotations

from copy import deepcopy as copy_module

import pytest
import torch
import torch.nn.functional as F

from qkv.cpu import gemm, use_onednn
from qkv.cpu.gemm import LinearProducts, PrepackedLinear, PrepackedWeight, onednn_available, prepacked_linear
from qkv.testing import assert_within_budget

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN packed linear")


@pytest.mark.parametrize("lead", [(1,), (5,), (2, 33), (1, 700)])
@pytest.mark.parametrize("n_in,n_out", [(48, 96), (384, 1536), (1536, 384)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(lead, n_in, n_out, bias):
    g = torch.Generator().manual_seed(n_in + n_out + len(lead))
    x = torch.randn(*lead, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
    b = torch.randn(n_out, generator=g) if bias else None
    with torch.inference_mode():
        got = prepacked_linear(x, w, b, PrepackedWeight())
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert_within_budget(got, ref, F.linear(x, w, b), what="prepacked_linear")


def test_path_taken_only_for_float32_inference(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *a):
            calls.append(1)
            return real(*a)

    monkeypatch.setattr(gemm, "_pointwise", Spy())
    lin = PrepackedLinear.from_linear(torch.nn.Linear(16, 32))
    x = torch.randn(8, 16)  # 8 rows: the rule's oneDNN path (tests/test_cpu_rule.py checks the rule itself)
    with torch.no_grad():
        lin(x[:2])  # 2 rows of a narrow weight: F.linear
        assert calls == []
        lin(x)
    assert calls == [1]
    lin(x).sum().backward()  # recording gradients: F.linear, and the gradient arrives
    assert calls == [1] and lin.weight.grad is not None
    with torch.no_grad():
        lin.double()(x.double())  # float64: F.linear
    assert calls == [1]


def test_follows_in_place_weight_changes():
    lin = PrepackedLinear.from_linear(torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2.0)
        lin.bias.zero_()
        after = lin(x)
    torch.testing.assert_close(after, F.linear(x, lin.weight.detach()), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_use_onednn_swaps_layers_and_keeps_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    names = {k: v for k, v in model.state_dict().items()}
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = model(x)
        use_onednn(model)
        got = model(x)
    assert all(type(m) is PrepackedLinear for m in (model[0], model[2]))
    assert model.state_dict().keys() == names.keys()
    assert all(model.state_dict()[k].data_ptr() == v.data_ptr() for k, v in names.items())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unavailable_is_an_error(monkeypatch):
    monkeypatch.setattr(gemm, "onednn_unavailable_reason", lambda: "no oneDNN in this build")
    with pytest.raises(RuntimeError, match="use_onednn: no oneDNN in this build; qkv.cpu.optimize"):
        use_onednn(torch.nn.Linear(2, 2))


def test_copies_and_pickles_repack():
    import copy
    import pickle

    lin = PrepackedLinear.from_linear(torch.nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = lin(x)  # packs
        for other in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
            torch.testing.assert_close(other(x), want)


def test_decoder_with_onednn_matches_and_decodes_the_same():
    """use_onednn on a DecoderLM (fused QKV and gate/up input-major, untied LM head and a tied one): the
    same logits within budget for prefill and a batched decode step, the same greedy tokens."""
    from qkv.cache import KVCache
    from qkv.models.generate import generate
    from qkv.nn import DecoderConfig, DecoderLM

    for tied in (False, True):
        cfg = DecoderConfig(vocab_size=600, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=tied)
        torch.manual_seed(0)
        plain = DecoderLM(cfg).eval()
        fast = use_onednn(copy_module(plain))
        ref = copy_module(plain).double()
        ids = torch.randint(0, 600, (3, 9))
        with torch.inference_mode():
            want, got, base = ref(ids).logits, fast(ids).logits, plain(ids).logits
            assert_within_budget(got, want, base, what=f"prefill logits (tied={tied})")
            a = generate(plain, ids, max_new_tokens=6, cache=KVCache(plain.cache_specs()), optimize=False)
            b = generate(fast, ids, max_new_tokens=6, cache=KVCache(fast.cache_specs()))
        assert torch.equal(a.new_tokens, b.new_tokens)
        assert not any(isinstance(m, PrepackedLinear) for m in plain.modules()), "optimize=False left it plain"
        assert any(isinstance(m, PrepackedLinear) for m in fast.modules())
        assert isinstance(fast.linear_fn, LinearProducts) and fast.linear_fn.pack


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "swiglu"])
def test_feed_forward_with_fused_activation(activation):
    from qkv.nn import FeedForward

    torch.manual_seed(1)
    ffn = FeedForward(32, 96, activation=activation).eval()
    ref = copy_module(ffn).double()
    fast = use_onednn(copy_module(ffn))
    fused = activation != "swiglu"
    assert (fast.up_proj.activation is not None) == fused  # gated: the activation is on the gate, not fused
    assert fast.up_activation is None and (ffn.up_activation is None) == (not fused)
    x = torch.randn(2, 40, 32)
    with torch.inference_mode():
        assert_within_budget(fast(x), ref(x.double()), ffn(x), what=f"FeedForward({activation})")
    fast(x).sum().backward()  # with gradients: the eager path, and they arrive
    assert fast.up_proj.weight.grad is not None
    for bad in (F.silu, "silu"):
        with pytest.raises(ValueError, match="activation must compute ReLU, GELU or tanh-approximated GELU"):
            prepacked_linear(x, fast.up_proj.weight, None, PrepackedWeight(), bad)


def test_strided_inputs():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 16, generator=g), torch.randn(40, generator=g)
    for x in (torch.randn(3, 7, 16, generator=g)[:, -2:], torch.randn(16, 5, generator=g).t()):
        with torch.inference_mode():
            got = prepacked_linear(x, w, b, PrepackedWeight())
        ref = F.linear(x.double(), w.double(), b.double())
        assert_within_budget(got, ref, F.linear(x, w, b), what=f"strides {x.stride()}")


def test_another_tensor_is_repacked_even_at_the_same_address():
    """The packed copy follows the tensor object, not its address: a freed weight's storage can be
    handed to the next one (the fused QKV of a BERT layer is rebuilt that way)."""
    x = torch.randn(3, 8)
    packed = PrepackedWeight()
    with torch.inference_mode():
        w1 = torch.randn(16, 8)
        prepacked_linear(x, w1, None, packed)
        w2 = w1.view(16, 8)  # another tensor object on the same storage and address, same shape
        w2_values = torch.randn(16, 8)
        w1.copy_(w2_values)  # an inference tensor: no version counter sees this write
        got = prepacked_linear(x, w2, None, packed)
    torch.testing.assert_close(got, F.linear(x, w2_values), rtol=1e-5, atol=1e-5)
