"""BERT on qkv: HF ``model_type = "bert"`` checkpoints (``BertModel``, ``BertForMaskedLM``), e.g. all-MiniLM-L6-v2.

Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers for Language Understanding".
A post-norm bidirectional encoder: word + position + token-type embeddings, LayerNorm, then layers of
``norm(x + attn(x))``, ``norm(x + ffn(x))`` (:class:`qkv.nn.TransformerEncoder` with ``norm_first=False``).
The embeddings live here because BERT normalizes *after* adding positions and token types, and because
packed inputs (:mod:`qkv.models.embed`) need positions that restart per sentence.

Shape legend: B batch, N tokens, d model width, V vocabulary.

Masks: an HF ``attention_mask`` (B, N) of 1s and 0s becomes ``masks.padding(lengths)`` when every row is
right-padded (the tokenizer default), otherwise a key mask by position; ``mask=`` takes any :mod:`qkv.masks`
mask instead, e.g. ``masks.document(ids)`` over sentences packed into one row.

Example:
    >>> import torch, transformers  # doctest: +SKIP
    >>> from qkv.models import from_hf  # doctest: +SKIP
    >>> hf = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=2,
    ...     num_attention_heads=4, intermediate_size=64)).eval()  # doctest: +SKIP
    >>> out = from_hf(hf)(torch.tensor([[101, 7, 8, 102]]))  # doctest: +SKIP
    >>> out.last_hidden_state.shape  # doctest: +SKIP
    torch.Size([1, 4, 32])
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import masks
from .._attention import attention
from ..masks.sequence import Document
from ..nn import MultiHeadAttention, TransformerConfig, TransformerEncoder
from ..nn.attention import AttentionModuleOutput
from .loading import FAMILIES, CheckpointError

__all__ = ["BertModel", "BertForMaskedLM", "BertOutput", "PackedSelfAttention", "build", "convert",
           "attention_mask_to_mask"]

FAMILIES["bert"] = "qkv.models.family_bert"

# HF ``hidden_act`` -> qkv.nn.FeedForward activation (the same function, not an approximation of it).
_ACT = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
        "silu": "silu", "swish": "silu"}
_ACT_FN = {"gelu": F.gelu, "relu": F.relu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}
# Architectures whose tensors this module maps; ``None`` (an in-memory model never saved) means BertModel.
_BASE, _MLM = ("BertModel",), ("BertForMaskedLM",)


class BertOutput(NamedTuple):
    """``last_hidden_state`` (B, N, d); ``pooler_output`` (B, d) ``tanh(W h_[CLS] + b)``, or None for a model
    built without a pooler (the encoder inside :class:`BertForMaskedLM`)."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None


def attention_mask_to_mask(attention_mask: torch.Tensor) -> masks.Mask:
    """An HF key mask (B, N) of 1 (real) / 0 (padding) as a qkv mask over keys.

    Right-padded rows (1s then 0s) give ``masks.padding(lengths)``, whose block map skips padded tiles;
    any other pattern gives a key mask through ``masks.positions(..., causal=False)``.
    """
    am = attention_mask.to(torch.bool)
    if am.dim() != 2:
        raise ValueError(f"attention_mask: expected (B, N) of 0/1, got shape {tuple(am.shape)}")
    if not bool((~am[:, :-1] & am[:, 1:]).any()):  # no 0 followed by a 1: right padding
        return masks.padding(am.sum(1))
    cols = torch.arange(am.shape[1], device=am.device).expand_as(am)
    return masks.positions(torch.zeros_like(cols), torch.where(am, cols, -1), causal=False)


def _transformer_config(cfg: dict[str, Any]) -> TransformerConfig:
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"bert: position_embedding_type={cfg['position_embedding_type']!r} is not supported; "
                              "qkv builds BERT with absolute positions")
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise CheckpointError("bert: is_decoder/add_cross_attention checkpoints are not supported; qkv builds the "
                              "bidirectional encoder")
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACT:
        raise CheckpointError(f"bert: hidden_act={act!r} is not supported; supported: {sorted(_ACT)}")
    return TransformerConfig(
        d_model=cfg["hidden_size"], n_heads=cfg["num_attention_heads"], n_layers=cfg["num_hidden_layers"],
        d_ff=cfg["intermediate_size"], activation=_ACT[act], norm="layer", norm_eps=cfg.get("layer_norm_eps", 1e-12),
        norm_first=False, position="none", max_position_embeddings=cfg.get("max_position_embeddings", 512),
        vocab_size=cfg["vocab_size"], dropout=cfg.get("hidden_dropout_prob", 0.0),
        attention_dropout=cfg.get("attention_probs_dropout_prob", 0.0),
        initializer_range=cfg.get("initializer_range", 0.02), name="bert")


