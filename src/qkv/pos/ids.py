"""Position ids: the one check that turns a user's ``positions`` argument into a (B, N) int64 tensor.

Positions are absolute token positions; ``-1`` marks a padding token (stored, never attended). Modules,
models and caches all accept ``(N,)`` (shared by every row) or ``(B, N)``.
"""

from __future__ import annotations

import torch

__all__ = ["batch_positions", "positions_from_padding"]


def batch_positions(positions, B: int, N: int, *, owner: str, device=None) -> torch.Tensor:
    """Validate ``positions`` for a (B, N) input and return it as a (B, N) int64 tensor.

    Args:
        positions: integer tensor (N,) or (B, N) (a (1, N) tensor broadcasts over the batch).
        owner: the caller's name, used in error messages (e.g. ``"MultiHeadAttention"``).

    Example:
        >>> batch_positions(torch.arange(3), 2, 3, owner="demo").shape
        torch.Size([2, 3])
    """
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"{owner}: positions must be an integer tensor (N,) or (B, N), got "
                        f"{type(positions).__name__} {getattr(positions, 'dtype', '')}")
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.dim() != 2 or positions.shape[1] != N or positions.shape[0] not in (1, B):
        raise ValueError(f"{owner}: positions must have shape ({N},) or ({B}, {N}) for an input of batch {B} and "
                         f"length {N}, got {tuple(positions.shape)}")
    return positions.to(device=device or positions.device, dtype=torch.int64).expand(B, N)


def positions_from_padding(real: torch.Tensor) -> torch.Tensor:
    """Positions (B, M) int64 of a (B, M) padding mask (True or 1 for a real token, anywhere in the row): a real
    token's position counts the real tokens before it in its row, a padding token gets ``-1``. The one reading
    of HF's 0/1 ``attention_mask`` as positions (the decoder, ``generate``, varlen packing and the caches use it).

    Example:
        >>> positions_from_padding(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])).tolist()
        [[-1, -1, 0, 1], [0, 1, 2, -1]]
    """
    real = real.to(torch.bool)
    pos = torch.cumsum(real.to(torch.int64), dim=1) - 1
    return torch.where(real, pos, torch.full_like(pos, -1))
