"""Causal masks with explicit alignment, and sliding windows.

Bottom-right alignment (the default, the KV-cache convention): query row ``i`` sits at position
``p = i + Nk - Nq`` and sees keys ``j <= p``. Top-left alignment: ``p = i``. With ``Nq == Nk`` they agree.
A sliding window (Beltagy et al. 2020, "Longformer"; Child et al. 2019) lets position ``p`` see keys
``p - left .. p + right``: ``left + 1`` keys when ``right = 0``, FlashAttention's ``window_size``
convention; HF's ``sliding_window = W`` is ``left = W - 1``.

Example:
    >>> from qkv import masks
    >>> print(masks.causal().draw(3, 5))
    xxx..
    xxxx.
    xxxxx
"""

from __future__ import annotations

from .base import Mask, classify, tile_grid

__all__ = ["causal", "sliding_window", "Causal", "SlidingWindow"]

_ALIGNS = ("bottom_right", "top_left")


class Causal(Mask):
    def __init__(self, align: str = "bottom_right") -> None:
        if align not in _ALIGNS:
            raise ValueError(f"causal: align must be one of {_ALIGNS}, got {align!r}")
        self.align = align

    def _offset(self, nq: int, nk: int) -> int:
        return nk - nq if self.align == "bottom_right" else 0

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        return kv_idx <= q_idx + self._offset(nq, nk)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        p_lo, p_hi, k_lo, k_hi = tile_grid(nq, nk, bq, bk, device)
        shift = self._offset(nq, nk) - (nk - nq)  # tile_grid is bottom-right; move to this alignment
        return classify(k_hi <= p_lo + shift, k_lo <= p_hi + shift)

    def __repr__(self):
        return "causal()" if self.align == "bottom_right" else "causal(align='top_left')"


class SlidingWindow(Mask):
    def __init__(self, left: int, right: int = 0) -> None:
        for name, v in (("left", left), ("right", right)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"sliding_window: {name} must be an int, got {type(v).__name__}")
            if v < 0:
                raise ValueError(f"sliding_window: {name} must be >= 0, got {v}; "
                                 "left=W-1 keeps W keys (HF sliding_window=W)")
        self.left, self.right = left, right

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        p = q_idx + (nk - nq)
        return (kv_idx >= p - self.left) & (kv_idx <= p + self.right)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        p_lo, p_hi, k_lo, k_hi = tile_grid(nq, nk, bq, bk, device)
        full = (k_lo >= p_hi - self.left) & (k_hi <= p_lo + self.right)
        some = (k_hi >= p_lo - self.left) & (k_lo <= p_hi + self.right)
        return classify(full, some)

    def __repr__(self):
        return f"sliding_window({self.left}, {self.right})"


def causal(align: str = "bottom_right") -> Causal:
    """Causal mask. ``align="bottom_right"`` (default) puts the last query at the last key;
    ``"top_left"`` puts the first query at the first key."""
    return Causal(align)


def sliding_window(left: int, right: int = 0) -> SlidingWindow:
    """Keys within ``left`` positions before and ``right`` after the query's position (inclusive).

    With the default ``right=0`` the window never reaches future keys, so it needs no extra causal mask.
    """
    return SlidingWindow(left, right)
