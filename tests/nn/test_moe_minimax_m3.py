"""MiniMax-M3's MoE block on qkv's :class:`qkv.nn.moe.MoE` (sigmoid routing with a correction bias as
``noaux_tc`` with one group, GPT-OSS's clamped SwiGLU experts without biases, a clamped-SwiGLU shared expert,
routed scaling) against HF transformers' ``MiniMaxM3VLSparseMoeBlock`` in float64 (HF's source with its float32
casts lifted, tests/_hf_float64.py); the explicit MoE layer list (HF ``mlp_layer_types``); refusals."""

from __future__ import annotations

import math

import pytest
import torch

from _hf_float64 import float64_module
from qkv.config.moe import MoEConfig
from qkv.nn.moe import MoE

F64 = torch.float64
M3_CASTS = {".float()": 9, "dtype=torch.float32": 5, "dtype=torch.float)": 4}
D, E, K, F_EXPERT, F_SHARED = 24, 8, 3, 16, 20


def _moe_config(limit: float = 7.0) -> MoEConfig:
    return MoEConfig(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_EXPERT, n_shared_experts=1,
                     shared_expert_intermediate_size=F_SHARED, routed_scaling_factor=2.0, topk_method="noaux_tc",
                     n_group=1, topk_group=1, norm_topk_prob=True, swiglu_limit=limit, swiglu_alpha=1.702)


def _pair(limit: float = 7.0):
    transformers = pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")
    hf = float64_module("minimax_m3_vl", M3_CASTS)
    cfg = transformers.MiniMaxM3VLTextConfig(
        hidden_size=D, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32,
        num_local_experts=E, num_experts_per_tok=K, intermediate_size=F_EXPERT, shared_intermediate_size=F_SHARED,
        routed_scaling_factor=2.0, swiglu_limit=7.0, swiglu_alpha=1.702)
    theirs = hf.MiniMaxM3VLSparseMoeBlock(cfg).double().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in list(theirs.parameters()) + list(theirs.buffers()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * (0.5 if p.dim() == 1 else 3 / math.sqrt(D)))
    ours = MoE(D, _moe_config(limit)).double().eval()
    sd = {("router.weight" if k == "gate.weight" else "e_score_correction_bias"
           if k == "gate.e_score_correction_bias" else k): v for k, v in theirs.state_dict().items()}
    sd["experts.gate_up_proj_bias"] = torch.zeros(E, 2 * F_EXPERT, dtype=F64)
    sd["experts.down_proj_bias"] = torch.zeros(E, D, dtype=F64)
    ours.load_state_dict(sd)
    return theirs, ours


def test_moe_block_matches_hf_in_float64():
    theirs, ours = _pair()
    x = torch.randn(2, 11, D, generator=torch.Generator().manual_seed(1), dtype=F64)
    unclamped = _pair(limit=1e9)[1]
    with torch.no_grad():
        truth, got, loose = theirs(x), ours(x), unclamped(x)
    err = ((got - truth).abs().max() / truth.abs().max()).item()
    assert err < 1e-12, f"relative error {err:.3g}"
    assert (loose - truth).abs().max() > 1e-3, "the clamp must be live in this test (else it cannot fail)"


def test_moe_layers_pick_the_layers():
    m = MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1,
                  moe_layers=[0, 2])
    assert [m.is_moe(i) for i in range(4)] == [True, False, True, False]
    assert m.moe_layers == (0, 2)
    with pytest.raises(ValueError, match="moe_layers must be layer indices"):
        MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, moe_layers=(-1,))


def test_clamped_shared_expert_refuses_biases():
    with pytest.raises(ValueError, match="has no biases"):
        MoE(D, _moe_config(), bias=True)
