"""Qwen4-Exp's Per-Layer Embedding (PLE): Qwen Team 2026, "Qwen4-Exp" model card. (Gemma 3n's per-layer
embeddings are another design: a token table per layer, no n-grams, no streams.)

On the layers that have one, before the layer's blocks, the hashed n-gram embedding of each token
(:class:`qkv.nn.NGramEmbedding`, ``E`` channels) is written into the ``S`` residual streams of the gated
hyper-connection (:mod:`qkv.nn.gated_residual`), gated per stream by how well it matches that stream::

    e        = ngram(tokens)                                   (B, N, E)
    k        = StreamRMSNorm(key_proj(e))                      (B, N, S, d)   one key per stream
    v        = value_proj(e)                                   (B, N, d)      one value for all streams
    q        = StreamRMSNorm(H)                                (B, N, S, d)   the streams themselves
    a        = <k_s, q_s> / sqrt(d);  a <- sign(a) sqrt(max(|a|, 1e-6))
    u        = concat_s(sigmoid(a_s) * v)                      (B, N, S * d)
    H       += u + silu(conv(StreamRMSNorm(u)))                conv: depthwise, causal, kernel K, dilation n

The convolution's dilation is the n-gram size (``ngram_size``), so it reads the gated values of tokens ``n``,
``2n``, ... back. Its state between calls is the last ``(K - 1) * n`` normed inputs; the n-gram embedding's is the
last ``ngram_size - 1`` tokens. :class:`PLEState` holds both. Padding tokens (``real`` 0) read as EOS for the
n-grams and write zeros into the convolution, so a left-padded row gives what it gives alone.

Shape legend: B batch, N tokens, S streams, d hidden size, E n-gram embedding width, K taps, n dilation.

Example:
    >>> import torch
    >>> ple = PerLayerEmbedding(hidden_size=8, streams=2, embed_dim=4, vocab_size=50, ngram_size=3,
    ...                         heads_per_ngram=2, ngram_vocab_size_base=60, eos_token_id=1)
    >>> H, ids = torch.randn(1, 5, 16), torch.randint(2, 50, (1, 5))
    >>> full = ple(H, ids)
    >>> first = ple(H[:, :3], ids[:, :3])
    >>> rest = ple(H[:, 3:], ids[:, 3:], state=first.state)
    >>> full.out.shape, torch.allclose(full.out[:, 3:], rest.out, atol=1e-6)
    (torch.Size([1, 5, 16]), True)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .gated_residual import StreamRMSNorm
from .ngram_embedding import NGramEmbedding

if TYPE_CHECKING:
    from ..config.decoder import DecoderConfig
    from .mixer import MixerStep

__all__ = ["PerLayerEmbedding", "PLEOutput", "PLEState"]


class PLEState(NamedTuple):
    """What a PLE layer carries between calls: ``context`` (B, ngram_size - 1) int64, the last tokens of each row;
    ``conv`` (B, S * d, (K - 1) * n), the convolution's last normed inputs (zeros before the first token)."""

    context: torch.Tensor
    conv: torch.Tensor


class PLEOutput(NamedTuple):
    """``out`` (B, N, S * d), what the layer adds to its streams; ``state``, to pass to the next call."""

    out: torch.Tensor
    state: PLEState


