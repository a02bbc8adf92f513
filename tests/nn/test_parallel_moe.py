"""Gemma 4's experts beside the dense MLP (qkv.nn.parallel_moe.ParallelMoE): against a float64 definition written
here from the model card's description (independent of qkv's routing and experts code), forward and backward;
bad configs and inputs refused. HF parity of whole models is in tests/models/test_gemma4.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.nn.moe import MoEConfig
from qkv.nn.parallel_moe import ParallelMoE

D, WIDTH, E, K, F_E = 12, 20, 6, 2, 8


def _config(**changes) -> MoEConfig:
    return MoEConfig(**{**dict(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_E,
                               norm_topk_prob=True, beside_dense=True), **changes})


def _block(seed: int = 0) -> ParallelMoE:
    torch.manual_seed(seed)
    block = ParallelMoE(D, WIDTH, _config(), activation="gelu_pytorch_tanh").double()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name or "scale" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, dtype=torch.float64))
            else:
                p.copy_(torch.randn(p.shape, dtype=torch.float64) / math.sqrt(p.shape[-1]))
    return block


def _reference(block: ParallelMoE, x: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    def rms(v, w=None):
        v = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return v if w is None else v * w

    def gelu_glu(v, up, down):
        g, u = (v @ up.T).chunk(2, dim=-1)
        return (F.gelu(g, approximate="tanh") * u) @ down.T

    p = dict(block.named_parameters())
    dense = rms(gelu_glu(x, p["mlp.gate_up_proj.weight"], p["mlp.down_proj.weight"]), p["dense_out_norm.weight"])
    out = []
    for t in range(raw.shape[0]):
        logits = rms(raw[t], p["router_scale"]) / math.sqrt(D) @ p["router.weight"].T
        probs = logits.softmax(-1)
        top = sorted(range(E), key=lambda e: -float(probs[e].detach()))[:K]
        total = sum(probs[e] for e in top)
        h = rms(raw[t], p["experts_norm.weight"])
        y = sum(probs[e] / total * p["per_expert_scale"][e]
                * gelu_glu(h, p["experts.gate_up_proj"][e], p["experts.down_proj"][e]) for e in top)
        out.append(rms(y, p["experts_out_norm.weight"]))
    return dense + torch.stack(out)


def test_forward_and_backward_equal_the_float64_definition():
    block = _block()
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(7, D, dtype=torch.float64, generator=gen, requires_grad=True)
    x = (1.5 * raw).detach().requires_grad_()
    ours = block(x, raw)
    ref = _reference(block, x, raw)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn(ours.shape, dtype=torch.float64, generator=gen)
    grads = torch.autograd.grad(ours, [x, raw, *block.parameters()], g)
    ref_grads = torch.autograd.grad(ref, [x, raw, *block.parameters()], g, allow_unused=True)
    for name, a, b in zip(["x", "raw", *dict(block.named_parameters())], grads, ref_grads):
        b = torch.zeros_like(a) if b is None else b
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name


def test_batched_shapes_and_one_token_steps_agree():
    """(B, N, d) in, the same out; each token alone gives its row of the batch (routing is per token)."""
    block = _block(3)
    raw = torch.randn(2, 5, D, dtype=torch.float64)
    x = raw * 0.5
    whole = block(x, raw)
    assert whole.shape == (2, 5, D)
    for b in range(2):
        for n in range(5):
            one = block(x[b:b + 1, n:n + 1], raw[b:b + 1, n:n + 1])
            assert torch.allclose(one[0, 0], whole[b, n], rtol=1e-13, atol=1e-13)


def test_float32_runs_within_the_budget():
    block = _block(4)
    raw = torch.randn(9, D, dtype=torch.float64)
    ref = block(raw, raw)
    ours = block.float()(raw.float(), raw.float()).double()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-5


def test_nan_input_reaches_the_output():
    """A NaN in a token's residual makes that token's output NaN; the other tokens keep theirs (to a rounding: the
    NaN token's experts change the order in which each expert's rows are summed)."""
    block = _block(5)
    raw = torch.randn(4, D, dtype=torch.float64)
    clean = block(raw, raw)
    raw[2, 3] = float("nan")
    out = block(raw, raw)
    assert out[2].isnan().any()
    assert torch.allclose(out[[0, 1, 3]], clean[[0, 1, 3]], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("changes, match", [
    ({"n_shared_experts": 1}, "beside_dense"),
    ({"topk_method": "topk_softmax"}, "beside_dense"),
    ({"router_bias": True}, "beside_dense"),
])
def test_bad_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        _config(**changes)


def test_bad_module_arguments_are_refused():
    with pytest.raises(ValueError, match="beside_dense must be True"):
        ParallelMoE(D, WIDTH, _config(beside_dense=False), activation="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="activation"):
        ParallelMoE(D, WIDTH, _config(), activation="no-such-activation")
    block = _block()
    with pytest.raises(ValueError, match="one shape"):
        block(torch.zeros(2, D, dtype=torch.float64), torch.zeros(3, D, dtype=torch.float64))
