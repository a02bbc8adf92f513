"""What the forms of the gated rules share: input checks, the accumulation dtype and grouped heads.

The four forms of the gated linear rule and of the gated delta rule (``gated_naive``, ``gated_chunk``,
``gated_recurrent``) import this file; the reference (``gated_naive``) imports nothing from its peers.

Shape legend: B batch, Hk query/key heads, H value heads (``H = Hk * r``: value head ``h`` reads key head
``h // r``, the layout of HF's Qwen3-Next and Mamba2's groups), N tokens, Dk key dim, Dv value dim.
"""

from __future__ import annotations

import torch

from qkv.linear._common import acc_dtype

__all__ = ["Prepared", "prepare_gated", "expand_heads", "check_one_token"]


class Prepared:
    """Checked inputs in the accumulation dtype: q, k ``(B, Hk, N, Dk)``, v ``(B, H, N, Dv)``, g ``(B, H, N)``
    or ``(B, H, N, Dk)``, beta ``(B, H, N)`` or None, state ``(B, H, Dk, Dv)`` or None."""

    __slots__ = ("q", "k", "v", "g", "beta", "state", "out_dtype")

    def __init__(self, q, k, v, g, beta, state, out_dtype):
        self.q, self.k, self.v, self.g, self.beta, self.state, self.out_dtype = q, k, v, g, beta, state, out_dtype

    @property
    def per_channel(self) -> bool:
        return self.g.dim() == 4


def expand_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """Repeat key heads ``(B, Hk, ...)`` to the value heads ``(B, H, ...)``: head ``h`` reads ``h // (H // Hk)``."""
    Hk = x.shape[1]
    return x if Hk == H else x.repeat_interleave(H // Hk, dim=1)


def _tensor(name: str, t, fn: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a floating tensor, got dtype {t.dtype}; cast it with .float()")


def prepare_gated(q, k, v, g, beta, state, *, fn: str, state_name: str = "initial_state",
                  delta: bool) -> Prepared:
    """Raise ``TypeError``/``ValueError`` naming the argument, what was seen and the fix; cast to the
    accumulation dtype (float64 for float64 inputs, float32 otherwise)."""
    named = [("q", q), ("k", k), ("v", v), ("g", g)] + ([("beta", beta)] if delta else [])
    for name, t in named:
        _tensor(name, t, fn)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must have rank 4 (B, H, N, D), got shape {tuple(t.shape)}; the layout is "
                             f"(batch, heads, tokens, head_dim), e.g. x.view(B, N, H, D).transpose(1, 2)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ValueError(f"{fn}: inputs must be on one device, got {sorted(str(d) for d in devices)}")
    if q.shape != k.shape:
        raise ValueError(f"{fn}: q and k must have the same shape (B, Hk, N, Dk), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    B, Hk, N, Dk = k.shape
    if v.shape[0] != B or v.shape[2] != N:
        raise ValueError(f"{fn}: v must be (B, H, N, Dv) with k's B={B} and N={N}, got v {tuple(v.shape)}")
    H = v.shape[1]
    if Hk == 0:
        raise ValueError(f"{fn}: q and k have 0 heads (shape {tuple(k.shape)}); the gated rules need at least one "
                         f"query/key head, each read by H // Hk value heads")
    if H % Hk:
        raise ValueError(f"{fn}: v has {H} heads, which is not a multiple of the {Hk} heads of q and k; value head h "
                         f"reads key head h // (H // Hk), so H must be Hk * r")
    if tuple(g.shape) not in ((B, H, N), (B, H, N, Dk)):
        raise ValueError(f"{fn}: g must be (B, H, N) = {(B, H, N)} (one log-decay per value head) or (B, H, N, Dk) "
                         f"= {(B, H, N, Dk)} (one per key channel), got {tuple(g.shape)}")
    if delta and tuple(beta.shape) != (B, H, N):
        raise ValueError(f"{fn}: beta must be (B, H, N) = {(B, H, N)}, one write strength per value head and "
                         f"token, got {tuple(beta.shape)}")
    dt = acc_dtype(q.dtype)
    S = None
    if state is not None:
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"{fn}: {state_name} must be a tensor (B, H, Dk, Dv) or None, got {type(state).__name__}")
        if tuple(state.shape) != (B, H, Dk, v.shape[-1]):
            raise ValueError(f"{fn}: {state_name} must be (B, H, Dk, Dv) = {(B, H, Dk, v.shape[-1])}, got "
                             f"{tuple(state.shape)}; pass the state returned by a call with the same batch, heads "
                             f"and head dims")
        if state.device != q.device:
            raise ValueError(f"{fn}: {state_name} is on {state.device}, inputs are on {q.device}; move it with "
                             f".to(device)")
        S = state.to(dt)
    return Prepared(q.to(dt), k.to(dt), v.to(dt), g.to(dt), beta.to(dt) if delta else None, S, q.dtype)


def check_one_token(fn: str, tensors: dict, *, whole: str) -> None:
    """``_step`` functions take one token: q/k/v ``(B, H, 1, D)``, g ``(B, H, 1[, Dk])``, beta ``(B, H, 1)``."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[2] != 1:
            raise ValueError(f"{fn}: {name} must hold one token (size 1 in dim 2), got shape {tuple(t.shape)}; for "
                             f"several tokens use {whole}(..., initial_state=state)")
