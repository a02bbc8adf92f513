"""Transformer stacks over embeddings: encoder, decoder (with cross attention), encoder-decoder.

Vaswani et al. 2017, "Attention Is All You Need". Every stack reads one :class:`TransformerConfig`;
positional schemes are wired once per stack: absolute embeddings at the input, RoPE and ALiBi/T5 biases
shared by the layers, Shaw's representations per layer. These serve encoders (BERT), encoder-decoders (T5)
and models over non-token inputs (the examples); the decoder-only language model is
:class:`qkv.nn.DecoderLM`.

Shape legend: B batch, N tokens, S source tokens, T target tokens, d model width, V vocabulary.

Example:
    >>> import torch
    >>> from qkv.nn import EncoderDecoder, get_config
    >>> model = EncoderDecoder(get_config("tiny-t5"))
    >>> model(torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 4))).shape
    torch.Size([2, 4, 256])
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import masks
from ..config.decoder import TransformerConfig
from ..pos.alibi import ALiBiBias
from ..pos.learned import LearnedPositionalEmbedding
from ..pos.relative import ShawRelativePosition, T5RelativeBias
from ..pos.rope import RotaryEmbedding
from ..pos.sinusoidal import sinusoidal_encoding
from .blocks import TransformerBlock
from .norm import make_norm

__all__ = ["TransformerEncoder", "TransformerDecoder", "EncoderDecoder", "init_weights"]


def init_weights(module: nn.Module, *, std: float = 0.02) -> None:
    """Normal(0, std) for linear, embedding and positional tables; zero biases; norms at identity."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (LearnedPositionalEmbedding, T5RelativeBias)):
            nn.init.normal_(m.weight, std=std)
        elif isinstance(m, ShawRelativePosition):
            for p in (m.rel_k, m.rel_v):
                if p is not None:
                    nn.init.normal_(p, std=std)


def _lengths_mask(lengths, mask):
    if lengths is None:
        return mask
    pad = masks.padding(lengths)
    return pad if mask is None else mask & pad


