"""Qwen4-Exp's new pieces against HF transformers' modules in float64: the hashed n-gram embedding
(:mod:`qkv.nn.ngram_embedding`), Per-Layer Embedding (:mod:`qkv.nn.ple`) and the gated residual hyper-connection
(:mod:`qkv.nn.gated_residual`).

HF's ``Qwen4ExpTextRMSNorm`` casts its input to float32 even in a float64 model; the reference here lifts that cast
(the ``exact_norms`` fixture), so HF's module is a float64 oracle and the bar is a relative error under 1e-12. Each
piece is also checked for split-call (decode) equality, bad inputs, and that a wrong weight is seen (tests that
can fail).
"""

from __future__ import annotations

import pytest
import torch

from qkv.nn.gated_residual import GatedResidual, stream_rms_norm
from qkv.nn.ngram_embedding import NGramEmbedding, ngram_hash_tables, ngram_multipliers, shifted_tokens
from qkv.nn.ple import PerLayerEmbedding

transformers = pytest.importorskip("transformers", reason="HF transformers is the reference of these tests")
hf_mod = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

VOCAB, EOS = 61, 1
_FIELDS = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
               head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
               linear_value_head_dim=4, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
               shared_expert_intermediate_size=8, hc_count=3, hc_lowrank=5, ple_layer_ids=[1, 3], ple_embed_dim=12,
               ngram_size=3, heads_per_ngram=3, ngram_vocab_size_base=40, make_ngram_vocab_size_divisible_by=8,
               eos_token_id=EOS, ple_conv_kernel_size=3,
               layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"])


def _exact_rms_forward(self, x):
    out = self._norm(x)
    return (out * (1.0 + self.weight.to(x.dtype))).type_as(x)


@pytest.fixture
def exact_norms(monkeypatch):
    monkeypatch.setattr(hf_mod.Qwen4ExpTextRMSNorm, "forward", _exact_rms_forward)


def _config(**changes):
    return transformers.Qwen4ExpTextConfig(**{**_FIELDS, **changes})


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.3 if "norm" in name else 1.0 / max(1, p.shape[-1]) ** 0.5
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _ids(seed, shape, eos_every=None):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, shape, generator=gen)
    if eos_every:
        ids[:, ::eos_every] = EOS
    return ids


# ---------------------------------------------------------------------------------------------- n-gram embedding


@pytest.mark.parametrize("layer", [0, 1])
def test_hash_tables_and_multipliers_are_hfs(layer):
    hf = hf_mod.Qwen4ExpTextNGramEmbedding(_config(), 12, layer_idx=2 * layer, ple_layer_index=layer)
    sizes, offsets = ngram_hash_tables(40, 6, layer)
    assert sizes == hf.head_vocab_sizes and offsets == hf.head_offsets
    assert ngram_multipliers(VOCAB, 3, layer, 1234) == hf.layer_multipliers.tolist()
    assert ngram_multipliers(248320, 3, 5, 1234) == hf_mod._build_layer_multipliers(248320, 3, 5, 1234).tolist()


@pytest.mark.parametrize("eos_every", [None, 4], ids=["no-eos", "eos-every-4"])
def test_ngram_embedding_matches_hf_and_decodes_in_pieces(eos_every):
    cfg = _config()
    hf = hf_mod.Qwen4ExpTextNGramEmbedding(cfg, 12, layer_idx=2, ple_layer_index=1).double()
    ours = NGramEmbedding(vocab_size=VOCAB, embedding_dim=12, ngram_size=3, heads_per_ngram=3,
                          ngram_vocab_size_base=40, eos_token_id=EOS, ple_layer_index=1, pad_to=8).double()
    _randomize(hf, 0)
    ours.load_state_dict(hf.state_dict())
    ids = _ids(1, (2, 11), eos_every)
    with torch.no_grad():
        truth = hf(ids, None)
        full, ctx = ours(ids)
        torch.testing.assert_close(full, truth, rtol=0, atol=0)
        out, c = ours(ids[:, :1])  # shorter than the context
        parts = [out]
        for a, b in ((1, 5), (5, 6), (6, 11)):
            out, c = ours(ids[:, a:b], context=c)
            parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 1), truth, rtol=0, atol=0)
    assert torch.equal(c, ctx) and torch.equal(ctx, ids[:, -2:])


def test_shifted_tokens_stop_at_eos():
    h = torch.tensor([[7, 8, EOS, 9, 10, 11]])
    assert shifted_tokens(h, 1, EOS).tolist() == [[EOS, 7, 8, EOS, 9, 10]]
    assert shifted_tokens(h, 2, EOS).tolist() == [[EOS, EOS, 7, EOS, EOS, 9]]


def test_ngram_embedding_refuses_bad_inputs():
    with pytest.raises(ValueError, match="embedding_dim=10 must be a multiple of the n-gram heads"):
        NGramEmbedding(vocab_size=10, embedding_dim=10, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=20,
                       eos_token_id=1)
    with pytest.raises(ValueError, match="ngram_size must be an int >= 2"):
        NGramEmbedding(vocab_size=10, embedding_dim=4, ngram_size=1, heads_per_ngram=2, ngram_vocab_size_base=20,
                       eos_token_id=1)
    emb = NGramEmbedding(vocab_size=10, embedding_dim=4, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=20,
                         eos_token_id=1)
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        emb(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"context must be the previous call's \(B, ngram_size - 1\) = \(1, 2\)"):
        emb(torch.ones(1, 3, dtype=torch.long), context=torch.ones(1, 3, dtype=torch.long))


