"""Per-layer input embeddings (Gemma 4's "PLE"; Gemma Team 2026, Gemma 4 model card, and the Gemma 3n design it
comes from): besides the token embedding, each decoder layer gets a small vector of its own for every token, and adds
it back to the residual stream through a gated bottleneck after its feed-forward.

The vectors, for ``L`` layers of ``P`` channels each, are built once per step from two sources:

- a token-identity part: a second embedding table of ``L * P`` columns, scaled by ``sqrt(P)`` (rounded to float32);
- a context part: the (already scaled) token embeddings projected by ``d -> L * P``, scaled by ``d ** -0.5`` and
  RMS-normalized per layer;

and their sum times ``2 ** -0.5`` is the ``(B, N, L, P)`` tensor :class:`PerLayerInputs` returns. Layer ``i`` then
adds ``norm(up(act(gate(x)) * e_i))`` to its output ``x`` (:class:`PerLayerBranch`: ``gate`` d -> P, ``up`` P -> d).

Shape legend: B batch, N tokens, d hidden size, L layers, P per-layer width, V rows of the per-layer table.

Example:
    >>> import torch
    >>> ple = PerLayerInputs(vocab_size=10, hidden_size=8, num_layers=3, width=4)
    >>> ids = torch.randint(0, 10, (2, 5))
    >>> e = ple(ids, torch.randn(2, 5, 8))
    >>> e.shape
    torch.Size([2, 5, 3, 4])
    >>> PerLayerBranch(8, 4, activation="gelu_pytorch_tanh")(torch.randn(2, 5, 8), e[:, :, 0]).shape
    torch.Size([2, 5, 8])
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .activations import ACTIVATIONS
from .norm import RMSNorm

__all__ = ["PerLayerBranch", "PerLayerInputs"]


class PerLayerInputs(nn.Module):
    """The per-layer input vectors of a step (module notes). Parameters keep HF Gemma 4's names below
    ``embed_per_layer``: ``embed`` (V, L P), ``projection`` (L P, d), ``norm`` (P).

    Args:
        vocab_size: rows of the per-layer table (HF ``vocab_size_per_layer_input``).
        hidden_size: ``d``, the width of the token embeddings it projects.
        num_layers: ``L``.
        width: ``P`` (HF ``hidden_size_per_layer_input``).
        eps: epsilon of the per-layer RMSNorm.
    """

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, width: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("hidden_size", hidden_size), ("num_layers", num_layers),
                        ("width", width)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"PerLayerInputs: {name} must be a positive int, got {v!r}")
        self.num_layers, self.width = num_layers, width
        self.embed = nn.Embedding(vocab_size, num_layers * width)
        self.projection = nn.Linear(hidden_size, num_layers * width, bias=False)
        self.norm = RMSNorm(width, eps=eps)

    def forward(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """(B, N) token ids and their (B, N, d) scaled embeddings -> (B, N, L, P)."""
        if input_ids.shape != embeddings.shape[:-1]:
            raise ValueError(f"PerLayerInputs: input_ids {tuple(input_ids.shape)} and embeddings "
                             f"{tuple(embeddings.shape)} must agree on (B, N)")
        if input_ids.numel() and int(input_ids.max()) >= self.embed.num_embeddings:
            raise ValueError(f"PerLayerInputs: token id {int(input_ids.max())} is outside the per-layer table of "
                             f"{self.embed.num_embeddings} rows")
        shape = (*input_ids.shape, self.num_layers, self.width)
        dtype = embeddings.dtype
        # sqrt(P) as a float32 number first, then the weights' dtype: what the released models were trained with
        ident = self.embed(input_ids) * torch.tensor(math.sqrt(self.width), dtype=torch.float32).to(dtype)
        context = self.projection(embeddings) * torch.tensor(embeddings.shape[-1] ** -0.5, dtype=dtype)
        context = self.norm(context.reshape(shape))
        return (context + ident.reshape(shape)) * torch.tensor(2.0 ** -0.5, dtype=dtype)


class PerLayerBranch(nn.Module):
    """One layer's use of its per-layer input: ``x + norm(up(act(gate(x)) * e))``. Parameters: ``gate`` (P, d),
    ``up`` (d, P), ``norm`` (d).

    Args:
        hidden_size: ``d``.
        width: ``P``.
        activation: a key of :data:`qkv.nn.activations.ACTIVATIONS` (Gemma 4: ``"gelu_pytorch_tanh"``).
        eps: epsilon of the output RMSNorm.
    """

    def __init__(self, hidden_size: int, width: int, *, activation: str, eps: float = 1e-6) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"PerLayerBranch: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.gate = nn.Linear(hidden_size, width, bias=False)
        self.up = nn.Linear(width, hidden_size, bias=False)
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """x (B, N, d), per_layer_input (B, N, P) -> (B, N, d), the residual included."""
        return x + self.norm(self.up(self.act(self.gate(x)) * per_layer_input))
