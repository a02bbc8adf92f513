"""ALiBi slopes for any head count: Press et al. 2022, "Train Short, Test Long: Attention with Linear
Biases Enables Input Length Extrapolation".

Head ``h`` penalizes the score of query position ``p`` and key ``j`` by ``slope[h] * (p - j)``. For ``n``
heads, ``n`` a power of two, the slopes are the geometric sequence ``2^(-8 i / n)``, ``i = 1 .. n``
(``1/2, 1/4, ..., 1/256`` for 8 heads). Otherwise (section 3 of the paper) take the slopes of the closest
power of two below ``n``, ``m``, then every other slope of ``2m`` (the 1st, 3rd, ...) until there are ``n``.

The bias itself is the score modifier :func:`qkv.mods.alibi`; :class:`ALiBiBias` wraps it as a
positional module that also reads explicit positions (KV caches whose slots are not in order).

Example:
    >>> import torch, qkv
    >>> from qkv.pos import alibi_slopes
    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    >>> q = k = v = torch.randn(1, 4, 8, 16)
    >>> qkv.attention(q, k, v, mask=qkv.masks.causal(), score_mod=qkv.mods.alibi(alibi_slopes(4))).shape
    torch.Size([1, 4, 8, 16])
"""

from __future__ import annotations

import math

import torch

from .. import mods
from ..mods.base import ScoreMod
from .relative import PositionalBias, RelativePositionMod

__all__ = ["alibi_slopes", "ALiBiBias"]


def _geometric(n: int) -> list[float]:
    return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]


def alibi_slopes(n_heads: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The paper's per-head slopes, shape (n_heads,).

    Example:
        >>> alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
        True
    """
    if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads <= 0:
        raise ValueError(f"alibi_slopes: n_heads must be a positive int, got {n_heads!r}")
    m = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = _geometric(m) + _geometric(2 * m)[0::2][: n_heads - m]
    return torch.tensor(slopes, dtype=torch.float64, device=device).to(dtype)


class ALiBiBias(PositionalBias):
    """ALiBi as a positional module for :class:`qkv.nn.MultiHeadAttention` (no parameters).

    Args:
        n_heads: query heads (one slope each).
        bidirectional: penalize ``|p - j|`` (encoders) instead of ``p - j`` (causal decoders).

    ``forward(q, *, scale=None, q_positions=None, kv_positions=None) -> ScoreMod``: without positions it
    is exactly ``qkv.mods.alibi(slopes)`` (positions from the operator's bottom-right convention); with
    positions (B, Nq) / (B, Nk) the distance is ``q_position - kv_position``.
    """

    def __init__(self, n_heads: int, *, bidirectional: bool = False) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def forward(self, q=None, *, scale=None, q_positions=None, kv_positions=None) -> ScoreMod:
        slopes = self.slopes.float()
        if q_positions is None and kv_positions is None:
            return mods.alibi(slopes, bidirectional=self.bidirectional)
        bidirectional = self.bidirectional

        def term(dist, b, h, q_idx):  # dist = j - p
            d = dist.to(slopes.dtype)
            return -slopes[h] * d.abs() if bidirectional else slopes[h] * d

        return RelativePositionMod(term, q_positions=q_positions, kv_positions=kv_positions, tensors=(slopes,),
                                   name=f"alibi(H={slopes.shape[0]}, positions)")

    def extra_repr(self) -> str:
        return f"n_heads={self.slopes.shape[0]}, bidirectional={self.bidirectional}"
