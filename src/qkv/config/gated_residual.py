"""Qwen4-Exp's gated residual hyper-connection as data: Qwen Team 2026, "Qwen4-Exp" model card. The module is
:class:`qkv.nn.GatedResidual`.

Example:
    >>> GatedResidualConfig(streams=4, rank=320).streams
    4
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GatedResidualConfig"]


@dataclass(frozen=True, kw_only=True)
class GatedResidualConfig:
    """The residual streams of every block (HF ``hc_count``, ``hc_lowrank``).

    Args:
        streams: parallel residual streams ``S`` >= 2 (``hc_count``).
        rank: the width of the low-rank input mixer (``hc_lowrank``).
    """

    streams: int
    rank: int

    def __post_init__(self) -> None:
        for name, low in (("streams", 2), ("rank", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"GatedResidualConfig: {name} must be an int >= {low}, got {value!r}")