class PerLayerEmbedding(nn.Module):
    """One layer's PLE (module notes). Parameter names are HF's (``ple_embedding``, ``key_proj``, ``value_proj``,
    ``norm_key``, ``norm_query``, ``norm_conv``, ``conv1d``).

    Args:
        hidden_size: ``d``.
        streams: ``S``.
        embed_dim: ``E`` (HF ``ple_embed_dim``).
        conv_kernel_size: ``K`` (HF ``ple_conv_kernel_size``).
        eps: the stream norms' epsilon.

    The n-gram arguments (``vocab_size``, ``ngram_size``, ``heads_per_ngram``, ``ngram_vocab_size_base``,
    ``eos_token_id``, ``ple_layer_index``, ``seed``, ``pad_to``) are :class:`qkv.nn.NGramEmbedding`'s.

    ``forward(streams, input_ids, *, state=None, real=None)``: streams (B, N, S * d), input_ids (B, N) int64,
    state the previous call's :class:`PLEState` (None: a fresh row), real (B, N, 1) 1 on real tokens and 0 on
    padding (None: no padding). Returns :class:`PLEOutput`.
    """

    def __init__(self, *, hidden_size: int, streams: int, embed_dim: int, vocab_size: int, ngram_size: int,
                 heads_per_ngram: int, ngram_vocab_size_base: int, eos_token_id: int, ple_layer_index: int = 0,
                 seed: int = 1234, pad_to: int = 1, conv_kernel_size: int = 4, eps: float = 1e-6, device=None,
                 dtype=None) -> None:
        super().__init__()
        if not isinstance(conv_kernel_size, int) or isinstance(conv_kernel_size, bool) or conv_kernel_size < 1:
            raise ValueError(f"PerLayerEmbedding: conv_kernel_size must be an int >= 1, got {conv_kernel_size!r}")
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.streams, self.eos_token_id = hidden_size, streams, eos_token_id
        wide = streams * hidden_size
        self.ple_embedding = NGramEmbedding(
            vocab_size=vocab_size, embedding_dim=embed_dim, ngram_size=ngram_size, heads_per_ngram=heads_per_ngram,
            ngram_vocab_size_base=ngram_vocab_size_base, eos_token_id=eos_token_id, ple_layer_index=ple_layer_index,
            seed=seed, pad_to=pad_to, **kw)
        self.key_proj = nn.Linear(embed_dim, wide, bias=False, **kw)
        self.value_proj = nn.Linear(embed_dim, hidden_size, bias=False, **kw)
        self.norm_key = StreamRMSNorm(streams, hidden_size, eps=eps, **kw)
        self.norm_query = StreamRMSNorm(streams, hidden_size, eps=eps, **kw)
        self.norm_conv = StreamRMSNorm(streams, hidden_size, eps=eps, **kw)
        self.conv1d = nn.Conv1d(wide, wide, conv_kernel_size, groups=wide, dilation=ngram_size, bias=False, **kw)
        self.conv_state_len = (conv_kernel_size - 1) * ngram_size

    @classmethod
    def for_decoder(cls, config: DecoderConfig, layer_idx: int) -> PerLayerEmbedding | None:
        """Layer ``layer_idx``'s PLE under ``config.ple`` (None when the layer has none)."""
        p = config.ple
        j = None if p is None else p.index_of(layer_idx)
        if j is None:
            return None
        ple = cls(hidden_size=config.hidden_size, streams=config.gated_residual.streams, embed_dim=p.embed_dim,
                  vocab_size=config.vocab_size, ngram_size=p.ngram_size, heads_per_ngram=p.heads_per_ngram,
                  ngram_vocab_size_base=p.ngram_vocab_size_base, eos_token_id=p.eos_token_id, ple_layer_index=j,
                  seed=p.seed, pad_to=p.pad_to, conv_kernel_size=p.conv_kernel_size, eps=config.rms_norm_eps)
        ple.layer_idx = layer_idx
        return ple

    layer_idx: int | None = None  # the decoder layer it sits before (for_decoder sets it)

    def mix(self, streams: torch.Tensor, step: MixerStep) -> torch.Tensor:
        """The decoder's call: what the layer adds to its streams (B, N, S * d) from the step's token ids. With a
        cache, its state lives beside the recurrent layer's (:class:`qkv.cache.RecurrentSpec` ``side``): read
        from there, and handed to the layer's mixer to keep with its own (``step.side_states``). The n-gram
        context is kept relative to EOS, so a row slot cleared to zeros reads as a fresh row."""
        cache, i = step.cache, self.layer_idx
        if cache is None:
            return self(streams, step.input_ids, real=step.real_tokens()).out
        held = cache.recurrent_state(i)
        state = None if held is None else PLEState(held[2] + self.eos_token_id, held[3])
        res = self(streams, step.input_ids, state=state, real=step.real_tokens())
        step.side_states[i] = (res.state.context - self.eos_token_id, res.state.conv)
        return res.out

    def initial_state(self, batch: int, *, device=None, dtype=None) -> PLEState:
        """The state of ``batch`` fresh rows: EOS context, zero convolution inputs."""
        C, wide = self.ple_embedding.context_len, self.streams * self.hidden_size
        return PLEState(torch.full((batch, C), self.eos_token_id, dtype=torch.long, device=device),
                        torch.zeros(batch, wide, self.conv_state_len, device=device, dtype=dtype))

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, *, state: PLEState | None = None,
                real: torch.Tensor | None = None) -> PLEOutput:
        B, N, wide = streams.shape
        S, d = self.streams, self.hidden_size
        if wide != S * d or tuple(input_ids.shape) != (B, N):
            raise ValueError(f"PerLayerEmbedding: streams must be (B, N, streams * hidden_size = {S * d}) and "
                             f"input_ids (B, N); got streams {tuple(streams.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}")
        if state is None:
            state = self.initial_state(B, device=streams.device, dtype=streams.dtype)
        ids = input_ids if real is None else torch.where(real[..., 0] > 0, input_ids, self.eos_token_id)
        e, context = self.ple_embedding(ids, state.context)
        k = self.norm_key(self.key_proj(e)).unflatten(-1, (S, d))  # (B, N, S, d)
        q = self.norm_query(streams).unflatten(-1, (S, d))
        a = (k * q).sum(-1, keepdim=True) / math.sqrt(d)  # (B, N, S, 1)
        a = a.abs().clamp_min(1e-6).sqrt() * a.sign()
        u = (torch.sigmoid(a) * self.value_proj(e).unsqueeze(-2)).flatten(-2)  # (B, N, S * d)
        u_normed = self.norm_conv(u)
        if real is not None:
            u, u_normed = u * real, u_normed * real
        seq = torch.cat((state.conv.to(u_normed.dtype), u_normed.transpose(1, 2)), dim=-1)  # (B, S d, L + N)
        conv = F.silu(self.conv1d(seq)).transpose(1, 2)  # (B, N, S * d)
        return PLEOutput(u + conv, PLEState(context, seq[..., seq.shape[-1] - self.conv_state_len:]))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, streams={self.streams}, "
                f"conv_kernel_size={self.conv1d.kernel_size[0]}, dilation={self.conv1d.dilation[0]}")
