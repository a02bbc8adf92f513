"""The mixture-of-experts layer: the one-token path against the grouped path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.testing import assert_within_budget


def test_experts_single_token_path_equals_the_grouped_one():
    """The one-token path (a one-sequence decode step) against the grouped path that batches tokens per
    expert, run in float64 on all tokens at once (the reference), with the grouped float32 output as the
    baseline; the float64 grouped path itself equals a plain per-token loop over the chosen experts."""
    import copy

    import torch.nn.functional as F

    from qkv.nn.moe import Experts

    torch.manual_seed(0)
    experts = Experts(6, 16, 8, "silu")
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))  # unit scale: outputs O(1)
    ref = copy.deepcopy(experts).double()
    x = torch.randn(3, 16)
    idx = torch.tensor([[4, 1], [0, 4], [5, 2]])
    w = torch.rand(3, 2)

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:  # expert e's gated MLP in float64
        gate, up = F.linear(v, ref.gate_up_proj[e]).chunk(2)
        return F.linear(F.silu(gate) * up, ref.down_proj[e])

    with torch.no_grad():
        grouped = experts(x, idx, w)
        want = ref(x.double(), idx, w.double())
        loop = torch.stack([sum(w[t, j].double() * expert(e, x[t].double()) for j, e in enumerate(idx[t].tolist()))
                            for t in range(3)])
        torch.testing.assert_close(want, loop, rtol=1e-12, atol=1e-12)
        assert want.abs().max() > 0.1, "outputs must be O(1) for the budget to mean anything"
        for t in range(3):
            one = experts(x[t:t + 1], idx[t:t + 1], w[t:t + 1])[0]
            assert_within_budget(one, want[t], grouped[t], what=f"token {t}")


def _loop(experts, x, idx, w, monkeypatch):
    """The experts' own Python loop for one token (no compiled experts in its slot)."""
    with monkeypatch.context() as m:
        m.setattr(experts, "experts_kernel", None)
        return experts(x, idx, w)



@pytest.mark.parametrize("kind", ["silu", "clamped"])
@pytest.mark.parametrize("products", ["F.linear", "blocks", "blocks-unpacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("d,f", [(512, 256), (24, 40), (1024, 1030)])
def test_one_token_call_equals_the_loop_bit_for_bit(kind, products, dtype, d, f, monkeypatch):
    """qkv.cpu.fused.EXPERTS.one_token (one call of the compiled kernels: the same products and activation ops in
    the same order) equals the experts' Python loop exactly, for both expert kinds, F.linear and the CPU product
    rule's row blocks, float32 and float64, biases and clamping that bites (GPT-OSS)."""
    from qkv.cpu import kernels
    from qkv.cpu.fused import EXPERTS
    from qkv.cpu.gemm import LinearProducts
    from qkv.nn.moe import ClampedSwiGLUExperts, Experts

    one_token = EXPERTS.one_token

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    torch.manual_seed(1)
    experts = (Experts(8, d, f, "silu") if kind == "silu" else ClampedSwiGLUExperts(8, d, f, alpha=1.702, limit=7.0))
    experts = experts.to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * (20 / math.sqrt(p.shape[-1])))  # gates beyond the clamp limit
    if products != "F.linear":
        experts.linear_fn = LinearProducts(pack=products == "blocks")
    x, idx, w = torch.randn(1, d, dtype=dtype), torch.tensor([[6, 1, 3]]), torch.rand(1, 3)
    with torch.inference_mode():
        fused = one_token(experts, x, idx, w, clamped=kind == "clamped")
        loop = _loop(experts, x, idx, w, monkeypatch)
    assert fused is not None and fused.dtype == dtype
    assert torch.equal(fused, loop)
    if kind == "clamped":
        gate = F.linear(x, experts.gate_up_proj[1], experts.gate_up_proj_bias[1])[:, :f]
        assert (gate.abs() > 7.0).any(), "the clamp limit bites"


def test_one_token_call_declines_what_it_does_not_run(monkeypatch):
    """A gradient being recorded, a product function of the caller's own, or the kernels switched off: None,
    and the layer's loop runs (same result)."""
    from qkv.cpu import kernels
    from qkv.cpu.fused import EXPERTS
    from qkv.nn.moe import Experts

    one_token = EXPERTS.one_token
    torch.manual_seed(2)
    experts = Experts(4, 16, 8, "silu")
    x, idx, w = torch.randn(1, 16), torch.tensor([[3, 0]]), torch.rand(1, 2)
    assert one_token(experts, x, idx, w, clamped=False) is None  # parameters require grad, grad mode on
    with torch.inference_mode():
        want = _loop(experts, x, idx, w, monkeypatch)
        experts.linear_fn = lambda a, b, c=None: F.linear(a, b, c)
        assert one_token(experts, x, idx, w, clamped=False) is None
        experts.linear_fn = F.linear
        monkeypatch.setenv(kernels.ENV, "0")
        assert one_token(experts, x, idx, w, clamped=False) is None
        assert torch.equal(experts(x, idx, w), want)


@pytest.mark.parametrize("kind", ["silu", "clamped"])
@pytest.mark.parametrize("products", ["F.linear", "blocks", "blocks-unpacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("tokens", [2, 4, 7])
def test_grouped_tokens_call_equals_the_loop_bit_for_bit(kind, products, dtype, tokens, monkeypatch):
    """qkv.cpu.fused.EXPERTS.grouped (a few tokens' experts, grouped by expert, in one compiled call) equals the
    experts' Python loop exactly, or declines (None) where an expert's row count goes to oneDNN; the layer's
    output is the loop's either way."""
    from qkv.cpu import kernels
    from qkv.cpu.fused import EXPERTS
    from qkv.cpu.gemm import LinearProducts
    from qkv.nn.moe import ClampedSwiGLUExperts, Experts

    if kernels.load() is None:
        pytest.skip(f"qkv's CPU kernels: {kernels.unavailable_reason()}")
    torch.manual_seed(3)
    d, f = 64, 48
    experts = (Experts(8, d, f, "silu") if kind == "silu" else ClampedSwiGLUExperts(8, d, f, alpha=1.702, limit=7.0))
    experts = experts.to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * (20 / math.sqrt(p.shape[-1])))
    if products != "F.linear":
        experts.linear_fn = LinearProducts(pack=products == "blocks")
    x = torch.randn(tokens, d, dtype=dtype)
    others = torch.tensor([e for e in range(8) if e != 5])
    idx = torch.stack([torch.tensor([5, int(others[torch.randint(7, ())])]) for _ in range(tokens)])  # 5: every token's
    w = torch.rand(tokens, 2)
    calls = []

    class Spy:  # the compiled experts, each grouped call recorded
        def grouped(self, *a, **k):
            calls.append(r := EXPERTS.grouped(*a, **k))
            return r

    experts.experts_kernel = Spy()
    with torch.inference_mode():
        got = experts(x, idx, w)
        experts.experts_kernel = None
        loop = experts(x, idx, w)
    assert got.dtype == dtype and torch.equal(got, loop)
    if products == "F.linear" or dtype == torch.float64 or tokens <= 2:
        assert calls and calls[0] is not None, "this case takes the compiled call"
