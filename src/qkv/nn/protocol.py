"""What every attention module of :mod:`qkv.nn` exposes: :class:`AttentionModule`.

Code that works on "the attention modules of a model" (capture and head gates in :mod:`qkv.interpret`,
packed documents in :mod:`qkv.varlen`, context parallelism in :mod:`qkv.distributed`, :func:`qkv.models.to_gqa`)
finds them with :func:`attention_modules` and reads only what the protocol declares:

- ``attention_fn``: the operator hook, a callable with the signature of :func:`qkv.attention`, through which
  the module runs every softmax attention call, with its rotated queries and keys, its mask and score
  modifiers in absolute positions, and its scale. Replacing it is how capture, packed documents and context
  parallelism reach the attention of a model. ``None`` declares that the module computes no softmax attention
  (:class:`qkv.nn.LinearAttention`, :class:`qkv.nn.PerformerAttention`: a feature map replaces it, and there
  is no (q, k, mask) call to hook); tools that replace the operator refuse such a module rather than skip it.
- ``n_heads``: query heads ``Hq``; ``n_kv_heads``: the key/value heads queries read (``Hq % Hkv == 0``; 1 for
  multi-query and for MLA, whose heads all read one shared latent).
- ``layer_idx``: the module's index in a KV cache (and among the model's layers).
- ``head_gate``: ``None`` (every head at 1, free) or a (Hq,) tensor multiplying each head's output before the
  output projection (:func:`apply_head_gate`, Michel et al. 2019).

A module may stack its heads as extra query rows of one head when they all read the same keys (MLA's absorbed
path): its operator then sees queries ``(B, 1, Hq * Nq, D)``, head ``h``'s rows at ``h * Nq .. (h + 1) * Nq - 1``.

Shape legend: B batch, Hq query heads, N tokens, D head dim.

Example:
    >>> import torch
    >>> from qkv.nn import DecoderLM, get_config
    >>> from qkv.nn.protocol import AttentionModule, attention_modules
    >>> lm = DecoderLM(get_config("tiny-llama"))
    >>> [(name, m.n_heads, m.n_kv_heads) for name, m in attention_modules(lm)][:1]
    [('layers.0.self_attn', 4, 2)]
    >>> isinstance(lm.layers[0].self_attn, AttentionModule)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["AttentionFn", "AttentionModule", "attention_modules", "apply_head_gate"]

#: The operator hook's type: a callable with :func:`qkv.attention`'s signature ``(q, k, v, *, mask=None,
#: score_mod=None, scale=None, return_lse=False, dropout_p=0.0, backend="auto", sinks=None, ...)``.
AttentionFn = Callable[..., Any]


@runtime_checkable
class AttentionModule(Protocol):
    """An attention module of :mod:`qkv.nn` (see the module notes for each member's meaning)."""

    attention_fn: AttentionFn | None
    n_heads: int
    n_kv_heads: int
    layer_idx: int
    head_gate: torch.Tensor | None


def attention_modules(model: nn.Module) -> list[tuple[str, AttentionModule]]:
    """The attention modules of ``model`` (``model`` itself included), with their names, in registration
    order (the forward order of every qkv stack).

    Args:
        model: any ``torch.nn.Module``.

    Returns:
        ``[(name, module), ...]`` for every submodule that follows :class:`AttentionModule`; ``""`` names
        ``model`` itself.

    Example:
        >>> from qkv.nn import MultiHeadAttention
        >>> [(n, type(m).__name__) for n, m in attention_modules(MultiHeadAttention(16, 2))]
        [('', 'MultiHeadAttention')]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attention_modules: model must be a torch nn.Module, got {type(model).__name__}")
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AttentionModule)]


def apply_head_gate(out: torch.Tensor, head_gate: torch.Tensor | None) -> torch.Tensor:
    """``out`` (B, H, N, D) with head ``h`` multiplied by ``head_gate[h]`` (None: ``out`` itself).

    Example:
        >>> out = torch.ones(1, 2, 3, 4)
        >>> apply_head_gate(out, torch.tensor([1.0, 0.0]))[0, :, 0, 0].tolist()
        [1.0, 0.0]
    """
    if head_gate is None:
        return out
    H = out.shape[1]
    if not isinstance(head_gate, torch.Tensor) or head_gate.shape != (H,):
        seen = tuple(head_gate.shape) if isinstance(head_gate, torch.Tensor) else type(head_gate).__name__
        raise ValueError(f"head_gate must be a ({H},) tensor, one multiplier per query head, got {seen}; set it "
                         f"to None to leave every head as it is")
    return out * head_gate.to(out.dtype).view(1, H, 1, 1)
