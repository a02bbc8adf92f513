"""What the linear-attention modules (:class:`qkv.nn.LinearAttention`, :class:`qkv.nn.PerformerAttention`)
share: argument checks, the q/k/v/o projections (named as in :class:`qkv.nn.MultiHeadAttention` and HF) and
the head split and merge (with the module's ``head_gate``).

Shape legend: B batch, N tokens, E model width, H heads, Dh head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from .protocol import apply_head_gate

__all__ = ["check_dims", "check_x", "add_projections", "split_heads", "merge_heads"]


def check_dims(cls: str, d_model: int, n_heads: int) -> None:
    for name, val in (("d_model", d_model), ("n_heads", n_heads)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{cls}: {name} must be a positive int, got {val!r}")
    if d_model % n_heads:
        raise ValueError(f"{cls}: d_model={d_model} must be divisible by n_heads={n_heads}")


def check_x(x: torch.Tensor, d_model: int, *, fn: str, one_token: bool = False) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor (B, N, d_model), got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{fn}: x must have shape (B, N, d_model={d_model}), got {tuple(x.shape)}")
    if one_token and x.shape[1] != 1:
        raise ValueError(
            f"{fn}: x must hold one token (B, 1, d_model), got {tuple(x.shape)}; use forward(x, state=state) "
            f"for several tokens"
        )


def add_projections(module: nn.Module, d_model: int, *, bias: bool, device, dtype) -> None:
    """q/k/v/o projections named as in ``MultiHeadAttention`` (and HF), so checkpoints map by name."""
    kw = {"bias": bias, "device": device, "dtype": dtype}
    module.q_proj = nn.Linear(d_model, d_model, **kw)
    module.k_proj = nn.Linear(d_model, d_model, **kw)
    module.v_proj = nn.Linear(d_model, d_model, **kw)
    module.o_proj = nn.Linear(d_model, d_model, **kw)


def split_heads(module: nn.Module, x: torch.Tensor, n_heads: int):
    B, N, E = x.shape
    q = module.q_proj(x).view(B, N, n_heads, E // n_heads).transpose(1, 2)  # (B, H, N, Dh)
    k = module.k_proj(x).view(B, N, n_heads, E // n_heads).transpose(1, 2)  # (B, H, N, Dh)
    v = module.v_proj(x).view(B, N, n_heads, E // n_heads).transpose(1, 2)  # (B, H, N, Dh)
    return q, k, v


def merge_heads(module: nn.Module, out_BHND: torch.Tensor) -> torch.Tensor:
    """The module's ``head_gate`` on each head, then the output projection."""
    out_BHND = apply_head_gate(out_BHND, module.head_gate)
    B, H, N, Dh = out_BHND.shape
    return module.o_proj(out_BHND.transpose(1, 2).reshape(B, N, H * Dh))  # (B, N, E)
