"""Simple per-head pattern scores on captured attention maps.

- previous-token: mean attention of token ``i`` to token ``i - 1``;
- first-token: mean attention to position 0, the "attention sink" (Xiao et al. 2023, "Efficient Streaming
  Language Models with Attention Sinks");
- induction: on a random sequence repeated twice, mean attention of token ``i`` in the second copy to the
  token right after its earlier occurrence, ``i - T + 1`` (Olsson et al. 2022, "In-context Learning and
  Induction Heads");
- entropy: mean row entropy in nats (low: focused heads, ``log N``: uniform).

Every score takes the maps of :func:`qkv.interpret.capture` (a list of (B, H, N, N), all rows) and returns
(L, H) float32, averaged over batch rows and query rows; ``valid`` (B, N) bool leaves padding rows out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["previous_token_score", "first_token_score", "induction_score", "entropy_score", "induction_maps"]


def _check(maps: Sequence[torch.Tensor], fn: str) -> None:
    if not maps:
        raise ValueError(f"{fn}: need at least one layer of maps")
    for a in maps:
        if not isinstance(a, torch.Tensor) or a.dim() != 4 or a.shape[-1] != a.shape[-2]:
            raise ValueError(f"{fn}: maps must be (B, H, N, N) self-attention with every row captured, got "
                             f"{tuple(getattr(a, 'shape', ()))}")


def _mean_rows(x_BHN: torch.Tensor, valid: torch.Tensor | None, first: int) -> torch.Tensor:
    x = x_BHN[:, :, first:].double()
    if valid is None:
        return x.mean(dim=(0, 2))
    w = valid[:, first:].to(x.dtype).unsqueeze(1)  # (B, 1, n)
    return (x * w).sum(dim=(0, 2)) / w.sum(dim=(0, 2)).clamp_min(1)


def previous_token_score(maps: Sequence[torch.Tensor], *, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(L, H): mean over rows ``i >= 1`` of ``P[i, i - 1]``."""
    _check(maps, "previous_token_score")
    if maps[0].shape[-1] < 2:
        raise ValueError("previous_token_score: need at least 2 tokens")
    # entry i of the padded diagonal is P[i, i - 1]
    prev = [torch.nn.functional.pad(torch.diagonal(a, offset=-1, dim1=-2, dim2=-1), (1, 0)) for a in maps]
    return torch.stack([_mean_rows(d, valid, 1) for d in prev]).float()


def first_token_score(maps: Sequence[torch.Tensor], *, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(L, H): mean over rows of ``P[i, 0]``."""
    _check(maps, "first_token_score")
    return torch.stack([_mean_rows(a[..., 0], valid, 0) for a in maps]).float()


def entropy_score(maps: Sequence[torch.Tensor], *, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(L, H): mean row entropy ``-sum_j P log P`` in nats."""
    _check(maps, "entropy_score")
    return torch.stack([_mean_rows(-torch.xlogy(a.double(), a.double()).sum(-1), valid, 0) for a in maps]).float()


def induction_score(maps: Sequence[torch.Tensor], period: int) -> torch.Tensor:
    """(L, H): on maps of a sequence that repeats with ``period`` (``x[i] = x[i - period]``), mean over rows
    ``i >= period`` of ``P[i, i - period + 1]``: attention to the token that followed this one last time."""
    _check(maps, "induction_score")
    n = maps[0].shape[-1]
    if not isinstance(period, int) or not 1 <= period < n:
        raise ValueError(f"induction_score: period must be an int in [1, N={n}), got {period!r}")
    return torch.stack([torch.diagonal(a, offset=-(period - 1), dim1=-2, dim2=-1)[..., 1:]  # rows period .. N-1
                        .double().mean(dim=(0, 2)) for a in maps]).float()


def induction_maps(model: nn.Module, vocab_size: int, *, period: int = 32, batch: int = 4, seed: int = 0,
                   low: int = 1, **capture_kwargs) -> tuple[list[torch.Tensor], int]:
    """Capture ``model``'s maps on ``batch`` random sequences of ``period`` token ids in ``[low, vocab_size)``
    each repeated twice; returns ``(maps, period)`` for :func:`induction_score`."""
    from .capture import capture

    if not isinstance(vocab_size, int) or vocab_size <= low + 1:
        raise ValueError(f"induction_maps: vocab_size must be an int > {low + 1}, got {vocab_size!r}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(low, vocab_size, (batch, period), generator=g)
    return capture(model, torch.cat([x, x], dim=1), **capture_kwargs), period
