"""T5 from HF checkpoints: encoder states with padding (right and left) and teacher-forced logits within the
error budget of HF's eager float64 model (v1.0: ReLU, tied and scaled head; v1.1: gated GELU, separate
head, deeper decoder), greedy generation with a qkv cache (cross-attention keys/values computed once,
relative buckets over cached positions) token for token equal to HF's ``generate``, and bad checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
import transformers as T  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from qkv.models import CheckpointError, from_hf  # noqa: E402
from qkv.testing import assert_within_budget  # noqa: E402

VOCAB = 101
SMALL = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, relative_attention_num_buckets=8,
             relative_attention_max_distance=16, decoder_start_token_id=0)
CONFIGS = {
    "v1.0-relu-tied-H4": dict(num_heads=4),
    "v1.1-gatedgelu-untied-H6-dec3": dict(num_heads=6, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                          num_decoder_layers=3),
}


def _t5(cfg, seed=0, arch=T.T5ForConditionalGeneration, factor=1.0):
    torch.manual_seed(seed)
    return arch(T.T5Config(**SMALL, initializer_factor=factor, **cfg)).eval()


def _padded(lengths, *, left=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = max(lengths)
    ids = torch.randint(2, VOCAB, (len(lengths), N), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        if left:
            mask[b, N - n:] = 1
        else:
            mask[b, :n] = 1
    return ids * mask, mask


def _check(ours, ref, base, what):
    b = assert_within_budget(ours, ref, base, what=what)
    assert 0 < b.baseline_error < 1e-3, f"{what}: implausible baseline {b}"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_and_encoder_with_padding_within_budget(name, side):
    hf = _t5(CONFIGS[name])
    hf64 = copy.deepcopy(hf).double()
    model = from_hf(hf)
    ids, mask = _padded([12, 5, 9], left=side == "left")
    dec = torch.randint(2, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want32 = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
        want64 = hf64(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
        logits = model(ids, dec, attention_mask=mask)
        states = model.encode(ids, attention_mask=mask)
    real = mask.bool()
    _check(states[real], want64.encoder_last_hidden_state[real], want32.encoder_last_hidden_state[real],
           f"t5 {name} encoder states ({side} padding)")
    _check(logits, want64.logits, want32.logits, f"t5 {name} logits ({side} padding)")


def test_encoder_only_checkpoint(tmp_path):
    hf = _t5(CONFIGS["v1.1-gatedgelu-untied-H6-dec3"], arch=T.T5EncoderModel)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = from_hf(tmp_path)
    ids, mask = _padded([9, 4])
    with torch.no_grad():
        want32 = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        want64 = copy.deepcopy(hf).double()(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model(ids, attention_mask=mask)
    real = mask.bool()
    _check(got[real], want64[real], want32[real], "t5 encoder-only states")


@pytest.mark.parametrize("name", ["v1.0-relu-tied-H4", "v1.1-gatedgelu-untied-H6"])
def test_greedy_generation_equals_hf_and_cross_kv_is_computed_once(name):
    cfg = {k: v for k, v in CONFIGS[name + ("-dec3" if "v1.1" in name else "")].items() if k != "num_decoder_layers"}
    hf = _t5(cfg, seed=4, factor=4.0)  # HF's own generate needs num_decoder_layers == num_layers
    model = from_hf(hf)
    ids, mask = _padded([10, 4, 7], seed=2)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    calls = {"cross": 0, "self": 0}
    hooks = [layer.cross_attn.k_proj.register_forward_hook(lambda *_: calls.__setitem__("cross", calls["cross"] + 1))
             for layer in model.decoder.layers]
    hooks += [layer.self_attn.k_proj.register_forward_hook(lambda *_: calls.__setitem__("self", calls["self"] + 1))
              for layer in model.decoder.layers]
    got = model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    for h in hooks:
        h.remove()
    n_layers = len(model.decoder.layers)
    assert calls == {"cross": n_layers, "self": 12 * n_layers}, calls
    assert got.new_tokens.unique().numel() > 3, "degenerate model: the comparison would prove little"
    assert torch.equal(got.sequences, want), f"qkv {got.sequences.tolist()} != HF {want.tolist()}"


def test_generation_stops_at_eos_and_pads():
    hf = _t5(CONFIGS["v1.0-relu-tied-H4"], seed=4, factor=4.0)
    model = from_hf(hf)
    ids, mask = _padded([6, 9], seed=3)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    eos = int(free.new_tokens[0, 2])  # pretend the third token of row 0 is the stop token
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos)
    assert bool(got.finished[0])
    assert torch.equal(got.sequences, want[:, :got.sequences.shape[1]]), (got.sequences, want)


def test_saved_directory_shares_the_embedding(tmp_path):
    hf = _t5(CONFIGS["v1.0-relu-tied-H4"])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = from_hf(tmp_path)
    assert model.lm_head is None  # tied: logits read the shared embedding
    ids, dec = torch.randint(2, VOCAB, (2, 6)), torch.randint(2, VOCAB, (2, 3))
    with torch.no_grad():
        assert torch.allclose(model(ids, dec), hf(input_ids=ids, decoder_input_ids=dec).logits, atol=1e-5)


def test_missing_relative_bias_is_named(tmp_path):
    _t5(CONFIGS["v1.0-relu-tied-H4"]).save_pretrained(tmp_path, safe_serialization=True)
    f = next(tmp_path.glob("*.safetensors"))
    state = load_file(str(f))
    del state["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"decoder\.block\.0\.layer\.0\.SelfAttention\.relative_attention_bias"):
        from_hf(tmp_path)


def test_the_decoder_only_drivers_refuse_an_encoder_decoder_by_name():
    """qkv.models.generate and Engine drive decoder-only models (forward(ids, positions=, cache=)); T5 decodes with
    its own generate. Both refuse it with a TypeError that says so, before any work (it was a raw TypeError from
    inside T5.forward)."""
    from qkv.models import Engine, generate

    model = from_hf(_t5(CONFIGS["v1.0-relu-tied-H4"]))
    ids = torch.randint(1, VOCAB, (1, 5))
    with pytest.raises(TypeError, match=r"generate\(model\): expected a qkv.cache.DecoderModel, got T5: its forward "
                                        r"takes no positions or cache keyword .*model.generate"):
        generate(model, ids, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"Engine\(model\): .* got T5: its forward takes no positions"):
        Engine(model, num_blocks=8, block_size=4)
    assert model.generate(ids, max_new_tokens=2).new_tokens.shape == (1, 2)
