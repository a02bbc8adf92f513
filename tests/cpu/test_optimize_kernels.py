"""``qkv.cpu.optimize`` puts qkv's compiled kernels into a plain model from outside: every kernel slot (RMSNorm,
SwiGLU's gate, rotary, routed experts, the gated-delta step and chunked rule) and the decode backend; a model it never
saw runs torch's ops alone (no ``qkv_cpu::`` operator in a profile); ``compiled=False`` takes them out again; the
optimized model's tokens equal the plain model's; ``qkv.explain`` names the decode step's compiled backend."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

import qkv
import qkv.cpu
from qkv import masks
from qkv.config.moe import MoEConfig
from qkv.cpu import fused, ops
from qkv.models.generate import generate
from qkv.nn import DecoderConfig, DecoderLM, GatedDeltaNet, LinearAttentionConfig, RMSNorm
from qkv.nn.gated_deltanet import GatedRMSNorm
from qkv.nn.moe import Experts

pytestmark = pytest.mark.xdist_group("cpu_kernels")

LIN = LinearAttentionConfig(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=8)


@pytest.fixture(autouse=True)
def _kernels():
    if ops.unavailable_reason() is not None:
        pytest.fail(f"the compiled kernels must build in the test environment: {ops.unavailable_reason()}")


def _model() -> DecoderLM:
    """A hybrid decoder: Gated DeltaNet and attention layers (RoPE, qk-norm), routed experts with SiLU gates."""
    torch.manual_seed(0)
    c = DecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48, layer_types=("linear_attention", "full_attention", "linear_attention"),
                      linear_attention=LIN, qk_norm=True,
                      moe=MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    n_shared_experts=1))
    lm = DecoderLM(c).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return lm


def _slots(model):
    found = {"norm_kernel": set(), "gate_kernel": set(), "rotary_kernel": set(), "experts_kernel": set(),
             "delta_kernel": set(), "decode_backend": set()}
    for m in model.modules():
        for slot in found:
            if slot in m.__dict__:
                found[slot].add(m.__dict__[slot])
    return found


def test_a_plain_model_holds_no_kernel():
    slots = _slots(_model())
    assert all(slots[s] == {None} for s in slots if s != "decode_backend"), slots
    assert slots["decode_backend"] == {"sdpa"}


def test_optimize_fills_every_slot_and_compiled_false_empties_them():
    model = _model()
    assert qkv.cpu.optimize(model, onednn=False) is model
    slots = _slots(model)
    assert slots == {"norm_kernel": {fused.rms_norm}, "gate_kernel": {fused.silu_gate},
                     "rotary_kernel": {fused.rotary}, "experts_kernel": {fused.EXPERTS},
                     "delta_kernel": {fused.DELTA}, "decode_backend": {"auto"}}
    assert any(isinstance(m, GatedRMSNorm) for m in model.modules())
    assert any(isinstance(m, GatedDeltaNet) for m in model.modules())
    assert any(isinstance(m, Experts) for m in model.modules())
    qkv.cpu.optimize(model, onednn=False)  # again: nothing changes
    assert _slots(model) == slots
    qkv.cpu.optimize(model, onednn=False, compiled=False)
    slots = _slots(model)
    assert all(slots[s] == {None} for s in slots if s != "decode_backend") and slots["decode_backend"] == {"sdpa"}


def test_a_slot_the_user_filled_is_kept():
    norm = RMSNorm(8)
    mine = lambda x, w, eps, offset: None  # noqa: E731
    norm.norm_kernel = mine
    qkv.cpu.optimize(norm)
    assert norm.norm_kernel is mine


def _qkv_ops(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("qkv_cpu::")}


def test_a_model_without_optimize_runs_torch_ops_and_an_optimized_one_the_kernels():
    model = _model()
    ids = torch.randint(0, 64, (2, 6))
    with torch.inference_mode():
        plain_ops = _qkv_ops(lambda: generate(model, ids, max_new_tokens=3, optimize=False))
        plain = generate(model, ids, max_new_tokens=3, optimize=False).new_tokens
        fast = generate(model, ids, max_new_tokens=3).new_tokens  # generate optimizes by default
        fast_ops = _qkv_ops(lambda: generate(model, ids, max_new_tokens=3))
        fast_ops |= _qkv_ops(lambda: generate(model, ids[:1], max_new_tokens=2))  # one token's experts
    assert plain_ops == set(), f"a plain model called compiled kernels: {plain_ops}"
    want = {"qkv_cpu::rms_norm", "qkv_cpu::silu_mul", "qkv_cpu::rotary", "qkv_cpu::moe_token", "qkv_cpu::moe_grouped",
            "qkv_cpu::delta_decode", "qkv_cpu::gated_delta_chunks", "qkv_cpu::decode_attention"}
    assert want <= fast_ops, f"missing compiled kernels: {sorted(want - fast_ops)}"
    assert torch.equal(plain, fast)


def test_explain_names_the_compiled_decode_backend_and_sdpa_means_sdpa():
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    m = masks.positions(torch.full((2, 1), 8), torch.arange(9).expand(2, 9))
    report = qkv.explain(q, k, v, mask=m)
    assert report.chosen == "cpu_decode" and "compiled decode kernel" in report.note
    with profile() as prof:
        qkv.attention(q, k, v, mask=m, backend="sdpa")
    assert not any(e.name.startswith("qkv_cpu::") for e in prof.events()), "backend='sdpa' ran a qkv kernel"
    leaf = q.clone().requires_grad_()
    assert "no backward" in qkv.explain(leaf, k, v, mask=m).declined["cpu_decode"]


def test_optimize_checks_compiled():
    with pytest.raises(TypeError, match="compiled must be True .* or False .*, got 'yes'"):
        qkv.cpu.optimize(RMSNorm(4), compiled="yes")
