"""Contact maps from attention, as for protein language models.

Rao, Meier, Sercu, Ovchinnikov and Rives 2020, "Transformer protein language models are unsupervised
structure learners": each head's map is symmetrized, corrected by the average product correction (APC,
Dunn et al. 2008) and the stacked maps of every layer and head feed a logistic regression that predicts
which residue pairs are in contact (the paper fits it, L1-regularized, on a handful of structures).

Functions work on captured maps (no protein model is bundled): a list of (B, H, N, N) per layer.

Shape legend: B batch, L layers, H heads, F = L * H features, N tokens (residues).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["symmetrize", "apc", "contact_features", "ContactRegression", "fit_contact_regression",
           "precision_at"]


def symmetrize(a: torch.Tensor) -> torch.Tensor:
    """``a + a^T`` over the last two dims."""
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"symmetrize: expected square maps (..., N, N), got {tuple(a.shape)}")
    return a + a.transpose(-1, -2)


def apc(a: torch.Tensor) -> torch.Tensor:
    """Average product correction: ``a_ij - a_i. a_.j / a_..`` over the last two dims."""
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"apc: expected square maps (..., N, N), got {tuple(a.shape)}")
    rows, cols = a.sum(-1, keepdim=True), a.sum(-2, keepdim=True)
    return a - rows * cols / a.sum(dim=(-1, -2), keepdim=True).clamp_min(1e-12)


def contact_features(maps: Sequence[torch.Tensor]) -> torch.Tensor:
    """(B, F, N, N) features: ``apc(symmetrize(map))`` of every layer and head, layer-major."""
    if not maps or any(a.dim() != 4 or a.shape != maps[0].shape for a in maps):
        raise ValueError(f"contact_features: need a list of equal (B, H, N, N) maps, got "
                         f"{[tuple(a.shape) for a in maps]}")
    return apc(symmetrize(torch.cat(list(maps), dim=1).double())).float()


def _pairs(n: int, min_separation: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    i, j = torch.triu_indices(n, n, offset=min_separation, device=device)
    return i, j


class ContactRegression(NamedTuple):
    """A fitted logistic regression over the F features: ``P(contact) = sigmoid(features . weight + bias)``."""

    weight: torch.Tensor  # (F,)
    bias: torch.Tensor  # ()
    min_separation: int

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """(B, F, N, N) features -> (B, N, N) contact probabilities (symmetric; pairs closer than
        ``min_separation`` are 0)."""
        if features.dim() != 4 or features.shape[1] != self.weight.numel():
            raise ValueError(f"ContactRegression.predict: features must be (B, {self.weight.numel()}, N, N), got "
                             f"{tuple(features.shape)}")
        logits = torch.einsum("bfij,f->bij", features.double(), self.weight.double()) + self.bias.double()
        p = torch.sigmoid(logits).float()
        n = p.shape[-1]
        near = (torch.arange(n).view(-1, 1) - torch.arange(n).view(1, -1)).abs() < self.min_separation
        return p.masked_fill(near.to(p.device), 0.0)


def fit_contact_regression(features: torch.Tensor, contacts: torch.Tensor, *, l1: float = 1e-3,
                           min_separation: int = 6, steps: int = 200) -> ContactRegression:
    """Fit the logistic regression on known contacts.

    Args:
        features: (B, F, N, N) from :func:`contact_features`.
        contacts: (B, N, N) bool/0-1 true contacts.
        l1: L1 penalty on the weights (the paper's sparse regression).
        min_separation: only pairs with ``|i - j| >= min_separation`` are used (and predicted).
        steps: L-BFGS iterations.
    """
    if features.dim() != 4 or contacts.shape != (features.shape[0], features.shape[2], features.shape[3]):
        raise ValueError(f"fit_contact_regression: features (B, F, N, N) and contacts (B, N, N) must agree, got "
                         f"{tuple(features.shape)} and {tuple(contacts.shape)}")
    n = features.shape[-1]
    if not isinstance(min_separation, int) or not 1 <= min_separation < n:
        raise ValueError(f"fit_contact_regression: min_separation must be an int in [1, N={n}), got {min_separation!r}")
    i, j = _pairs(n, min_separation)
    x = features[:, :, i, j].permute(0, 2, 1).reshape(-1, features.shape[1]).double()  # (B * pairs, F)
    y = contacts[:, i, j].reshape(-1).double()
    if y.sum() == 0 or y.sum() == y.numel():
        raise ValueError("fit_contact_regression: contacts must contain both contacts and non-contacts")
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-12)
    xs = (x - mu) / sd
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w + b, y) + l1 * w.abs().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    weight = (w.detach() / sd)
    bias = b.detach() - (mu * weight).sum()
    return ContactRegression(weight.float(), bias.float(), min_separation)


def precision_at(pred: torch.Tensor, contacts: torch.Tensor, *, top: int | None = None,
                 min_separation: int = 6) -> float:
    """Precision of the ``top`` highest-scored pairs with ``|i - j| >= min_separation`` (default ``top = N``,
    "precision at L"), averaged over the batch."""
    if (not isinstance(pred, torch.Tensor) or not isinstance(contacts, torch.Tensor) or pred.dim() != 3
            or pred.shape[-1] != pred.shape[-2] or contacts.shape != pred.shape):
        raise ValueError(f"precision_at: pred and contacts must both be (B, N, N), got "
                         f"{tuple(getattr(pred, 'shape', ()))} and {tuple(getattr(contacts, 'shape', ()))}")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
        raise ValueError(f"precision_at: top must be a positive int or None, got {top!r}")
    n = pred.shape[-1]
    i, j = _pairs(n, min_separation)
    k = n if top is None else top
    out = []
    for p, c in zip(pred, contacts):
        best = p[i, j].topk(min(k, i.numel())).indices
        out.append(float(c[i[best], j[best]].float().mean()))
    return sum(out) / len(out)
