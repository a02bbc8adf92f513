"""The score-modifier protocol: a finite term added to, or a transform of, each attention score.

Scores are ``scale * q.k``, then every score modifier in order, then the mask. A modifier is evaluated
through ``apply(score, b, h, q_idx, kv_idx, nq, nk)`` on broadcastable index tensors (the same shape
of call as masks, so the reference, tiled and Flex backends share it). Positions follow the contract:
query row ``i`` sits at position ``i + nk - nq``.

Additive modifiers (ALiBi, relative bias, tensor bias) also expose ``bias(b, h, q_idx, kv_idx, nq, nk)``,
which lets a backend that only takes an additive float mask (torch SDPA) honour them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ScoreMod", "Chain", "as_score_mod"]


class ScoreMod:
    """Base of every score modifier; subclass it for a custom one.

    Override ``apply(score, b, h, q_idx, kv_idx, nq, nk)``: it receives the scores (``scale * q.k`` after the
    modifiers before it) and broadcastable integer index tensors (batch row, query head, query row, key
    column; query row ``i`` sits at position ``i + nk - nq``), and returns the new scores, finite wherever
    the input is. An additive modifier sets ``additive = True`` and overrides ``bias(b, h, q_idx, kv_idx, nq,
    nk)`` instead (then ``apply`` adds it, and backends that only take an additive float mask can honour
    it). ``batch`` is the batch size it carries data for, if any.

    Example:
        >>> import torch, qkv
        >>> class Distance(qkv.mods.ScoreMod):
        ...     additive = True
        ...     def bias(self, b, h, q_idx, kv_idx, nq, nk):
        ...         return -0.1 * ((q_idx + nk - nq) - kv_idx).abs().float()
        >>> q = k = v = torch.randn(1, 2, 5, 8)
        >>> qkv.attention(q, k, v, score_mod=Distance(), backend="reference").shape
        torch.Size([1, 2, 5, 8])
    """

    #: True when ``apply(s) == s + bias(...)``.
    additive: bool = False
    #: Batch size the modifier carries data for (None = same for every row).
    batch: int | None = None

    def apply(self, score, b, h, q_idx, kv_idx, nq: int, nk: int) -> torch.Tensor:
        if self.additive:
            return score + self.bias(b, h, q_idx, kv_idx, nq, nk)
        raise NotImplementedError

    def bias(self, b, h, q_idx, kv_idx, nq: int, nk: int) -> torch.Tensor:
        raise TypeError(f"{self!r} is not an additive score modifier")

    def check(self, B: int, H: int, nq: int, nk: int) -> None:
        """Raise ``ValueError`` when the modifier cannot apply to a (B, H, nq, nk) problem."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Tensors the modifier reads (learnable ones receive gradients through every backend)."""
        return ()

    def dense_bias(self, B: int, H: int, nq: int, nk: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
        """The additive term as a dense (B or 1, H, nq, nk) tensor."""
        b = torch.arange(self.batch or 1, device=device).view(-1, 1, 1, 1)
        h = torch.arange(H, device=device).view(1, -1, 1, 1)
        qi = torch.arange(nq, device=device).view(1, 1, -1, 1)
        kj = torch.arange(nk, device=device).view(1, 1, 1, -1)
        out = self.bias(b, h, qi, kj, nq, nk).to(dtype)
        return torch.broadcast_to(out, (out.shape[0] if out.dim() == 4 else 1, H, nq, nk))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Chain(ScoreMod):
    """Several modifiers applied in order."""

    def __init__(self, mods: Sequence[ScoreMod]) -> None:
        self.mods = tuple(mods)
        self.additive = all(m.additive for m in self.mods)
        sizes = {m.batch for m in self.mods if m.batch not in (None, 1)}
        if len(sizes) > 1:
            raise ValueError(f"score_mod: modifiers carry different batch sizes {sorted(sizes)}")
        self.batch = sizes.pop() if sizes else None

    def apply(self, score, b, h, q_idx, kv_idx, nq, nk):
        for m in self.mods:
            score = m.apply(score, b, h, q_idx, kv_idx, nq, nk)
        return score

    def bias(self, b, h, q_idx, kv_idx, nq, nk):
        out = self.mods[0].bias(b, h, q_idx, kv_idx, nq, nk)
        for m in self.mods[1:]:
            out = out + m.bias(b, h, q_idx, kv_idx, nq, nk)
        return out

    def check(self, B, H, nq, nk):
        for m in self.mods:
            m.check(B, H, nq, nk)

    def tensors(self):
        return tuple(t for m in self.mods for t in m.tensors())

    def __repr__(self):
        return " -> ".join(repr(m) for m in self.mods)


def as_score_mod(score_mod) -> ScoreMod | None:
    """Normalize the ``score_mod`` argument: None, one modifier, or a sequence applied in order."""
    if score_mod is None:
        return None
    if isinstance(score_mod, ScoreMod):
        return score_mod
    if isinstance(score_mod, (list, tuple)):
        if not score_mod:
            return None
        bad = [type(m).__name__ for m in score_mod if not isinstance(m, ScoreMod)]
        if bad:
            raise TypeError(f"score_mod: every item must be a qkv.mods modifier, got {bad}; "
                            "wrap a function with qkv.mods.from_fn(fn)")
        return score_mod[0] if len(score_mod) == 1 else Chain(score_mod)
    if callable(score_mod):
        raise TypeError("score_mod: got a bare function; wrap it as qkv.mods.from_fn(fn) with "
                        "fn(score, b, h, q_idx, kv_idx) -> score")
    raise TypeError(f"score_mod: expected a qkv.mods modifier or a list of them, got {type(score_mod).__name__}")