class _Group(NamedTuple):
    """Segments attended together: their tokens' packed indices ``index`` (s, L), clamped past each segment's
    end, and lengths (s,); ``full`` when every length is ``L`` (no mask needed)."""

    index: torch.Tensor
    lengths: torch.Tensor
    full: bool


def _segment_groups(mask, x: torch.Tensor) -> list[_Group] | None:
    """For a ``masks.document`` mask over one packed row where each id occupies one contiguous run: the
    segments sorted by length and cut into groups whose lengths differ by at most 1/8 of the longest (little
    padding, few operator calls). None for any other mask."""
    if type(mask) is not Document or mask.q_ids is not None or x.shape[0] != 1:
        return None
    ids = mask.kv_ids
    if ids.shape != (1, x.shape[1]):
        return None
    runs, counts = torch.unique_consecutive(ids[0], return_counts=True)
    if counts.numel() == 1 or torch.unique(runs).numel() != runs.numel():  # one segment, or an id split in runs
        return None
    lengths = counts.tolist()
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    cuts, first = [[order[0]]], lengths[order[0]]
    for i in order[1:]:
        if first - lengths[i] <= first // 8:
            cuts[-1].append(i)
        else:
            cuts.append([i])
            first = lengths[i]
    groups = []
    for members in cuts:
        n = torch.tensor([lengths[i] for i in members], device=x.device)
        s0 = torch.tensor([starts[i] for i in members], device=x.device)
        L = int(n.max())
        index = torch.minimum(s0.unsqueeze(1) + torch.arange(L, device=x.device), (s0 + n - 1).unsqueeze(1))
        groups.append(_Group(index, n, bool((n == L).all())))
    return groups


class PackedSelfAttention(MultiHeadAttention):
    """:class:`qkv.nn.MultiHeadAttention` that runs a document mask over packed sentences segment by segment.

    A document mask over one row of ``T`` packed tokens allows only the diagonal blocks of the (T, T) score
    matrix, but a dense backend computes all ``T^2`` scores. When each id occupies one contiguous run
    (sentences packed one after another), the projections stay packed (no padding work) and only attention
    regroups the segments: sorted by length, cut into groups of similar lengths, each group a batch
    ``(s, H, L, D)`` for :func:`qkv.attention`, masked by ``masks.padding(lengths)`` unless all its lengths are
    equal. The same allowed pairs, about ``sum_i n_i^2`` scores instead of ``T^2``. Any other call (another
    mask, positions, a cache, causal or cross attention, RoPE, position biases, score modifiers or QK norm)
    is the parent's. The query, key and value projections run as one matmul (the fused weight is kept between
    calls under ``torch.no_grad``/``inference_mode`` while the parameters are unchanged) through
    ``linear_fn`` (``F.linear``; :func:`qkv.cpu.optimize` swaps in its CPU products, a
    :class:`qkv.cpu.LinearHost`).
    """

    linear_fn = staticmethod(F.linear)

    def invalidate_fused_weights(self) -> None:
        """Drop the fused QKV weight kept between calls (after the projections were replaced)."""
        self._fused_cache = None

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = [self.q_proj, self.k_proj, self.v_proj]
        tensors = [p.weight for p in parts] + [p.bias for p in parts if p.bias is not None]
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        cached = getattr(self, "_fused_cache", None)
        if torch.is_grad_enabled() or cached is None or cached[0] != key:
            w = torch.cat([p.weight for p in parts])
            b = None
            if any(p.bias is not None for p in parts):
                b = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in parts])
            if torch.is_grad_enabled():
                return w, b
            self._fused_cache = cached = (key, w, b)
        return cached[1], cached[2]

    def forward(self, x, context=None, *, mask=None, positions=None, cache=None, need_lse=False):
        plain = (self.rope is None and self.position_bias is None and self.score_mod is None and self.q_norm is None
                 and not (self.causal or self.cross) and self.attention_fn is attention and self.head_gate is None)
        groups = None
        if plain and context is None and positions is None and cache is None and not need_lse and x.dim() == 3:
            groups = _segment_groups(mask, x)
        if groups is None:
            return super().forward(x, context, mask=mask, positions=positions, cache=cache, need_lse=need_lse)
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        w, b = self._fused_qkv()
        qkv = self.linear_fn(x[0], w, b)  # (T, (H + 2 Hkv) D)
        out = qkv.new_empty(x.shape[1], H * D)
        for g in groups:
            s, L = g.index.shape
            t = qkv.index_select(0, g.index.view(-1)).view(s, L, H + 2 * Hkv, D).transpose(1, 2)
            q, k, v = t.split((H, Hkv, Hkv), dim=1)  # (s, H, L, D), (s, Hkv, L, D) x 2
            o = attention(q, k, v, mask=None if g.full else masks.padding(g.lengths), scale=self.scale,
                          dropout_p=self.dropout if self.training else 0.0, backend=self.backend)  # (s, H, L, D)
            o = o.transpose(1, 2).reshape(s * L, H * D)
            if g.full:
                out.index_copy_(0, g.index.view(-1), o)
            else:
                valid = (torch.arange(L, device=x.device) < g.lengths.unsqueeze(1)).view(-1)
                out.index_copy_(0, g.index.view(-1)[valid], o[valid])
        return AttentionModuleOutput(self.o_proj(out).unsqueeze(0), None)


