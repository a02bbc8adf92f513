"""``attn_implementation="qkv"`` on HF's DeepSeek-V3.2 (DeepSeek Sparse Attention) against HF's eager attention.

HF's indexer reads the mask before its top-k (``attention_mask[:, 0]``), so the ``"qkv"`` mask is indexable (the
dense boolean slice); HF then hands every attention call the top-k key indices (``indices=``), which qkv ANDs
with the mask as ``masks.topk`` lists and runs on the gather backend. A tiny config with weights at unit scale;
16 indexer heads so that no exact-zero score tie reaches the top-k boundary (HF's ``torch.topk`` orders ties
arbitrarily); ``index_topk`` shorter than the prompt.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hf import hf_causal_lm
from qkv.testing import assert_within_budget

transformers = pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")
import qkv.integrations.transformers as qhf  # noqa: E402  (after transformers is known to be there)

N, N_PAD, N_NEW, V, K = 14, 4, 6, 160, 5
_CFG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=64,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
            n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, index_n_heads=16,
            index_head_dim=16, index_topk=K)

_MODELS: list = []


def _models():
    """(eager float32, eager float64, qkv float32), built once."""
    if not _MODELS:
        hf = hf_causal_lm("DeepseekV32Config", "DeepseekV32ForCausalLM", _CFG, seed=3, attn_implementation="eager",
                          experts_implementation="eager")
        cand = copy.deepcopy(hf)
        qhf.use(cand)
        _MODELS.extend([hf, copy.deepcopy(hf).double().eval(), cand])
    return _MODELS


def _prompt():
    ids = torch.randint(1, V, (2, N), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :N_PAD] = 0
    ids[1, :N_PAD] = 0
    return ids, mask


def test_left_padded_logits_within_budget_of_eager():
    hf, ref, cand = _models()
    ids, mask = _prompt()
    real = mask.bool()
    with torch.no_grad():
        ours = cand(ids, attention_mask=mask).logits
        base = hf(ids, attention_mask=mask).logits
        truth = torch.cat([ref(ids[b, real[b]][None]).logits[0] for b in range(2)])
        dense = copy.deepcopy(ref)
        for layer in dense.model.layers:
            layer.self_attn.indexer.index_topk = N
        unselected = torch.cat([dense(ids[b, real[b]][None]).logits[0] for b in range(2)])
    assert (unselected - truth).abs().max() > 0.1, "index_topk must change the logits for this test to mean anything"
    assert_within_budget(ours[real], truth, base[real], what="attn_implementation='qkv' DeepSeek-V3.2 logits")


def test_greedy_generate_equals_eager():
    hf, _, cand = _models()
    ids, mask = _prompt()
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
        got = cand.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
    assert torch.equal(got, want), f"qkv {got[:, N:].tolist()}\neager {want[:, N:].tolist()}"


def test_every_attention_call_reads_the_indexers_lists_on_the_gather_backend():
    _, _, cand = _models()
    ids, mask = _prompt()
    reports = qhf.explain(cand, ids, attention_mask=mask)
    assert len(reports) == _CFG["num_hidden_layers"]
    for r in reports:
        assert r.explanation.chosen == "gather" and "top-k" in r.mask_source, str(r)
        assert f"topk(K={K}" in r.explanation.request, r.explanation.request


def test_the_qkv_mask_indexes_like_hfs_boolean_mask():
    left = torch.tensor([[1] * 8, [0, 0, 0] + [1] * 5])
    args = dict(batch_size=2, q_length=3, kv_length=8, q_offset=5, kv_offset=0,
                mask_function=mu.causal_mask_function, attention_mask=left)
    want = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    got = qhf.hf_mask(**args)
    assert got[:, 0].shape == (2, 3, 8) and torch.equal(got[:, 0], want[:, 0])
    every = qhf.hf_mask(batch_size=1, q_length=2, kv_length=2, mask_function=mu.bidirectional_mask_function)
    assert every.mask is None and bool(every[:, 0].all())
    with pytest.raises(TypeError, match="cannot be indexed"):
        qhf.HFMask(None, "analytic")[:, 0]


def test_bad_indices_are_a_clear_error():
    _, _, cand = _models()
    attn = cand.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 3, 24), torch.randn(1, 4, 3, 24)
    with pytest.raises(ValueError, match=r"indices .* must be \(B, Nq, K\)"):
        qhf.attention_forward(attn, q, k, k, None, indices=torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        qhf.attention_forward(attn, q, k, k, None, indices=torch.zeros(1, 3, 2))
