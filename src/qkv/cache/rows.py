"""What :class:`qkv.cache.KVCache` asks of the storage's row manager: the rows' lengths, a step's allocation,
crops, reorders, recycled rows, prefix matching. Paged storage answers with its block manager
(:class:`qkv.cache.paged.BlockManager`); dense storages (``Dynamic``, ``Static``) keep every row in lockstep in
their own buffers and answer with :class:`DenseRows`, whose operations do nothing and whose paged-only
capabilities say why they are refused. The cache calls the same methods either way.

Example:
    >>> rows = DenseRows("dynamic")
    >>> rows.rows, rows.selected, rows.cannot_drop(3), rows.step_in_progress()
    (0, None, None, False)
    >>> print(rows.refusal("pool_stats"))
    pool_stats: only paged caches have a block pool
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["RowManager", "DenseRows"]


@runtime_checkable
class RowManager(Protocol):
    """The row bookkeeping a :class:`qkv.cache.KVCache` delegates to its storage.

    ``rows``: rows the manager holds (0: the layers' stores say); ``selected``: the rows steps feed
    (``KVCache.step_rows``), None for every row."""

    rows: int
    selected: list[int] | None

    def refusal(self, what: str) -> str | None:
        """Why ``what`` (``"open_rows"``, ``"admit_row"``, ``"release_row"``, ``"step_rows"``, ``"match_prefix"``,
        ``"pool_stats"``) cannot be done with this storage, as a full error message; None when it can."""
        ...

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Allocate the next step's slots before the forward pass (or do nothing)."""
        ...

    def cannot_drop(self, n: int) -> str | None:
        """Why the last ``n`` slots cannot be dropped, or None."""
        ...

    def drop_last(self, n: int) -> None: ...

    def reorder(self, idx: list[int]) -> None: ...

    def reset(self) -> None: ...

    def step_in_progress(self) -> bool:
        """True while some layer has not yet written the step allocated last."""
        ...

    def open_rows(self, n: int) -> None: ...

    def admit_row(self, b: int, prompt_ids: list[int] | None, salt=None) -> int: ...

    def release_row(self, b: int) -> None: ...

    def select(self, rows: list[int] | None) -> None: ...

    def widen(self, positions: torch.Tensor, input_ids: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def match_prefix(self, input_ids: torch.Tensor, positions: torch.Tensor, *, salt=None) -> torch.Tensor: ...

    def stats(self) -> dict: ...

    def can_admit(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> bool:
        """Whether a request fits next to the rows promised blocks (a scheduler's admission test)."""
        ...

    def never_fits(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> str | None: ...

    def reserve(self, b: int, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> None:
        """Promise row ``b`` the blocks of such a request until it is released (before its prompt is attached)."""
        ...


class DenseRows:
    """The row manager of dense storage: nothing to allocate, crop, reorder or reset beyond the layers' own stores
    (no-ops); recycling single rows, prefix matching and pool statistics are refused (:meth:`refusal` says why,
    and the methods raise it).

    Args:
        storage: the storage's description (``Dynamic().describe()``), named in the refusals.
    """

    rows = 0
    selected = None

    def __init__(self, storage: str) -> None:
        self.storage = storage

    def refusal(self, what: str) -> str | None:
        if what == "pool_stats":
            return "pool_stats: only paged caches have a block pool"
        if what == "match_prefix":
            return f"match_prefix: needs storage=Paged(..., prefix_caching=True), this cache uses {self.storage}"
        return (f"{what}: recycling single rows needs storage=Paged(...) (block tables per row); this cache uses "
                f"{self.storage} storage. Build KVCache(model, storage=Paged(...))")

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        pass

    def cannot_drop(self, n: int) -> str | None:
        return None

    def drop_last(self, n: int) -> None:
        pass

    def reorder(self, idx: list[int]) -> None:
        pass

    def reset(self) -> None:
        pass

    def step_in_progress(self) -> bool:
        return False

    def _refuse(self, what: str):
        raise ValueError(self.refusal(what))

    def open_rows(self, n: int) -> None:
        self._refuse("open_rows")

    def admit_row(self, b: int, prompt_ids: list[int] | None, salt=None) -> int:
        self._refuse("admit_row")

    def release_row(self, b: int) -> None:
        self._refuse("release_row")

    def select(self, rows: list[int] | None) -> None:
        self._refuse("step_rows")

    def widen(self, positions: torch.Tensor, input_ids: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return positions, input_ids

    def match_prefix(self, input_ids: torch.Tensor, positions: torch.Tensor, *, salt=None) -> torch.Tensor:
        self._refuse("match_prefix")

    def stats(self) -> dict:
        self._refuse("pool_stats")

    def can_admit(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> bool:
        self._refuse("can_admit")

    def never_fits(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> str | None:
        self._refuse("never_fits")

    def reserve(self, b: int, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> None:
        self._refuse("reserve_row")