# --------------------------------------------------------------------------------------------------------- PLE


def _ple_pair(seed=3):
    cfg = _config()
    hf = hf_mod.Qwen4ExpTextPLELayer(cfg, layer_idx=2, ple_layer_index=1).double()
    ours = PerLayerEmbedding(hidden_size=16, streams=3, embed_dim=12, vocab_size=VOCAB, ngram_size=3,
                             heads_per_ngram=3, ngram_vocab_size_base=40, eos_token_id=EOS, ple_layer_index=1,
                             pad_to=8, conv_kernel_size=3).double()
    _randomize(hf, seed)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def test_ple_matches_hf_in_float64_and_decodes_in_pieces(exact_norms):
    hf, ours = _ple_pair()
    gen = torch.Generator().manual_seed(4)
    H = torch.randn(2, 13, 48, generator=gen, dtype=torch.float64)
    ids = _ids(5, (2, 13), eos_every=6)
    with torch.no_grad():
        truth = hf(H, ids, None)
        full = ours(H, ids)
        assert _rel(full.out, truth) < 1e-12, _rel(full.out, truth)
        st, parts = None, []
        for a, b in ((0, 2), (2, 9), (9, 10), (10, 13)):
            res = ours(H[:, a:b], ids[:, a:b], state=st)
            parts.append(res.out)
            st = res.state
    assert _rel(torch.cat(parts, 1), truth) < 1e-12
    assert torch.equal(st.context, full.state.context)
    assert _rel(st.conv, full.state.conv) < 1e-12


def test_ple_left_padding_gives_the_row_alone(exact_norms):
    _, ours = _ple_pair()
    gen = torch.Generator().manual_seed(6)
    H = torch.randn(1, 9, 48, generator=gen, dtype=torch.float64)
    ids = _ids(7, (1, 9))
    pad = 3
    Hp = torch.cat((torch.randn(1, pad, 48, generator=gen, dtype=torch.float64), H), 1)
    idp = torch.cat((torch.full((1, pad), 0), ids), 1)
    real = torch.cat((torch.zeros(1, pad, 1), torch.ones(1, 9, 1)), 1).double()
    with torch.no_grad():
        alone, padded = ours(H, ids).out, ours(Hp, idp, real=real).out
    assert _rel(padded[:, pad:], alone) < 1e-12


def test_ple_sees_its_convolution(exact_norms):
    """A poisoned convolution weight moves the output (the check above cannot pass with the conv dropped)."""
    hf, ours = _ple_pair()
    H, ids = torch.randn(1, 8, 48, dtype=torch.float64), _ids(8, (1, 8))
    with torch.no_grad():
        truth = hf(H, ids, None)
        ours.conv1d.weight.add_(0.5)
        assert _rel(ours(H, ids).out, truth) > 1e-3


def test_ple_refuses_bad_shapes():
    _, ours = _ple_pair()
    with pytest.raises(ValueError, match=r"streams must be \(B, N, streams \* hidden_size = 48\)"):
        ours(torch.zeros(1, 4, 16, dtype=torch.float64), torch.ones(1, 4, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ gated residual


@pytest.mark.parametrize("inject", [True, False], ids=["block", "head"])
def test_gated_residual_matches_hf_in_float64(exact_norms, inject):
    hf = hf_mod.Qwen4ExpTextGatedResidual(_config(), use_combine=inject).double()
    ours = GatedResidual(16, 3, 5, inject=inject).double()
    _randomize(hf, 9)
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(10)
    H = torch.randn(2, 7, 48, generator=gen, dtype=torch.float64)
    y = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        if not inject:
            assert _rel(ours.collapse(H), hf(H)) < 1e-12
            return
        x_hf, _, w_hf = hf(H)
        x, w = ours.enter(H)
        assert _rel(x, x_hf) < 1e-12 and _rel(w, w_hf) < 1e-12
        after = H + (y.unsqueeze(-2) * w_hf.unsqueeze(-1)).flatten(-2)  # HF's decoder layer writes it so
        assert _rel(ours.leave(H, y, w), after) < 1e-12
        assert torch.equal(ours.widen(y), y.repeat(1, 1, 3))


def test_stream_norm_normalizes_each_stream_alone():
    x = torch.cat((torch.ones(1, 1, 4), 10 * torch.ones(1, 1, 4)), -1).double()
    y = stream_rms_norm(x, torch.zeros(8, dtype=torch.float64), width=4, eps=0.0)
    torch.testing.assert_close(y, torch.ones_like(y))


def test_gated_residual_refuses_bad_inputs():
    with pytest.raises(ValueError, match="streams must be an int >= 2"):
        GatedResidual(8, 1, 4)
    res = GatedResidual(8, 2, 4)
    with pytest.raises(ValueError, match=r"streams must be \(B, N, streams \* hidden_size = 16\), got \(1, 2, 8\)"):
        res.enter(torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match="built with inject=False"):
        GatedResidual(8, 2, 4, inject=False).enter(torch.zeros(1, 2, 16))
