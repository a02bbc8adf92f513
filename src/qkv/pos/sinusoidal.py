"""Sinusoidal absolute position encoding: Vaswani et al. 2017, "Attention Is All You Need", section 3.5.

    PE(pos, 2i)     = sin(pos / base^(2i / d))
    PE(pos, 2i + 1) = cos(pos / base^(2i / d))

Sines and cosines interleave, as in the paper's formula (fairseq and tensor2tensor concatenate them
instead; the two differ by a fixed permutation of the channels). No parameters: the encoding is added
to the token embeddings.

Shape legend: B batch, N tokens, d model width.

Example:
    >>> from qkv.pos import sinusoidal_encoding
    >>> pe = sinusoidal_encoding(16, 8)
    >>> pe.shape, float(pe[0, 1])
    (torch.Size([16, 8]), 1.0)
"""

from __future__ import annotations

import torch

__all__ = ["sinusoidal_encoding"]


def sinusoidal_encoding(positions: int | torch.Tensor, d_model: int, *, base: float = 10000.0,
                        dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The sinusoidal table at the given positions.

    Args:
        positions: an int ``N`` (positions ``0 .. N-1``) or an integer tensor of any shape, e.g. (N,) or
            (B, N). Negative positions (padding, as in :mod:`qkv.cache.protocol`) encode as position 0.
        d_model: channels ``d`` (any positive int; an odd ``d`` ends with a sine channel).
        base: the wavelength base, 10000 in the paper.
        dtype: output dtype; the angles are computed in float64.
        device: output device (defaults to the device of a tensor ``positions``).

    Returns:
        ``positions.shape + (d,)`` tensor (``(N, d)`` for an int ``N``).

    Example:
        >>> import torch
        >>> sinusoidal_encoding(torch.tensor([[0, 1, -1]]), 4).shape
        torch.Size([1, 3, 4])
    """
    if not isinstance(d_model, int) or isinstance(d_model, bool) or d_model <= 0:
        raise ValueError(f"sinusoidal_encoding: d_model must be a positive int, got {d_model!r}")
    if isinstance(positions, int) and not isinstance(positions, bool):
        if positions < 0:
            raise ValueError(f"sinusoidal_encoding: a length must be >= 0, got {positions}")
        positions = torch.arange(positions, device=device)
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"sinusoidal_encoding: positions must be an int or an integer tensor, got {positions!r}")
    device = positions.device if device is None else device
    pos = positions.to(device=device, dtype=torch.float64).clamp_min(0).unsqueeze(-1)  # (..., 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)  # (ceil(d/2),)
    angle = pos / base ** (two_i / d_model)  # (..., ceil(d/2))
    out = torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)  # sin, cos interleaved
    return out[..., :d_model].to(dtype)