class BertEmbeddings(nn.Module):
    """``LayerNorm(word[ids] + position[pos] + token_type[types])`` with HF's parameter names."""

    def __init__(self, config: TransformerConfig, type_vocab_size: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.d_model)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, config.d_model)
        self.LayerNorm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None):
        n_pos = self.position_embeddings.num_embeddings
        if positions.numel() and int(positions.max()) >= n_pos:
            raise ValueError(f"BertModel: position {int(positions.max())} is past max_position_embeddings={n_pos}; "
                             f"truncate inputs to {n_pos} tokens")
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions.clamp_min(0))
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertModel(nn.Module):
    """The BERT encoder (HF ``BertModel``), optionally with its pooler.

    Args:
        config: the encoder's :class:`qkv.nn.TransformerConfig` (``norm_first=False``, ``position="none"``).
        type_vocab_size: token-type rows (HF ``type_vocab_size``).
        pooler: build the ``[CLS]`` pooler (HF ``add_pooling_layer``).

    ``forward(input_ids, *, attention_mask=None, token_type_ids=None, positions=None, mask=None)``:
        input_ids (B, N) int64; attention_mask (B, N) 1/0 (HF convention); token_type_ids (B, N) int64
        (default 0); positions (N,) or (B, N) int64 (default ``0 .. N-1``; restart them per sentence for
        packed rows); mask a :mod:`qkv.masks` mask AND-ed with the one built from ``attention_mask``.
        Returns :class:`BertOutput`.
    """

    def __init__(self, config: TransformerConfig, *, type_vocab_size: int = 2, pooler: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config, type_vocab_size)
        self.encoder = TransformerEncoder(config)
        c = config
        for i, layer in enumerate(self.encoder.layers):
            layer.self_attn = PackedSelfAttention(c.d_model, c.n_heads, head_dim=c.head_dim, bias=c.attention_bias,
                                                  dropout=c.attention_dropout, backend=c.backend, layer_idx=i)
        self.pooler = nn.Linear(config.d_model, config.d_model) if pooler else None

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                mask: masks.Mask | None = None) -> BertOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"BertModel: input_ids must be (B, N), got shape {tuple(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"BertModel: attention_mask {tuple(attention_mask.shape)} must match input_ids "
                                 f"{tuple(input_ids.shape)}")
            pad = attention_mask_to_mask(attention_mask)
            mask = pad if mask is None else mask & pad
        x = self.embeddings(input_ids, positions, token_type_ids)
        h = self.encoder(x, mask=mask)  # (B, N, d)
        pooled = torch.tanh(self.pooler(h[:, 0])) if self.pooler is not None else None
        return BertOutput(h, pooled)


class BertForMaskedLM(nn.Module):
    """BERT with its masked-LM head (HF ``BertForMaskedLM``): ``W_vocab LayerNorm(act(W h + b)) + bias``,
    the vocabulary matrix tied to the word embeddings.

    ``forward(input_ids, **kwargs)`` takes :class:`BertModel`'s arguments and returns logits (B, N, V).
    """

    def __init__(self, config: TransformerConfig, *, type_vocab_size: int = 2) -> None:
        super().__init__()
        self.bert = BertModel(config, type_vocab_size=type_vocab_size, pooler=False)
        self.transform = nn.Linear(config.d_model, config.d_model)
        self.transform_norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self._act = _ACT_FN[config.activation]

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        h = self.bert(input_ids, **kwargs).last_hidden_state
        h = self.transform_norm(self._act(self.transform(h)))
        return nn.functional.linear(h, self.bert.embeddings.word_embeddings.weight, self.bias)


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or ["BertModel"]
    for a in archs:
        if a in _BASE + _MLM:
            return a
    raise CheckpointError(f"bert: architectures {archs} are not supported; qkv builds {list(_BASE + _MLM)} "
                          "(task heads other than masked LM are not implemented)")


