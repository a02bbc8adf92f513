"""Hashed n-gram embeddings: Qwen Team 2026, "Qwen4-Exp" model card (Per-Layer Embedding, PLE), following the
hashed n-gram memory of Huang et al. 2025 ("Over-Tokenized Transformer", arXiv:2501.16975).

Each token gets, for every order ``n = 2 .. ngram_size``, ``heads_per_ngram`` embeddings of the n-gram that ends
at it. An n-gram never reaches back across an end-of-sequence token: the tokens before the last EOS (and before
the start of the sequence) read as EOS, so packed documents do not leak into each other::

    t_s[i]  = tokens[i - s]   if i - s >= 0 and no EOS among tokens[i - s + 1 .. i - 1], else EOS     s = 0 .. n-1
    mix_n   = XOR over s < n of t_s * m_s                                     (int64; m_s odd multipliers)
    id[h]   = mix_n mod P_h + offset_h                                        P_h: a distinct prime per head
    e       = concat over the heads of table[id[h]]                           (B, N, ngram_heads * Dh)

The multipliers come from a SplitMix64 stream seeded by ``seed + 10007 * ple_layer_index`` and are odd and small
enough that ``token * m`` stays below 2**63; head ``h`` of PLE layer ``j`` uses the ``(j * heads + h + 1)``-th
prime from ``ngram_vocab_size_base`` on, so every head of every layer hashes into its own table slice. All of this
is a deterministic function of the config, rebuilt here (and compared with a checkpoint's buffers by the loader).

Decoding carries the last ``ngram_size - 1`` tokens of each row (:attr:`NGramEmbedding.context_len`) from call to
call: a fresh row starts from EOS, which is what a sequence start reads as anyway.

Shape legend: B batch, N new tokens, C = ngram_size - 1 carried tokens, Hn n-gram heads, Dh head width.

Example:
    >>> import torch
    >>> emb = NGramEmbedding(vocab_size=50, embedding_dim=8, ngram_size=3, heads_per_ngram=2,
    ...                      ngram_vocab_size_base=100, eos_token_id=1)
    >>> ids = torch.tensor([[5, 6, 7, 8]])
    >>> full, ctx = emb(ids)
    >>> head, ctx2 = emb(ids[:, :3])
    >>> tail, _ = emb(ids[:, 3:], context=ctx2)
    >>> full.shape, torch.equal(full[:, 3:], tail), ctx.tolist()
    (torch.Size([1, 4, 8]), True, [[7, 8]])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["NGramEmbedding", "NGramOutput", "ngram_hash_tables", "ngram_ids", "ngram_multipliers", "shifted_tokens"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment
_LAYER_STRIDE = 10007  # seeds of consecutive PLE layers are this far apart


def _splitmix64(z: int) -> int:
    """One SplitMix64 output for the state ``z`` (Steele, Lea, Flood 2014): increment, then two xor-shift-multiply
    rounds."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    """The ``ngram_size`` odd hash multipliers of PLE layer ``ple_layer_index``: each below ``(2**63 - 1) //
    vocab_size``, so ``token * m`` never overflows int64.

    Example:
        >>> all(m % 2 == 1 for m in ngram_multipliers(1000, 3, 0, 1234))
        True
    """
    bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * ple_layer_index
    return [2 * (_splitmix64((base + _GOLDEN * (s + 1)) & _MASK64) % bound) + 1 for s in range(ngram_size)]


def _prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def ngram_hash_tables(ngram_vocab_size_base: int, n_heads: int, ple_layer_index: int) -> tuple[list[int], list[int]]:
    """``(sizes, offsets)`` of the ``n_heads`` hash tables of PLE layer ``ple_layer_index``: head ``h`` takes the
    ``(ple_layer_index * n_heads + h + 1)``-th prime at or above ``ngram_vocab_size_base``; the tables sit one after
    the other in one embedding (offsets from 0).

    Example:
        >>> ngram_hash_tables(10, 3, 0)
        ([11, 13, 17], [0, 11, 24])
    """
    p, skip = ngram_vocab_size_base - 1, ple_layer_index * n_heads
    sizes: list[int] = []
    while len(sizes) < n_heads:
        p += 1
        while not _prime(p):
            p += 1
        if skip:
            skip -= 1
        else:
            sizes.append(p)
    offsets = [sum(sizes[:h]) for h in range(n_heads)]
    return sizes, offsets


def shifted_tokens(history: torch.Tensor, shift: int, eos_token_id: int) -> torch.Tensor:
    """``t_s`` of the module notes for ``s = shift`` over a token history (B, L): ``history[:, i - shift]`` where
    no EOS lies strictly between it and ``i`` (and ``i - shift >= 0``), EOS elsewhere.

    Example:
        >>> shifted_tokens(torch.tensor([[4, 5, 1, 6, 7]]), 2, eos_token_id=1).tolist()
        [[1, 1, 4, 1, 1]]
    """
    if shift == 0:
        return history
    B, L = history.shape
    idx = torch.arange(L, device=history.device)
    eos_at = torch.where(history == eos_token_id, idx, -1)
    last_eos = torch.cummax(eos_at, dim=1).values  # (B, L) the last EOS at or before each column
    before = torch.cat((last_eos.new_full((B, 1), -1), last_eos[:, :-1]), dim=1)  # strictly before
    src = idx - shift
    ok = before < src  # no EOS in [i - shift, i); implies i - shift >= 0 (an EOS at i - shift reads as EOS anyway)
    got = history.gather(1, src.clamp_min(0).expand(B, L))
    return torch.where(ok, got, torch.full_like(history, eos_token_id))


def ngram_ids(history: torch.Tensor, *, multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor,
              ngram_size: int, heads_per_ngram: int, eos_token_id: int) -> torch.Tensor:
    """Embedding rows (B, L, (ngram_size - 1) * heads_per_ngram) of every column of a token history (B, L) int64:
    the orders 2 .. ngram_size one after the other, ``heads_per_ngram`` heads each (module notes)."""
    shifted = [shifted_tokens(history, s, eos_token_id) * multipliers[s] for s in range(ngram_size)]
    blocks, mixed = [], shifted[0]
    for n in range(2, ngram_size + 1):
        mixed = torch.bitwise_xor(mixed, shifted[n - 1])
        heads = slice((n - 2) * heads_per_ngram, (n - 1) * heads_per_ngram)
        blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes[heads]) + offsets[heads])
    return torch.cat(blocks, dim=-1)


class NGramOutput(NamedTuple):
    """``embeddings`` (B, N, embedding_dim) of the new tokens; ``context`` (B, ngram_size - 1) int64, the last tokens
    of each row to carry into the next call."""

    embeddings: torch.Tensor
    context: torch.Tensor


class NGramEmbedding(nn.Module):
    """Hashed n-gram embeddings of one PLE layer (module notes). Parameter and buffer names are HF's
    (``ngram_embedding``, ``layer_multipliers``, ``ngram_heads_vocab_sizes``, ``ngram_heads_offsets``).

    Args:
        vocab_size: the token vocabulary (bounds the multipliers).
        embedding_dim: width of the concatenated heads; a multiple of ``(ngram_size - 1) * heads_per_ngram``.
        ngram_size: the longest n-gram (>= 2). heads_per_ngram: hash heads per order.
        ngram_vocab_size_base: the first table size tried (tables are primes at or above it).
        eos_token_id: the token n-grams do not cross, also what precedes a sequence.
        ple_layer_index: this layer's rank among the model's PLE layers (seeds and table primes differ per layer).
        seed: the hash seed. pad_to: the table's row count is rounded up to a multiple of it.

    ``forward(input_ids, context=None)`` -> :class:`NGramOutput`; ``context`` (B, ngram_size - 1) is the previous
    call's (None: a fresh row, EOS before it).
    """

    def __init__(self, *, vocab_size: int, embedding_dim: int, ngram_size: int, heads_per_ngram: int,
                 ngram_vocab_size_base: int, eos_token_id: int, ple_layer_index: int = 0, seed: int = 1234,
                 pad_to: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        for name, v, low in (("vocab_size", vocab_size, 1), ("embedding_dim", embedding_dim, 1),
                             ("ngram_size", ngram_size, 2), ("heads_per_ngram", heads_per_ngram, 1),
                             ("ngram_vocab_size_base", ngram_vocab_size_base, 2), ("eos_token_id", eos_token_id, 0),
                             ("ple_layer_index", ple_layer_index, 0), ("pad_to", pad_to, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"NGramEmbedding: {name} must be an int >= {low}, got {v!r}")
        n_heads = (ngram_size - 1) * heads_per_ngram
        if embedding_dim % n_heads:
            raise ValueError(f"NGramEmbedding: embedding_dim={embedding_dim} must be a multiple of the n-gram heads "
                             f"(ngram_size - 1) * heads_per_ngram = {n_heads}")
        self.ngram_size, self.heads_per_ngram, self.eos_token_id = ngram_size, heads_per_ngram, eos_token_id
        self.context_len = ngram_size - 1
        sizes, offsets = ngram_hash_tables(ngram_vocab_size_base, n_heads, ple_layer_index)
        self.register_buffer("layer_multipliers",
                             torch.tensor(ngram_multipliers(vocab_size, ngram_size, ple_layer_index, seed)))
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes))
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets))
        rows = -(-sum(sizes) // pad_to) * pad_to
        self.ngram_embedding = nn.Embedding(rows, embedding_dim // n_heads, device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, context: torch.Tensor | None = None) -> NGramOutput:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            seen = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else input_ids
            raise ValueError(f"NGramEmbedding: input_ids must be an integer tensor (B, N), got {seen}")
        B, N = input_ids.shape
        ids = input_ids.long()
        C = self.context_len
        if context is None:
            context = ids.new_full((B, C), self.eos_token_id)
        elif tuple(context.shape) != (B, C):
            raise ValueError(f"NGramEmbedding: context must be the previous call's (B, ngram_size - 1) = {(B, C)} "
                             f"tokens, got {tuple(context.shape)}")
        history = torch.cat((context.to(ids), ids), dim=1)  # (B, C + N)
        rows = ngram_ids(history, multipliers=self.layer_multipliers, sizes=self.ngram_heads_vocab_sizes,
                         offsets=self.ngram_heads_offsets, ngram_size=self.ngram_size,
                         heads_per_ngram=self.heads_per_ngram, eos_token_id=self.eos_token_id)[:, C:]
        return NGramOutput(self.ngram_embedding(rows).flatten(-2), history[:, -C:])

    def extra_repr(self) -> str:
        return (f"ngram_size={self.ngram_size}, heads_per_ngram={self.heads_per_ngram}, "
                f"rows={self.ngram_embedding.num_embeddings}, eos_token_id={self.eos_token_id}")
