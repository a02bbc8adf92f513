"""Qwen4-Exp's Per-Layer Embedding (PLE) as data: Qwen Team 2026, "Qwen4-Exp" model card. The module is
:class:`qkv.nn.PerLayerEmbedding` (hashed n-gram embeddings gated into the residual streams).

Example:
    >>> PLEConfig(layers=(0, 4), embed_dim=2048, eos_token_id=1).ngram_heads
    16
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PLEConfig"]


@dataclass(frozen=True, kw_only=True)
class PLEConfig:
    """The PLE of a Qwen4-Exp model, under HF ``Qwen4ExpTextConfig`` field names.

    Args:
        layers: the layers (0-indexed; HF's ``ple_layer_ids`` count from 1) that have a PLE, all recurrent.
        embed_dim: the n-gram embedding width ``E`` (``ple_embed_dim``), a multiple of :attr:`ngram_heads`.
        eos_token_id: the token n-grams do not cross (HF's first ``eos_token_id``).
        conv_kernel_size: taps of the dilated convolution (``ple_conv_kernel_size``).
        ngram_size: the longest n-gram, also the convolution's dilation. heads_per_ngram: hash heads per order.
        ngram_vocab_size_base: the smallest table size (tables are distinct primes from it on).
        pad_to: the table's rows are rounded up to a multiple of this (``make_ngram_vocab_size_divisible_by``).
        seed: the hash seed.
    """

    layers: tuple[int, ...]
    embed_dim: int
    eos_token_id: int
    conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    pad_to: int = 128
    seed: int = 1234

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        for name in ("embed_dim", "conv_kernel_size", "heads_per_ngram", "pad_to"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PLEConfig: {name} must be a positive int, got {value!r}")
        if not isinstance(self.ngram_size, int) or self.ngram_size < 2:
            raise ValueError(f"PLEConfig: ngram_size must be an int >= 2, got {self.ngram_size!r}")
        if not isinstance(self.eos_token_id, int) or self.eos_token_id < 0:
            raise ValueError(f"PLEConfig: eos_token_id must be a token id >= 0 (n-grams stop at it), got "
                             f"{self.eos_token_id!r}")
        if not self.layers or any(not isinstance(i, int) or i < 0 for i in self.layers):
            raise ValueError(f"PLEConfig: layers must be layer indices >= 0 (0-indexed), got {self.layers!r}")
        if self.embed_dim % self.ngram_heads:
            raise ValueError(f"PLEConfig: embed_dim={self.embed_dim} must be a multiple of the n-gram heads "
                             f"(ngram_size - 1) * heads_per_ngram = {self.ngram_heads}")

    @property
    def ngram_heads(self) -> int:
        """Hash heads per PLE layer: ``(ngram_size - 1) * heads_per_ngram``."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    def index_of(self, layer_idx: int) -> int | None:
        """Layer ``layer_idx``'s rank among the PLE layers (it seeds that layer's hashes), or None without a PLE."""
        return self.layers.index(layer_idx) if layer_idx in self.layers else None
