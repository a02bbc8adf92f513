"""Feature maps for linear attention: ``phi`` such that ``phi(q) · phi(k)`` stands in for ``exp(q · k)``.

Katharopoulos, Vyas, Pappas, Fleuret, "Transformers are RNNs: Fast Autoregressive Transformers with
Linear Attention", ICML 2020 (arXiv:2006.16236), section 3.2: ``phi(x) = elu(x) + 1``.

A feature map takes ``(B, H, N, D)`` and returns ``(B, H, N, F)``: the same leading dims, any feature
count ``F``. Keeping features positive keeps the normalizer ``phi(q)·sum_j phi(k_j)`` positive.

Shape legend: B batch, H heads, N tokens, D head dim, F features per head.

Example:
    >>> import torch
    >>> from qkv.linear.feature_maps import elu_plus_one, resolve_feature_map
    >>> x = torch.randn(1, 2, 5, 8)
    >>> bool((elu_plus_one(x) > 0).all())
    True
    >>> resolve_feature_map("relu")(x).shape
    torch.Size([1, 2, 5, 8])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["FeatureMap", "FEATURE_MAPS", "elu_plus_one", "relu", "resolve_feature_map"]

FeatureMap = Callable[[torch.Tensor], torch.Tensor]
"""``phi(x_BHND) -> features_BHNF``: keeps the leading ``(B, H, N)`` dims, any last dim."""


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1``: positive everywhere, linear for ``x > 0`` (the paper's choice).

    Args:
        x: ``(..., D)`` floating tensor.

    Returns:
        ``(..., D)``, same dtype, every entry ``> 0``.

    Example:
        >>> import torch
        >>> elu_plus_one(torch.tensor([-1e9, 0.0, 2.0]))
        tensor([0., 1., 3.])
    """
    return F.elu(x).add_(1.0)  # in place: elu's backward needs its input, not its output


def relu(x: torch.Tensor) -> torch.Tensor:
    """``max(x, 0)``. Rows whose features are all zero get a zero normalizer; ``eps`` keeps them finite.

    Args:
        x: ``(..., D)`` floating tensor.

    Returns:
        ``(..., D)``, same dtype, every entry ``>= 0``.

    Example:
        >>> import torch
        >>> relu(torch.tensor([-1.0, 2.0]))
        tensor([0., 2.])
    """
    return F.relu(x)


FEATURE_MAPS: dict[str, FeatureMap] = {"elu_plus_one": elu_plus_one, "relu": relu}


def resolve_feature_map(feature_map: str | FeatureMap | None) -> FeatureMap | None:
    """Turn a name from ``FEATURE_MAPS``, a callable or ``None`` into a callable (or ``None``).

    ``None`` means "q and k are already features" (used by the Performer, which builds its own).

    Args:
        feature_map: ``"elu_plus_one"``, ``"relu"``, a callable ``phi(x) -> features`` or ``None``.

    Returns:
        The callable, or ``None``.

    Example:
        >>> resolve_feature_map("elu_plus_one") is elu_plus_one
        True
    """
    if feature_map is None or callable(feature_map):
        return feature_map
    if isinstance(feature_map, str):
        try:
            return FEATURE_MAPS[feature_map]
        except KeyError:
            raise ValueError(
                f"feature_map={feature_map!r} is not a known feature map; use one of "
                f"{sorted(FEATURE_MAPS)} or pass a callable phi(x) -> features"
            ) from None
    raise TypeError(
        f"feature_map must be a name in {sorted(FEATURE_MAPS)}, a callable or None, "
        f"got {type(feature_map).__name__}"
    )
