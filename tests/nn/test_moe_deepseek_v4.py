"""DeepSeek-V4's mixture of experts in qkv.nn.moe (sqrt-softplus routing with a correction bias, hash routing by token
id, clamped SiLU experts and shared expert) against HF's ``DeepseekV4SparseMoeBlock`` in float64 (HF's source with its
float32 casts lifted, tests/_hf_float64.py); routing functions on hand-made cases; refusals."""

from __future__ import annotations

import pytest
import torch

from _hf_float64 import float64_module
from qkv.nn.moe import MoE, MoEConfig, route_hash, route_sqrt_softplus

V4_CASTS = {".to(torch.float32)": 1, ".float()": 15, "dtype=torch.float32": 23, "dtype=torch.float)": 2}
E, K, D, F_, V = 8, 3, 16, 12, 40


def _moe_config(**kw) -> MoEConfig:
    return MoEConfig(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_, n_shared_experts=1,
                     topk_method="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, silu_limit=0.7, **kw)


def _pair(hashed: bool):
    pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")
    import transformers

    hf = float64_module("deepseek_v4", V4_CASTS)
    cfg = transformers.DeepseekV4Config(hidden_size=D, moe_intermediate_size=F_, n_routed_experts=E,
                                        num_experts_per_tok=K, vocab_size=V, num_hidden_layers=1, swiglu_limit=0.7,
                                        routed_scaling_factor=1.5,
                                        mlp_layer_types=["hash_moe" if hashed else "moe"])
    cfg._experts_implementation = "eager"
    theirs = hf.DeepseekV4SparseMoeBlock(cfg, 0).double().eval()
    gen = torch.Generator().manual_seed(int(hashed))
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5)
        if hashed:
            theirs.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(V)]))
        else:
            theirs.gate.e_score_correction_bias.copy_(0.3 * torch.randn(E, generator=gen, dtype=torch.float64))
    ours = MoE(D, _moe_config(), hash_vocab=V if hashed else None).double().eval()
    sd = {"router.weight": theirs.gate.weight, "experts.gate_up_proj": theirs.experts.gate_up_proj,
          "experts.down_proj": theirs.experts.down_proj,
          "shared_experts.gate_up_proj.weight": torch.cat([theirs.shared_experts.gate_proj.weight,
                                                           theirs.shared_experts.up_proj.weight]),
          "shared_experts.down_proj.weight": theirs.shared_experts.down_proj.weight}
    sd["tid2eid" if hashed else "e_score_correction_bias"] = (theirs.gate.tid2eid if hashed
                                                              else theirs.gate.e_score_correction_bias)
    ours.load_state_dict(sd)
    return theirs, ours


@pytest.mark.parametrize("hashed", [False, True], ids=["sqrtsoftplus", "hash"])
def test_block_equals_hf_in_float64(hashed):
    theirs, ours = _pair(hashed)
    gen = torch.Generator().manual_seed(3)
    x = 2 * torch.randn(2, 7, D, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, V, (2, 7), generator=gen)
    with torch.no_grad():
        want = theirs(x, input_ids=ids)
        got = ours(x, input_ids=ids) if hashed else ours(x)
        rel = float((got - want).abs().max() / want.abs().max())
        assert rel < 1e-13, rel
        # the clamp binds somewhere, and the correction bias (or the table) changes the choice
        h = torch.nn.functional.linear(x.reshape(-1, D), ours.experts.gate_up_proj[0])
        assert bool((h.abs() > 0.7).any())
        if hashed:
            other = ours.tid2eid.roll(1, 0)
            assert not torch.equal(ours.route(x.reshape(-1, D), ids.reshape(-1))[1],
                                   other[ids.reshape(-1)])
        else:
            free, _ = ours.route(x.reshape(-1, D))
            logits = torch.nn.functional.linear(x.reshape(-1, D), ours.router.weight)
            unbiased = route_sqrt_softplus(logits, torch.zeros(E, dtype=torch.float64), ours.config)[1]
            assert not torch.equal(ours.route(x.reshape(-1, D))[1].sort(-1).values, unbiased.sort(-1).values)


def test_routing_functions_by_hand():
    m = _moe_config()
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0, 0.5, -2.0, 3.0, 0.1]], dtype=torch.float64)
    scores = torch.nn.functional.softplus(logits).sqrt()
    w, idx = route_sqrt_softplus(logits, torch.zeros(E, dtype=torch.float64), m)
    assert sorted(idx[0].tolist()) == [1, 3, 6]
    torch.testing.assert_close(w, 1.5 * scores.gather(1, idx) / scores.gather(1, idx).sum())
    bias = torch.zeros(E, dtype=torch.float64)
    bias[5] = 10.0  # the bias steers the choice, not the weight
    w2, idx2 = route_sqrt_softplus(logits, bias, m)
    assert 5 in idx2[0].tolist()
    torch.testing.assert_close(w2, 1.5 * scores.gather(1, idx2) / scores.gather(1, idx2).sum())
    w3, idx3 = route_hash(logits, torch.tensor([[5, 0, 2]]), m)
    assert idx3.tolist() == [[5, 0, 2]]
    torch.testing.assert_close(w3, 1.5 * scores[:, [5, 0, 2]] / scores[:, [5, 0, 2]].sum())


def test_refusals():
    moe = MoE(D, _moe_config(), hash_vocab=V)
    x = torch.randn(1, 4, D)
    with pytest.raises(ValueError, match="needs input_ids"):
        moe(x)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 40\)"):
        moe(x, input_ids=torch.tensor([[0, 1, 2, 40]]))
    with pytest.raises(ValueError, match="topk_method='sqrtsoftplus'"):
        MoEConfig(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_, hash_layers=(0,))
    with pytest.raises(ValueError, match="silu_limit must be > 0"):
        _moe_config().__class__(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_, silu_limit=0.0)
    with pytest.raises(ValueError, match="set 'sqrtsoftplus'"):
        MoE(D, MoEConfig(n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F_), hash_vocab=V)