class _Stack(nn.Module):
    """Layers plus the positional wiring and the final norm (pre-norm only)."""

    def __init__(self, config: TransformerConfig, *, causal: bool, cross_attention: bool) -> None:
        super().__init__()
        c = self.config = config
        self.causal = causal
        self.rope = (RotaryEmbedding.from_params(c.rope_params, c.head_dim, c.max_position_embeddings)
                     if c.position == "rope" else None)
        self.pos_embed = (LearnedPositionalEmbedding(c.max_position_embeddings, c.d_model)
                          if c.position == "learned" else None)
        if c.position == "alibi":
            self.position_bias = ALiBiBias(c.n_heads, bidirectional=not causal)
        elif c.position == "t5":
            self.position_bias = T5RelativeBias(c.n_heads, num_buckets=c.relative_attention_num_buckets,
                                                max_distance=c.relative_attention_max_distance,
                                                bidirectional=not causal)
        else:
            self.position_bias = None

        def layer_bias():
            if c.position == "shaw":
                return ShawRelativePosition(c.head_dim, c.shaw_max_distance, values=c.shaw_values)
            return self.position_bias

        self.layers = nn.ModuleList(
            TransformerBlock(c, layer_idx=i, causal=causal, cross_attention=cross_attention, rope=self.rope,
                             position_bias=layer_bias())
            for i in range(c.n_layers))
        self.norm = make_norm(c.norm, c.d_model, eps=c.norm_eps) if c.norm_first else nn.Identity()
        self.dropout = nn.Dropout(c.dropout)

    def _embed_positions(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if self.config.position not in ("learned", "sinusoidal"):
            return x
        pos = torch.arange(x.shape[1], device=x.device) if positions is None else positions.to(x.device)
        if self.pos_embed is not None:
            return x + self.pos_embed(pos).to(x.dtype)
        return x + sinusoidal_encoding(pos, self.config.d_model, dtype=x.dtype)


class TransformerEncoder(_Stack):
    """Bidirectional stack over embeddings (B, N, d), with key padding by ``lengths``.

    ``forward(x, *, lengths=None, mask=None, positions=None)``: x (B, N, d); lengths (B,) valid tokens per
    row (keys past them are never attended); mask an extra :mod:`qkv.masks` mask; positions (N,) or (B, N)
    int64 (``-1`` = padding). Returns (B, N, d), final-normed for pre-norm configs.

    Example:
        >>> import torch
        >>> from qkv.nn import TransformerConfig, TransformerEncoder
        >>> enc = TransformerEncoder(TransformerConfig(d_model=32, n_heads=4, position="learned"))
        >>> enc(torch.randn(2, 6, 32), lengths=torch.tensor([6, 3])).shape
        torch.Size([2, 6, 32])
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config, causal=False, cross_attention=False)
        init_weights(self, std=config.initializer_range)

    def forward(self, x: torch.Tensor, *, lengths=None, mask=None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        mask = _lengths_mask(lengths, mask)
        x = self.dropout(self._embed_positions(x, positions))
        for layer in self.layers:
            x = layer(x, mask=mask, positions=positions)
        return self.norm(x)


class TransformerDecoder(_Stack):
    """Causal stack over embeddings (B, N, d), optionally cross-attending to an encoder output.

    ``forward(x, context=None, *, positions=None, cache=None, mask=None, context_lengths=None,
    context_mask=None)``: x (B, N, d); context (B, M, d) (with ``cross_attention=True``); positions (N,) or
    (B, N) int64 absolute positions (``-1`` = padding; required with a cache); cache a ``qkv.cache`` cache;
    mask an extra self-attention mask; context_lengths (B,) valid context tokens; context_mask an extra
    cross-attention mask. Returns (B, N, d), final-normed for pre-norm configs.

    Example:
        >>> import torch
        >>> from qkv.nn import TransformerConfig, TransformerDecoder
        >>> dec = TransformerDecoder(TransformerConfig(d_model=32, n_heads=4), cross_attention=True)
        >>> dec(torch.randn(2, 5, 32), torch.randn(2, 7, 32), context_lengths=torch.tensor([7, 2])).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, config: TransformerConfig, *, cross_attention: bool = False) -> None:
        super().__init__(config, causal=True, cross_attention=cross_attention)
        self.cross_attention = cross_attention
        init_weights(self, std=config.initializer_range)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, positions: torch.Tensor | None = None,
                cache=None, mask=None, context_lengths=None, context_mask=None) -> torch.Tensor:
        if cache is not None and positions is None:
            raise ValueError("TransformerDecoder: a cache needs positions (B, N) of the new tokens")
        context_mask = _lengths_mask(context_lengths, context_mask)
        x = self.dropout(self._embed_positions(x, positions))
        for layer in self.layers:
            x = layer(x, context, mask=mask, context_mask=context_mask, positions=positions, cache=cache)
        return self.norm(x)


class _TokenModel(nn.Module):
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        return x * math.sqrt(self.config.d_model) if self.config.scale_embeddings else x

    def _make_head(self, config: TransformerConfig) -> None:
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self, std=config.initializer_range)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight


class EncoderDecoder(_TokenModel):
    """Sequence-to-sequence model: shared token embedding, encoder, cross-attending decoder, LM head.

    ``forward(src_ids, tgt_ids, *, src_lengths=None) -> logits``: src_ids (B, S), tgt_ids (B, T) int64
    (teacher forcing: logits at ``t`` predict ``tgt[t + 1]``); src_lengths (B,) valid source tokens.
    Returns (B, T, V). ``encode`` and ``decode`` expose the two halves (``decode`` takes ``positions`` and a
    cache for incremental decoding).

    Example:
        >>> import torch
        >>> from qkv.nn import EncoderDecoder, get_config
        >>> model = EncoderDecoder(get_config("tiny-t5"))
        >>> model(torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 4))).shape
        torch.Size([2, 4, 256])
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = TransformerEncoder(config)
        self.decoder = TransformerDecoder(config, cross_attention=True)
        self._make_head(config)

    def encode(self, src_ids: torch.Tensor, *, src_lengths=None) -> torch.Tensor:
        """(B, S) token ids -> (B, S, d) encoder states."""
        return self.encoder(self._embed(src_ids), lengths=src_lengths)

    def decode(self, tgt_ids: torch.Tensor, memory: torch.Tensor | None, *, src_lengths=None,
               positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """(B, T) target ids and (B, S, d) encoder states -> (B, T, V) logits."""
        h = self.decoder(self._embed(tgt_ids), memory, positions=positions, cache=cache, context_lengths=src_lengths)
        return self.lm_head(h)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor, *, src_lengths=None) -> torch.Tensor:
        return self.decode(tgt_ids, self.encode(src_ids, src_lengths=src_lengths), src_lengths=src_lengths)
