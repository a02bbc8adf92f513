"""``RecurrentStore``: what :class:`qkv.cache.KVCache` keeps for a :class:`qkv.cache.RecurrentSpec` layer.

A recurrent layer (Gated DeltaNet, Kimi Delta Attention, Mamba2) folds every token into a fixed-size state: the
short convolution's last ``K - 1`` inputs ``conv`` (B, Cc, K - 1) and the gated rule's ``recurrent`` state
(B, H, Dk, Dv). The module reads it with ``cache.recurrent_state(layer_idx)`` and writes the state after its
step with ``cache.update_recurrent(layer_idx, state, tokens=N)``; the store keeps the pair as given (the
module's own state type, any tuple ``(conv, recurrent)``).

What a token-indexed cache can do and a state cannot: dropping the last tokens (``crop``) would need the state
before them, which is gone, and sharing a paged prompt prefix would need the state at the prefix's end. Both are
refused with the layer named. Reordering and forking rows (beam search, n samples) copy the rows' states.

Shape legend: B batch rows, Cc convolution channels, K taps, H heads, Dk key dim, Dv value dim.
"""

from __future__ import annotations

import torch

from .specs import RecurrentSpec
from .storage import Store

__all__ = ["RecurrentStore"]


class RecurrentStore(Store):
    """The state of one recurrent layer for every row, and how many tokens it has consumed (``seen``)."""

    def __init__(self, spec: RecurrentSpec, *, layer: str) -> None:
        self.spec, self.layer = spec, layer
        self.state: tuple | None = None
        self.seen = 0
        self.written: list[bool] = []  # row slots: rows that consumed tokens since they were admitted

    def get(self) -> tuple | None:
        return self.state

    def put(self, state, tokens: int) -> None:
        spec, name = self.spec, self.layer
        parts = 2 + len(spec.side)
        if not (isinstance(state, tuple) and len(state) == parts and all(isinstance(t, torch.Tensor) for t in state)):
            what = "a pair of tensors (conv, recurrent), e.g. a qkv.nn.RecurrentState" if parts == 2 else \
                f"{parts} tensors (conv, recurrent and its side state {spec.side})"
            raise TypeError(f"update_recurrent: {name} takes its state as {what}; got {type(state).__name__}"
                            + (f" of {len(state)}" if isinstance(state, tuple) else ""))
        conv, rec = state[:2]
        B = rec.shape[0] if rec.dim() else 0
        want_conv = (B, spec.conv_dim, spec.conv_kernel - 1)
        want_rec = (B, spec.num_heads, spec.head_k_dim, spec.head_v_dim)
        if tuple(conv.shape) != want_conv or tuple(rec.shape) != want_rec:
            raise ValueError(f"update_recurrent: {name} ({spec}) holds conv (B, conv_dim, conv_kernel - 1) = "
                             f"{want_conv} and recurrent (B, num_heads, head_k_dim, head_v_dim) = {want_rec}; got "
                             f"conv {tuple(conv.shape)}, recurrent {tuple(rec.shape)}")
        for j, (t, shape) in enumerate(zip(state[2:], spec.side)):
            if tuple(t.shape) != (B, *shape) or (t.dtype == torch.int64) != (j < spec.side_ints):
                kind = "int64" if j < spec.side_ints else "floating"
                raise ValueError(f"update_recurrent: {name} ({spec}) holds side state {j} as {kind} (B, *{shape}) = "
                                 f"{(B, *shape)}; got {t.dtype} {tuple(t.shape)}")
        if self.state is not None and B != self.state[1].shape[0]:
            raise ValueError(f"update_recurrent: {name} got batch {B} but the cache holds {self.state[1].shape[0]} "
                             f"rows; use cache.reorder(idx) or cache.fork(n) to change rows")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"update_recurrent: tokens must be an int >= 0 (the tokens this step consumed), got "
                             f"{tokens!r}")
        self.state = state
        self.seen += tokens

    def get_rows(self, rows: list[int] | None, n: int) -> tuple | None:
        """Row slots (``KVCache.open_rows(n)``): the state of ``rows`` (None: all ``n``), zeros for rows that have
        consumed nothing yet; None while none of them has."""
        if self.state is None or not any(self.written[b] for b in (range(n) if rows is None else rows)):
            return None
        if rows is None:
            return self.state
        idx = torch.tensor(rows, dtype=torch.int64, device=self.state[1].device)
        return self._like([t.index_select(0, idx) for t in self.state])

    def put_rows(self, rows: list[int] | None, n: int, state, tokens: int) -> None:
        """Row slots: keep the state a step over ``rows`` (None: all ``n``) left, the other rows unchanged."""
        if self.state is None:
            self.put(state, tokens)  # checks the pair's shapes and counts the tokens
            want = n if rows is None else len(rows)
            if state[1].shape[0] != want:
                self.state, self.seen = None, self.seen - tokens
                raise ValueError(f"update_recurrent: {self.layer} got batch {state[1].shape[0]} but the step feeds "
                                 f"{want} rows")
            if rows is None:
                self.state = self._like([t.clone() for t in state], state)
            else:
                idx = torch.tensor(rows, dtype=torch.int64, device=state[1].device)
                self.state = self._like([t.new_zeros((n, *t.shape[1:])).index_copy_(0, idx, t) for t in state], state)
            self.written = [rows is None or b in rows for b in range(n)]
            return
        if rows is None:
            self.put(state, tokens)
            self.written = [True] * n
            return
        if len(state) != len(self.state) or any(
                t.shape[0] != len(rows) or t.shape[1:] != mine.shape[1:] for t, mine in zip(state, self.state)):
            raise ValueError(f"update_recurrent: {self.layer} holds conv {tuple(self.state[0].shape[1:])} and "
                             f"recurrent {tuple(self.state[1].shape[1:])} per row (and {len(self.state) - 2} side "
                             f"parts) for the {len(rows)} rows of this step; got "
                             f"{[tuple(t.shape) for t in state]}")
        idx = torch.tensor(rows, dtype=torch.int64, device=state[1].device)
        for mine, new in zip(self.state, state, strict=True):
            mine.index_copy_(0, idx, new.to(mine.dtype))
        for b in rows:
            self.written[b] = True
        self.seen += tokens

    def clear_row(self, b: int) -> None:
        """Row slots: row ``b`` starts a new sequence from the zero state."""
        if self.state is not None:
            for t in self.state:
                t[b].zero_()
            self.written[b] = False

    def _like(self, parts: list[torch.Tensor], like=None) -> tuple:
        like = self.state if like is None else like
        return tuple(parts) if type(like) is tuple else type(like)(*parts)

    def cannot_drop(self, n: int) -> str | None:
        return (f"a recurrent layer keeps one state, not its tokens, so it cannot go back {n} tokens; recompute "
                f"from the prompt, or snapshot the state before speculating")

    def drop_last(self, n: int) -> None:
        raise ValueError(f"{self.layer}: {self.cannot_drop(n)}")

    def reorder(self, idx: torch.Tensor) -> None:
        if self.state is not None:
            rows = [t.index_select(0, idx.to(t.device)) for t in self.state]  # copies: forks do not share
            self.state = tuple(rows) if type(self.state) is tuple else type(self.state)(*rows)

    def nbytes(self) -> int:
        return 0 if self.state is None else sum(t.numel() * t.element_size() for t in self.state)

    def used_bytes(self) -> int:
        return self.nbytes()

    def held(self) -> int:
        return 0

    @property
    def batch(self) -> int | None:
        return None if self.state is None else self.state[1].shape[0]
