"""The shape of manifold-constrained hyper-connections (mHC) as data: Xie et al. 2026, "mHC: Manifold-Constrained
Hyper-Connections", as DeepSeek-V4 uses them (DeepSeek-AI 2026, DeepSeek-V4 report, Section 2.2). The modules are
:mod:`qkv.nn.hyper`.

Example:
    >>> HyperConfig(hc_mult=4).hc_sinkhorn_iters
    20
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HyperConfig"]


@dataclass(frozen=True, kw_only=True)
class HyperConfig:
    """The residual streams of every layer, under HF ``DeepseekV4Config`` field names.

    Args:
        hc_mult: residual streams ``n`` (DeepSeek-V4: 4), each as wide as the model.
        hc_sinkhorn_iters: Sinkhorn-Knopp iterations projecting each mixing matrix onto the doubly stochastic ones
            (20).
        hc_eps: the floor added to the pre/mixing weights and to every Sinkhorn-Knopp denominator (1e-6).
    """

    hc_mult: int
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hc_mult", "hc_sinkhorn_iters"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HyperConfig: {name} must be a positive int, got {value!r}")
        if not isinstance(self.hc_eps, (int, float)) or isinstance(self.hc_eps, bool) or not self.hc_eps >= 0:
            raise ValueError(f"HyperConfig: hc_eps must be a float >= 0, got {self.hc_eps!r}")
