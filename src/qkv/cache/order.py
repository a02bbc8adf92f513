"""Position order of cache writes: every row's real positions (``>= 0``) must strictly increase, within a step
and from one step to the next, so no two cached keys share a position. ``crop`` (rollback), ``reorder``,
``fork`` and ``reset`` are the documented ways back; after them the next step is checked within itself only.

The check runs once per step, not once per layer: every layer of one step receives the same positions, so a
write whose positions are the very tensor (same object, unmodified) or equal to the step just checked is
another layer of that step. (So layers are written step by step, all layers of a step before the next step,
as every decoder does.)
"""

from __future__ import annotations

import torch

__all__ = ["PositionOrder"]


class PositionOrder:
    """The highest position each row has written, and the last step's positions."""

    def __init__(self) -> None:
        self.forget()

    def forget_rows(self, rows: list[int]) -> None:
        """Rows recycled for new sequences (``KVCache.release_row``/``admit_row``): their history is reset, the
        other rows' is kept. The next step is a new one, whatever its positions."""
        if self._after is not None and rows:
            self._after = self._after.clone()
            self._after[rows] = -1
        self._step, self._key = None, None

    def forget(self) -> None:
        """After crop/reorder/fork/reset: the rows' history is no longer known."""
        self._before: torch.Tensor | None = None  # (B,) highest position before the last step, -1 if none
        self._after: torch.Tensor | None = None  # (B,) highest position after it
        self._step: torch.Tensor | None = None  # the last step's positions (B, N)
        self._key: tuple | None = None  # (the positions object the caller passed, its version)

    def check(self, given: torch.Tensor, pos: torch.Tensor, *, owner: str = "update") -> None:
        """Raise ``ValueError`` (before anything is written) when ``pos`` (B, N) repeats or goes back."""
        if pos.shape[1] == 0:
            return
        key = (given, given._version) if isinstance(given, torch.Tensor) and not given.is_inference() else None
        if key is not None and self._key is not None and given is self._key[0] and key[1] == self._key[1]:
            return
        if self._step is not None and pos.shape == self._step.shape and torch.equal(pos, self._step):
            self._key = key
            return
        B = pos.shape[0]
        start = self._after if self._after is not None and self._after.shape[0] == B else None
        if start is None:
            start = torch.full((B,), -1, dtype=pos.dtype, device=pos.device)
        real = pos >= 0
        run = torch.cummax(torch.where(real, pos, -1), dim=1).values  # (B, N) highest so far in the step
        prev = torch.maximum(torch.cat([start.view(B, 1).to(pos.device), run[:, :-1]], dim=1), start.view(B, 1))
        bad = real & (pos <= prev)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{owner}: positions must increase along each row, but row {row} writes position "
                             f"{int(pos[row, col])} at step column {col} after position {int(prev[row, col])} was "
                             "already written; two keys at one position would both be attended. To rewrite the "
                             "tail use cache.crop(length) first (or a fresh cache / cache.reset())")
        self._before = start
        self._after = torch.maximum(start, run[:, -1])
        self._step, self._key = pos.clone(), key
