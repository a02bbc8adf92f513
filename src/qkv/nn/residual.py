"""How a decoder's blocks read from and write to its residual stream: one :class:`Residual` protocol, so the plain
residual (He et al. 2016), DeepSeek-V4's manifold-constrained hyper-connections (mHC; Xie et al. 2026, after Zhu
et al. 2024, arXiv:2409.19606) and Qwen4-exp's gated residual run through the one :class:`qkv.nn.DecoderLM`.

A residual stream may be wider than the model: ``n`` parallel copies of the hidden state ("streams"), kept with
the tokens on dimension 1, ``(B, N, ...)``. The decoder calls, in this order::

    streams = model_residual.widen(h)              # after the embedding: (B, N, d) -> streams
    for each layer, for each branch (mixer, feed-forward):
        x, ctx = branch_residual.enter(streams)    # the branch's input, (B, N, d)
        y = branch(norm(x))                        # (B, N, d), or its last columns only
        streams = branch_residual.leave(streams, y, ctx)
    h = model_residual.collapse(streams)           # before the final norm: streams -> (B, N, d)

``ctx`` is whatever ``enter`` computed from the streams that ``leave`` needs again (mHC's post and mixing
weights); the decoder never looks inside it. ``y`` may cover only the last columns of the streams (a prefill that
keeps the last ``logits_to_keep`` columns): ``leave`` then returns streams of ``y``'s length, the last ones.

The plain residual (:data:`PLAIN_RESIDUAL`) is the identity, ``(x, None)``, ``x + y`` and the identity: the
decoder with it computes exactly what it computed before this protocol existed. An implementation that owns
weights is an ``nn.Module`` (its parameters then sit under the decoder layer's ``attn_residual`` /
``ffn_residual`` or the model's ``residual``); the plain one owns none and adds no state-dict entries.

:func:`residual_for` is the one place that says which residual a config's model uses at each site: ``"attn"``
and ``"ffn"`` (one layer's branches: ``enter`` / ``leave``) and ``"model"`` (``widen`` / ``collapse``). A new kind
is its module file and one line there.

Shape legend: B batch, N tokens, d hidden size.

Example:
    >>> import torch
    >>> from qkv.config import get_config
    >>> r = residual_for(get_config("tiny-llama"), 0, "attn")
    >>> streams = r.widen(torch.ones(1, 2, 4))
    >>> x, ctx = r.enter(streams)
    >>> r.collapse(r.leave(streams, 2 * x, ctx)).tolist()
    [[[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .gated_residual import GatedResidual
from .hyper import HyperConnection, HyperHead

if TYPE_CHECKING:
    from ..config.decoder import DecoderConfig

__all__ = ["PLAIN_RESIDUAL", "RESIDUAL_SITES", "PlainResidual", "Residual", "residual_for"]

#: Where a decoder asks for a residual: a layer's mixer branch, its feed-forward branch, the whole model.
RESIDUAL_SITES = ("attn", "ffn", "model")


@runtime_checkable
class Residual(Protocol):
    """A decoder's residual stream (module notes). ``streams`` keeps tokens on dimension 1: (B, N, ...)."""

    def widen(self, h: torch.Tensor) -> torch.Tensor:
        """The embedding's output ``h`` (B, N, d) -> the streams the layers carry."""

    def enter(self, streams: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The streams -> ``(x, ctx)``: a branch's input ``x`` (B, N, d) and what :meth:`leave` needs again."""

    def leave(self, streams: torch.Tensor, y: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The branch output ``y`` (B, N' <= N, d) back into the streams -> streams of the last N' tokens."""

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """The last layer's streams -> (B, N, d), the final norm's input."""


class PlainResidual:
    """The plain residual ``x = x + block(norm(x))``: one stream, the hidden state itself. Stateless, no weights.

    Example:
        >>> import torch
        >>> x, y = torch.zeros(1, 3, 2), torch.ones(1, 1, 2)
        >>> PLAIN_RESIDUAL.leave(x, y, None).shape   # y of the last column only: that column goes on
        torch.Size([1, 1, 2])
    """

    def widen(self, h: torch.Tensor) -> torch.Tensor:
        """The identity."""
        return h

    def enter(self, streams: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``(streams, None)``: the branch reads the hidden state."""
        return streams, None

    def leave(self, streams: torch.Tensor, y: torch.Tensor, ctx: None) -> torch.Tensor:
        """``streams + y`` over ``y``'s columns (the last ones)."""
        n = y.shape[1]
        if n != streams.shape[1]:
            streams = streams[:, streams.shape[1] - n:]
        return streams + y

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """The identity."""
        return streams

    def __repr__(self) -> str:
        return "PlainResidual()"


#: The plain residual, shared by every layer of every model that uses it.
PLAIN_RESIDUAL = PlainResidual()


def residual_for(config: DecoderConfig, layer_idx: int | None, site: str) -> Residual:
    """The residual of ``config``'s model at ``site`` (one of :data:`RESIDUAL_SITES`) of layer ``layer_idx``
    (None for ``"model"``).

    Args:
        config: the model's :class:`qkv.config.DecoderConfig`.
        layer_idx: the layer, an int in ``[0, num_hidden_layers)``, for ``"attn"`` and ``"ffn"``; None for ``"model"``.
        site: ``"attn"`` (the mixer branch), ``"ffn"`` (the feed-forward branch) or ``"model"`` (widen and collapse).

    Returns:
        A :class:`Residual`: with ``config.hyper`` DeepSeek-V4's mHC (a :class:`qkv.nn.hyper.HyperConnection` per
        branch, a :class:`qkv.nn.hyper.HyperHead` for the model); with ``config.gated_residual`` Qwen4-Exp's gated
        hyper-connection (:class:`qkv.nn.GatedResidual`); else :data:`PLAIN_RESIDUAL`.
    """
    if site not in RESIDUAL_SITES:
        raise ValueError(f"residual_for: site must be one of {RESIDUAL_SITES}, got {site!r}")
    n = config.num_hidden_layers
    if site == "model":
        if layer_idx is not None:
            raise ValueError(f"residual_for: the 'model' site belongs to no layer; pass layer_idx=None, got "
                             f"{layer_idx!r}")
    elif not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < n:
        raise ValueError(f"residual_for: layer_idx must be an int in [0, {n}) for the {site!r} site, got "
                         f"{layer_idx!r}")
    if config.hyper is not None:
        cls = HyperHead if site == "model" else HyperConnection
        return cls(config.hidden_size, config.hyper, norm_eps=config.rms_norm_eps)
    if config.gated_residual is not None:  # Qwen4-Exp: the model's connection widens and reads out, no inject
        g = config.gated_residual
        return GatedResidual(config.hidden_size, g.streams, g.rank, eps=config.rms_norm_eps, inject=site != "model")
    return PLAIN_RESIDUAL
