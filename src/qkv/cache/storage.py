"""Where a layer's cached tokens live: dynamic contiguous buffers, static preallocated buffers, rings.

Shape legend: B batch rows, H key/value heads, S slots, Dk key width, Dv value width.

A storage is chosen once per cache (``Dynamic()``, ``Static(max_len)``, or ``Paged(...)`` from
:mod:`qkv.cache.paged`) and instantiated per layer from that layer's spec. Contiguous storages keep
the batch in lockstep: every row has the same number of slots and a padding token occupies a slot
whose position is ``-1`` (never attended). Order inside a layer does not matter to attention, because
the protocol masks by position (``masks.positions``), which is what lets a ring buffer work.

- :class:`DynamicStore`: grows by doubling (amortized O(1) per token, no ``torch.cat`` per step). A
  sliding-window layer keeps only its last ``W + rollback`` slots: the window moves by advancing a
  start offset and the live region is shifted to the front only when the buffer's end is reached. A
  step of at least that many tokens (a long prefill) attends over the held tokens and the new ones
  directly and stores only the newest ``W + rollback``, so the layer's memory stays flat in the context
  length from the prefill on.
- :class:`StaticStore`: one buffer of ``max_len`` slots allocated on first write, never reallocated;
  the view is always the whole buffer (empty slots carry position ``-1``), so shapes and addresses
  stay fixed, as CUDA graphs and ``torch.compile`` need (the design of HF's ``StaticCache``; the write
  offset is still a Python int, which a compiled decode step specializes on or marks dynamic).
- :class:`RingStore`: a static ring of ``W + rollback`` slots for a sliding-window layer; token slot
  ``s`` (counting every token written, padding included) lands at ``s mod (W + rollback)``. A
  one-token step returns the ring itself; a longer step returns ring + new tokens (the new tokens
  overwrite keys that earlier queries of the same step still need) and then keeps the newest ones.

Crop (``drop_last``) is exact as long as the layer still holds the keys the next query needs; bounded
layers only hold ``rollback`` spare tokens for that, and say so when asked to drop more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Dynamic", "Static", "DynamicStore", "StaticStore", "RingStore", "Store", "RopeStore", "dynamic_capacity"]


@dataclass(frozen=True)
class Dynamic:
    """Contiguous buffers that grow as tokens arrive (the default storage)."""

    def describe(self) -> str:
        return "dynamic"

    def layer_bytes(self, *, batch: int, prompt: int, new_tokens: int, keep: int | None, row_bytes: float) -> float:
        """Bytes a :class:`DynamicStore` allocates (keys, values, an int64 position per slot) for ``batch``
        rows after a ``prompt``-token step and ``new_tokens`` one-token steps; ``keep``: the slots a bounded
        layer keeps (None: every slot)."""
        return batch * dynamic_capacity(prompt, new_tokens, keep) * (row_bytes + 8)


def dynamic_capacity(prompt: int, new_tokens: int, keep: int | None) -> int:
    """Slots per row a :class:`DynamicStore` has after a ``prompt``-token step and ``new_tokens`` one-token
    steps (its ``_reserve``, replayed on integers)."""
    if prompt + new_tokens == 0:
        return 0
    if keep is None:  # full layers: a full buffer is reallocated at _pow2(2 * (held + 1)), four times its size
        cap = _pow2(max(prompt, 16))
        while prompt + new_tokens > cap:
            cap = _pow2(max(2 * cap, 2 * (cap + 1)))
        return cap
    first = prompt if prompt else 1
    if first > 1 and first >= keep:  # DynamicStore.write's long-step path: only the newest `keep` are stored
        cap, start, end = _pow2(max(keep, 16)), 0, keep
    else:
        cap = _pow2(max(first, 16))
        start, end = max(0, first - keep), first
    for _ in range(new_tokens - (0 if prompt else 1)):
        if end + 1 > cap:
            held = end - start
            if held + 1 > cap // 2:
                cap = _pow2(max(2 * cap, 2 * (held + 1)))
            start, end = 0, held
        end += 1
        start = max(start, end - keep)
    return cap


@dataclass(frozen=True)
class Static:
    """Buffers of ``max_len`` slots per row, allocated once (sliding layers: a ring of ``W`` slots)."""

    max_len: int

    def __post_init__(self) -> None:
        if not isinstance(self.max_len, int) or isinstance(self.max_len, bool) or self.max_len <= 0:
            raise ValueError(f"Static(max_len): expected a positive int (slots per row), got {self.max_len!r}")

    def describe(self) -> str:
        return f"static(max_len={self.max_len})"

    def layer_bytes(self, *, batch: int, keep: int | None, row_bytes: float) -> float:
        """Bytes a static layer allocates for ``batch`` rows: ``max_len`` slots, or a ring of ``keep`` slots
        for a bounded layer that fits, each with keys, values and an int64 position."""
        slots = keep if keep is not None and keep <= self.max_len else self.max_len
        return batch * slots * (row_bytes + 8)


class Store:
    """Per-layer storage. ``write`` stores a step and returns what the step attends over."""

    seen: int = 0  # slots written so far (padding included), the cache's length

    def write(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k (B, H, n, Dk), v (B, H, n, Dv), pos (B, n); return (k_all, v_all, kv_pos (B, S))."""
        raise NotImplementedError

    def write_deferred(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Like :meth:`write` for a step the caller first offers to :meth:`decode`: a store whose decode reads
        its own tensors in place returns ``(None, None, kv_pos)`` and builds the view only when asked
        (:meth:`gather`); default: the view at once."""
        return self.write(k, v, pos)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The view a :meth:`write_deferred` left out, ``(k_all, v_all)``; only stores that defer it have one."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
               window: int | None = None) -> torch.Tensor | None:
        """Causal attention of the step just written over what this store holds, read in place; None (the
        default): the caller attends over the view."""
        return None

    def emptied(self) -> Store | None:
        """After the cache forgot every row: this store, emptied, when it keeps its tensors for the next request
        (paged pools); None (the default): the cache builds a fresh store."""
        return None

    def cannot_drop(self, n: int) -> str | None:
        """Why the last ``n`` slots cannot be dropped exactly, or ``None``."""
        return None

    def drop_last(self, n: int) -> None:
        raise NotImplementedError

    def reorder(self, idx: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``idx[i]`` (``idx`` may repeat rows and change the batch)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes allocated by this layer's tensors."""
        return 0

    def allocated_bytes(self) -> int:
        """Bytes this layer holds for its rows now; default :meth:`nbytes` (a pool's store counts its blocks in
        use)."""
        return self.nbytes()

    def used_bytes(self) -> int:
        """Bytes holding real (non-padding, non-empty) tokens."""
        return 0

    def held(self) -> int:
        """Slots currently held per row."""
        return 0

    def observe(self, q: torch.Tensor, view, *, scale: float | None = None) -> None:
        """See this step's rotated queries after attention (score-based eviction); default: nothing."""
        return None

    def error(self):
        """The largest reconstruction errors so far (:class:`qkv.cache.QuantError`) of a lossy store; None
        for an exact one."""
        return None

    def planned_bytes(self, *, batch: int, peak: int, spec, dtype) -> float | None:
        """Bytes this kind of store allocates for ``batch`` rows whose most tokens held at once is ``peak``
        (for :func:`qkv.cache.plan_memory`); None when it does not say."""
        return None

    @property
    def batch(self) -> int | None:
        return None


class RopeStore(Store):
    """A store that rotates keys itself (StreamingLLM rotates by in-cache position)."""

    def write_rope(self, k, v, pos, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like ``write`` with un-rotated keys; also returns the query positions (B, n)."""
        raise NotImplementedError


def _bytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _window_check(seen: int, held: int, n: int, window: int | None, what: str) -> str | None:
    """A bounded layer holding slots [seen - held, seen) can drop ``n`` if the next query still finds
    the ``window - 1`` keys before it."""
    if window is None:
        return None
    left = seen - n
    needed_from = max(0, left - (window - 1))
    if seen - held > needed_from:
        return (f"{what} keeps the last {held} tokens for window {window}; dropping {n} would need tokens it "
                f"no longer holds (it can roll back {max(held - (window - 1), 0)}). Build the cache with "
                f"rollback >= {n}")
    return None


class DynamicStore(Store):
    """Contiguous buffers (B, H, capacity, D) that grow by doubling; ``keep`` bounds a sliding layer."""

    def __init__(self, *, keep: int | None = None, window: int | None = None, min_capacity: int = 16) -> None:
        self.keep, self.window, self.min_capacity = keep, window, min_capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None  # (B, capacity) int64
        self.start = self.end = self.seen = 0

    @property
    def batch(self) -> int | None:
        return None if self.k is None else self.k.shape[0]

    def _allocate(self, like_k, like_v, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, H, _, Dk = like_k.shape
        k = like_k.new_empty(B, H, capacity, Dk)
        v = like_v.new_empty(B, H, capacity, like_v.shape[-1])
        pos = torch.full((B, capacity), -1, dtype=torch.int64, device=like_k.device)
        return k, v, pos

    def _reserve(self, k, v, n: int) -> None:
        if self.k is None:
            self.k, self.v, self.pos = self._allocate(k, v, _pow2(max(n, self.min_capacity)))
            return
        cap = self.k.shape[2]
        if self.end + n <= cap:
            return
        held = self.end - self.start
        if held + n <= cap // 2:  # room enough after shifting the live region to the front
            self.k[:, :, :held] = self.k[:, :, self.start:self.end].clone()
            self.v[:, :, :held] = self.v[:, :, self.start:self.end].clone()
            self.pos[:, :held] = self.pos[:, self.start:self.end].clone()
        else:
            nk, nv, npos = self._allocate(self.k, self.v, _pow2(max(2 * cap, 2 * (held + n))))
            nk[:, :, :held] = self.k[:, :, self.start:self.end]
            nv[:, :, :held] = self.v[:, :, self.start:self.end]
            npos[:, :held] = self.pos[:, self.start:self.end]
            self.k, self.v, self.pos = nk, nv, npos
        self.pos[:, held:] = -1
        self.start, self.end = 0, held

    def _write_tail(self, k, v, pos):
        """A bounded layer's step of ``n >= keep`` tokens: the step attends over the held tokens and the new
        ones; the buffer keeps only the newest ``keep`` (never sized by the step)."""
        n, keep = k.shape[2], self.keep
        if self.k is not None and self.end > self.start:
            a, b = self.start, self.end
            view = (torch.cat((self.k[:, :, a:b], k), dim=2), torch.cat((self.v[:, :, a:b], v), dim=2),
                    torch.cat((self.pos[:, a:b], pos), dim=1))
        else:
            view = (k, v, pos)
        if self.k is None or self.k.shape[2] < keep:
            self.k, self.v, self.pos = self._allocate(k, v, _pow2(max(keep, self.min_capacity)))
        self.k[:, :, :keep] = k[:, :, n - keep:]
        self.v[:, :, :keep] = v[:, :, n - keep:]
        self.pos[:, :keep] = pos[:, n - keep:]
        self.pos[:, keep:] = -1
        self.start, self.end, self.seen = 0, keep, self.seen + n
        return view

    def write(self, k, v, pos):
        n = k.shape[2]
        if self.keep is not None and n > 1 and n >= self.keep:
            return self._write_tail(k, v, pos)
        self._reserve(k, v, n)
        a, b = self.end, self.end + n
        self.k[:, :, a:b] = k
        self.v[:, :, a:b] = v
        self.pos[:, a:b] = pos
        self.end, self.seen = b, self.seen + n
        view = (self.k[:, :, self.start:b], self.v[:, :, self.start:b], self.pos[:, self.start:b])
        if self.keep is not None:
            self.start = max(self.start, b - self.keep)
        return view

    def cannot_drop(self, n):
        return _window_check(self.seen, self.end - self.start, n, self.window, "a sliding-window layer")

    def drop_last(self, n):
        if n <= 0:
            return
        cut = min(n, self.end - self.start)
        self.pos[:, self.end - cut:self.end] = -1
        self.end -= cut
        self.seen -= n

    def reorder(self, idx):
        if self.k is None:
            return
        self.k, self.v, self.pos = (t.index_select(0, idx) for t in (self.k, self.v, self.pos))

    def nbytes(self):
        return _bytes(self.k, self.v, self.pos)

    def used_bytes(self):
        if self.k is None:
            return 0
        real = int((self.pos[:, self.start:self.end] >= 0).sum())
        H = self.k.shape[1]
        return real * H * (self.k.shape[-1] * self.k.element_size() + self.v.shape[-1] * self.v.element_size())

    def held(self):
        return self.end - self.start


class StaticStore(Store):
    """One (B, H, max_len, D) buffer per tensor, allocated on first write and never reallocated."""

    def __init__(self, max_len: int, *, layer: str = "layer") -> None:
        self.max_len, self.layer = max_len, layer
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.seen = 0

    @property
    def batch(self) -> int | None:
        return None if self.k is None else self.k.shape[0]

    def write(self, k, v, pos):
        n = k.shape[2]
        if self.seen + n > self.max_len:
            raise ValueError(f"Static cache: {self.layer} holds max_len={self.max_len} tokens per row and has "
                             f"{self.seen}; writing {n} more would overflow it. Build the cache with "
                             f"Static(max_len >= {self.seen + n}) or use Dynamic()/Paged() storage")
        if self.k is None:
            B, H, _, Dk = k.shape
            self.k = k.new_zeros(B, H, self.max_len, Dk)
            self.v = v.new_zeros(B, H, self.max_len, v.shape[-1])
            self.pos = torch.full((B, self.max_len), -1, dtype=torch.int64, device=k.device)
        a = self.seen
        self.k[:, :, a:a + n] = k
        self.v[:, :, a:a + n] = v
        self.pos[:, a:a + n] = pos
        self.seen += n
        return self.k, self.v, self.pos

    def drop_last(self, n):
        if n > 0:
            self.pos[:, self.seen - n:self.seen] = -1
            self.seen -= n

    def reorder(self, idx):
        if self.k is None:
            return
        if idx.numel() == self.k.shape[0]:  # same batch: keep the addresses
            for t in (self.k, self.v, self.pos):
                t.copy_(t.index_select(0, idx))
        else:
            self.k, self.v, self.pos = (t.index_select(0, idx) for t in (self.k, self.v, self.pos))

    def nbytes(self):
        return _bytes(self.k, self.v, self.pos)

    def used_bytes(self):
        if self.k is None:
            return 0
        real = int((self.pos >= 0).sum())
        H = self.k.shape[1]
        return real * H * (self.k.shape[-1] * self.k.element_size() + self.v.shape[-1] * self.v.element_size())

    def held(self):
        return self.seen


class RingStore(StaticStore):
    """A static ring of ``capacity = window + rollback`` slots for a sliding-window layer."""

    def __init__(self, capacity: int, *, window: int, layer: str = "layer") -> None:
        super().__init__(capacity, layer=layer)
        self.window = window

    def write(self, k, v, pos):
        n, cap = k.shape[2], self.max_len
        if self.k is None:
            B, H, _, Dk = k.shape
            self.k = k.new_zeros(B, H, cap, Dk)
            self.v = v.new_zeros(B, H, cap, v.shape[-1])
            self.pos = torch.full((B, cap), -1, dtype=torch.int64, device=k.device)
        if n == 1:
            slot = self.seen % cap
            self.k[:, :, slot] = k[:, :, 0]
            self.v[:, :, slot] = v[:, :, 0]
            self.pos[:, slot] = pos[:, 0]
            self.seen += 1
            return self.k, self.v, self.pos
        # Earlier queries of this step need keys that its later tokens overwrite: attend over both.
        view = (torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2), torch.cat([self.pos, pos], dim=1))
        m = min(n, cap)
        slots = torch.arange(self.seen + n - m, self.seen + n, device=k.device) % cap
        self.k.index_copy_(2, slots, k[:, :, n - m:])
        self.v.index_copy_(2, slots, v[:, :, n - m:])
        self.pos.index_copy_(1, slots, pos[:, n - m:])
        self.seen += n
        return view

    def cannot_drop(self, n):
        return _window_check(self.seen, min(self.seen, self.max_len), n, self.window, "a sliding-window ring")

    def drop_last(self, n):
        if n <= 0:
            return
        m = min(n, self.max_len)
        slots = torch.arange(self.seen - m, self.seen, device=self.pos.device) % self.max_len
        self.pos[:, slots] = -1
        self.seen -= n

    def held(self):
        return min(self.seen, self.max_len)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
