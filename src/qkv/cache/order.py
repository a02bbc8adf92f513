"""Position order of cache writes: every row's real positions (``>= 0``) must strictly increase, within a step
and from one step to the next, so no two cached keys share a position. ``crop`` (rollback), ``reorder``,
``fork`` and ``reset`` are the documented ways back; after them the next step is checked within itself only.

Progress is tracked per layer. Every layer of one step receives the same positions, so a write whose positions
are the very tensor (same object, unmodified) or equal to the current step's is another layer of that step,
unless that layer already stored it: then it is a retried step (an exception part-way through a forward pass,
then the pass again from layer 0) and is refused, since the layer would keep two keys at one position. A new
step is refused while a layer that stored the previous steps has not stored the current one (its keys would
miss a token). Positions are recorded only after the store accepted the write (:meth:`PositionOrder.commit`),
so a refused write (``CacheFull``, a full ``Static`` buffer) leaves the record as it was.
"""

from __future__ import annotations

import torch

__all__ = ["PositionOrder"]


class PositionOrder:
    """The highest position each row has written, the current step's positions and the layers that stored it."""

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
        self._after: torch.Tensor | None = None  # (B,) highest position after the current step
        self._step: torch.Tensor | None = None  # the current step's positions (B, N)
        self._key: tuple | None = None  # (the positions object the caller passed, its version)
        self._done: set[int] = set()  # layers that stored the current step
        self._seen: set[int] = set()  # layers that stored any step since the last forget()
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (pos, after) checked, not yet committed

    def _key_of(self, given) -> tuple | None:
        return (given, given._version) if isinstance(given, torch.Tensor) and not given.is_inference() else None

    def _same_step(self, given, pos: torch.Tensor) -> bool:
        key = self._key_of(given)
        if key is not None and self._key is not None and given is self._key[0] and key[1] == self._key[1]:
            return True
        return self._step is not None and pos.shape == self._step.shape and torch.equal(pos, self._step)

    def check(self, given, pos: torch.Tensor, *, layer: int = 0, owner: str = "update") -> None:
        """Raise ``ValueError`` (before anything is written) when layer ``layer``'s ``pos`` (B, N) repeats or
        goes back; ``given`` is the positions object the caller passed (for the same-step shortcut)."""
        self._pending = None
        if pos.shape[1] == 0:
            return
        if self._same_step(given, pos):
            if layer in self._done:
                raise ValueError(f"{owner}: layer {layer} already stored this step's positions (row 0: "
                                 f"{pos[0].tolist()[:8]}); storing them again, as when a forward pass is retried "
                                 f"after an exception part-way, would leave two keys at one position, both attended. "
                                 f"Start again from cache.reset() (or a fresh cache), or cache.crop(length) back to "
                                 f"before the step once every layer has stored it")
            return
        missing = sorted(self._seen - self._done)
        if missing:
            raise ValueError(f"{owner}: a new step (row 0 positions {pos[0].tolist()[:8]}) while layer(s) {missing} "
                             f"have not stored the previous step (row 0 positions {self._step[0].tolist()[:8]}), "
                             f"as when a forward pass stopped part-way; their keys would miss those tokens. Finish "
                             f"the step on every layer, or start again from cache.reset() (or a fresh cache)")
        B = pos.shape[0]
        start = self._after if self._after is not None and self._after.shape[0] == B else None
        if start is None:
            start = torch.full((B,), -1, dtype=pos.dtype, device=pos.device)
        start = start.to(pos.device)
        real = pos >= 0
        if pos.shape[1] == 1:  # a decode step: each row's one position against its history only
            prev, last = start.view(B, 1), torch.maximum(start, pos[:, 0])
        else:
            run = torch.cummax(torch.where(real, pos, -1), dim=1).values  # (B, N) highest so far in the step
            prev = torch.maximum(torch.cat([start.view(B, 1), run[:, :-1]], dim=1), start.view(B, 1))
            last = torch.maximum(start, run[:, -1])
        bad = real & (pos <= prev)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{owner}: positions must increase along each row, but row {row} writes position "
                             f"{int(pos[row, col])} at step column {col} after position {int(prev[row, col])} was "
                             "already written; two keys at one position would both be attended. To rewrite the "
                             "tail use cache.crop(length) first (or a fresh cache / cache.reset())")
        self._pending = (pos, last)

    def commit(self, given, pos: torch.Tensor, *, layer: int = 0) -> None:
        """Record that layer ``layer`` stored ``pos``; call it after the store accepted the write that
        :meth:`check` passed."""
        if pos.shape[1] == 0:
            return
        if self._pending is not None and self._pending[0] is pos:
            self._after = self._pending[1]
            self._step, self._key, self._done = pos.clone(), self._key_of(given), set()
        self._pending = None
        self._done.add(layer)
        self._seen.add(layer)