def build(config: dict[str, Any]) -> nn.Module:
    """The qkv model for an HF BERT config dict: :class:`BertModel` or :class:`BertForMaskedLM`."""
    tc = _transformer_config(config)
    types = config.get("type_vocab_size", 2)
    if _architecture(config) in _MLM:
        if config.get("tie_word_embeddings", True) is False:
            raise CheckpointError("bert: BertForMaskedLM with tie_word_embeddings=False is not supported; qkv ties "
                                  "the masked-LM decoder to the word embeddings")
        return BertForMaskedLM(tc, type_vocab_size=types)
    return BertModel(tc, type_vocab_size=types, pooler=True)


def _encoder_names(prefix: str, n_layers: int) -> dict[str, str]:
    """HF BERT name -> qkv name for the embeddings and layers, under ``prefix`` on the qkv side."""
    names = {f"embeddings.{e}.weight": f"{prefix}embeddings.{e}.weight"
             for e in ("word_embeddings", "position_embeddings", "token_type_embeddings")}
    for p in ("weight", "bias"):
        names[f"embeddings.LayerNorm.{p}"] = f"{prefix}embeddings.LayerNorm.{p}"
        for i in range(n_layers):
            hf, q = f"encoder.layer.{i}.", f"{prefix}encoder.layers.{i}."
            names.update({
                f"{hf}attention.self.query.{p}": f"{q}self_attn.q_proj.{p}",
                f"{hf}attention.self.key.{p}": f"{q}self_attn.k_proj.{p}",
                f"{hf}attention.self.value.{p}": f"{q}self_attn.v_proj.{p}",
                f"{hf}attention.output.dense.{p}": f"{q}self_attn.o_proj.{p}",
                f"{hf}attention.output.LayerNorm.{p}": f"{q}attn_norm.{p}",
                f"{hf}intermediate.dense.{p}": f"{q}ffn.up_proj.{p}",
                f"{hf}output.dense.{p}": f"{q}ffn.down_proj.{p}",
                f"{hf}output.LayerNorm.{p}": f"{q}ffn_norm.{p}",
            })
    return names


def convert(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF BERT tensor names to qkv names. Buffers HF keeps (``position_ids``, ``token_type_ids``) and the tied
    masked-LM decoder are dropped. A missing tensor raises :class:`CheckpointError` naming it (HF and qkv
    names); tensors this module does not know keep their names, so the loader reports them as unexpected."""
    arch = _architecture(config)
    src = {k: v for k, v in state.items() if not k.endswith(("embeddings.position_ids", "embeddings.token_type_ids"))}
    if arch in _MLM:
        names = {f"bert.{k}": v for k, v in _encoder_names("bert.", config["num_hidden_layers"]).items()}
        head = {"cls.predictions.transform.dense": "transform", "cls.predictions.transform.LayerNorm": "transform_norm"}
        for hf, q in head.items():
            names.update({f"{hf}.weight": f"{q}.weight", f"{hf}.bias": f"{q}.bias"})
        names["cls.predictions.bias"] = "bias"
        for tied in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias"):  # the embeddings / bias
            src.pop(tied, None)
    else:
        if any(k.startswith("cls.") for k in src):
            raise CheckpointError("bert: the checkpoint has a masked-LM head (cls.*) but its config names no "
                                  "architecture; set config.architectures = ['BertForMaskedLM'] (HF sets it on "
                                  "save_pretrained) or load the base BertModel")
        src = {k.removeprefix("bert."): v for k, v in src.items()}
        names = _encoder_names("", config["num_hidden_layers"])
        names.update({"pooler.dense.weight": "pooler.weight", "pooler.dense.bias": "pooler.bias"})
    missing = [f"{hf} (qkv {q})" for hf, q in names.items() if hf not in src]
    if missing:
        extra = sorted(set(src) - set(names))
        raise CheckpointError(f"from_hf: bert checkpoint ({arch}) is missing tensors {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}"
                              + (f"; unexpected tensors {extra[:8]}" if extra else ""))
    return {names.get(k, k): v for k, v in src.items()}
