"""Learned absolute position embeddings: a trainable table of ``max_positions`` rows added to the token
embeddings (Gehring et al. 2017, "Convolutional Sequence to Sequence Learning"; BERT and GPT-2 use it).

Unlike the sinusoidal encoding or RoPE it cannot extrapolate: a position at or past ``max_positions``
has no row, and asking for one raises ``ValueError``.

Shape legend: B batch, N tokens, d model width.

Example:
    >>> import torch
    >>> from qkv.pos import LearnedPositionalEmbedding
    >>> pe = LearnedPositionalEmbedding(32, 8)
    >>> pe(torch.arange(5)).shape
    torch.Size([5, 8])
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LearnedPositionalEmbedding", "learned_positions"]


def learned_positions(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` (P, d) at ``positions`` (any integer shape); negative positions (padding) read row 0.

    Raises ``ValueError`` for a position ``>= P``.
    """
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"learned positions: positions must be an integer tensor, got dtype {positions.dtype}")
    if positions.numel() and int(positions.max()) >= table.shape[0]:
        raise ValueError(
            f"learned positions: position {int(positions.max())} is past the table's {table.shape[0]} rows "
            f"(max_position_embeddings={table.shape[0]}); learned absolute positions cannot extrapolate. Build "
            "the model with a larger max_position_embeddings, or use RoPE/ALiBi/sinusoidal positions."
        )
    return nn.functional.embedding(positions.clamp_min(0), table)


class LearnedPositionalEmbedding(nn.Module):
    """A trainable (max_positions, d_model) table.

    Args:
        max_positions: number of positions with a row (HF ``max_position_embeddings``).
        d_model: embedding width.

    ``forward(positions)``: integer tensor of any shape, e.g. (N,) or (B, N) -> ``positions.shape + (d,)``.
    """

    def __init__(self, max_positions: int, d_model: int) -> None:
        super().__init__()
        if max_positions <= 0 or d_model <= 0:
            raise ValueError(f"LearnedPositionalEmbedding: sizes must be positive, got max_positions="
                             f"{max_positions}, d_model={d_model}")
        self.weight = nn.Parameter(torch.randn(max_positions, d_model) * 0.02)

    @property
    def max_positions(self) -> int:
        return self.weight.shape[0]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return learned_positions(self.weight, positions)

    def extra_repr(self) -> str:
        return f"max_positions={self.weight.shape[0]}, d_model={self.weight.shape[1]}"
