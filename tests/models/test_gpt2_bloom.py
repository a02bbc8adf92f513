"""GPT-2 and BLOOM from HF checkpoints: prefill logits within the error budget of HF's eager float64 model
(left padding with an attention mask), greedy generation with a qkv KV cache token for token equal to HF's
``generate``, loading from a saved directory, and checkpoints that do not fit."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
import transformers as T  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from qkv.models import CheckpointError, from_hf  # noqa: E402
from qkv.models.generate import generate, prompt_positions  # noqa: E402
from qkv.testing import assert_within_budget  # noqa: E402

VOCAB = 97

GPT2 = {
    "H4-tied": dict(n_embd=32, n_layer=2, n_head=4),
    "H2-gelu-ninner-layerscale": dict(n_embd=32, n_layer=2, n_head=2, n_inner=48, activation_function="gelu",
                                      scale_attn_by_inverse_layer_idx=True),
    "H8-untied": dict(n_embd=32, n_layer=3, n_head=8, tie_word_embeddings=False),
}
BLOOM = {
    "H4-tied": dict(hidden_size=32, n_layer=2, n_head=4),
    "H6-alibi-non-pow2": dict(hidden_size=48, n_layer=2, n_head=6),
    "H8-untied": dict(hidden_size=32, n_layer=3, n_head=8, tie_word_embeddings=False),
}


def _gpt2(cfg, seed=0):
    torch.manual_seed(seed)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_positions=64, initializer_range=0.1, **cfg)).eval()


def _bloom(cfg, seed=0):
    torch.manual_seed(seed)
    return T.BloomForCausalLM(T.BloomConfig(vocab_size=VOCAB, initializer_range=0.3, **cfg)).eval()


def _left_padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = max(lengths)
    ids = torch.randint(2, VOCAB, (len(lengths), N), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, N - n:] = 1
    return ids * mask, mask


def _hf_logits(hf, ids, mask, *, gpt2: bool):
    kw = dict(attention_mask=mask)
    if gpt2:  # GPT-2's forward numbers positions 0..N-1 unless told; generate() counts real tokens
        kw["position_ids"] = prompt_positions(mask).clamp_min(0)
    with torch.no_grad():
        return hf(ids, **kw).logits


def _hf_rows_alone(hf, ids, mask):
    """Each prompt run alone, unpadded: the float64 reference (HF BLOOM in float64 turns fully masked
    padding rows into NaN, which then leaks into every row of a padded batch)."""
    out = torch.zeros(*ids.shape, hf.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for b in range(ids.shape[0]):
            real = mask[b].bool()
            out[b, real] = hf(ids[b, real].unsqueeze(0)).logits[0].double()
    return out


CASES = [("gpt2", n, c) for n, c in GPT2.items()] + [("bloom", n, c) for n, c in BLOOM.items()]


@pytest.mark.parametrize(("family", "name", "cfg"), CASES, ids=[f"{f}-{n}" for f, n, _ in CASES])
def test_prefill_left_padded_within_budget(family, name, cfg):
    hf = _gpt2(cfg) if family == "gpt2" else _bloom(cfg)
    model = from_hf(hf)
    ids, mask = _left_padded([11, 4, 8])
    hf32 = _hf_logits(hf, ids, mask, gpt2=family == "gpt2")  # the baseline: HF float32 on the padded batch
    hf64 = _hf_rows_alone(copy.deepcopy(hf).double(), ids, mask)
    with torch.no_grad():
        ours = model(ids, positions=prompt_positions(mask)).logits
    real = mask.bool()  # padding rows attend to nothing: HF and qkv leave different (unused) values there
    assert ours.dtype == torch.float32 and ours.shape == hf32.shape
    b = assert_within_budget(ours[real], hf64[real], hf32[real], what=f"{family} {name} logits")
    assert 0 < b.baseline_error < 1e-3, f"implausible baseline: {b}"


@pytest.mark.parametrize("family", ["gpt2", "bloom"])
def test_greedy_generation_equals_hf(family):
    hf = _gpt2(GPT2["H4-tied"], seed=3) if family == "gpt2" else _bloom(BLOOM["H6-alibi-non-pow2"], seed=3)
    model = from_hf(hf)
    ids, mask = _left_padded([7, 3, 5], seed=1)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[:, ids.shape[1]:]
    got = generate(model, ids, attention_mask=mask, max_new_tokens=12)
    assert got.cache is not None and got.cache.seq_length == ids.shape[1] + 11  # decoded through the cache
    assert got.new_tokens.unique().numel() > 3, "degenerate model: the comparison would prove little"
    assert torch.equal(got.new_tokens, want), f"qkv {got.new_tokens.tolist()} != HF {want.tolist()}"


@pytest.mark.parametrize("family", ["gpt2", "bloom"])
def test_from_saved_directory(tmp_path, family):
    hf = _gpt2(GPT2["H8-untied"]) if family == "gpt2" else _bloom(BLOOM["H4-tied"])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = from_hf(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-4)


def _tamper(path, fn):
    f = next(path.glob("*.safetensors"))
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def test_gpt2_fused_projection_of_wrong_shape_is_named(tmp_path):
    _gpt2(GPT2["H4-tied"]).save_pretrained(tmp_path, safe_serialization=True)
    _tamper(tmp_path, lambda s: s.update({"transformer.h.1.attn.c_attn.weight": torch.zeros(32, 90)}))
    with pytest.raises(CheckpointError, match=r"h\.1\.attn\.c_attn\.weight has shape \(32, 90\), expected \(32, 96\)"):
        from_hf(tmp_path)


def test_bloom_missing_and_unexpected_tensors_are_named(tmp_path):
    _bloom(BLOOM["H4-tied"]).save_pretrained(tmp_path, safe_serialization=True)

    def edit(s):
        s["transformer.h.0.extra.weight"] = s.pop("transformer.h.0.self_attention.query_key_value.weight")

    _tamper(tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        from_hf(tmp_path)
    assert "h.0.self_attention.query_key_value.weight" in str(err.value)
    assert "h.0.extra.weight" in str(err.value)
