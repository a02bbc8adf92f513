"""Gated attention multiple-instance learning: Ilse, Tomczak & Welling 2018, "Attention-based Deep Multiple
Instance Learning" (ICML), the pooling used by slide-level pathology classifiers (CLAM, Lu et al. 2021).

A bag holds a variable number of instances (image tiles of a slide); only the bag has a label. Each instance
``h_k`` gets a weight ``a_k = softmax_k(w . (tanh(V h_k) * sigmoid(U h_k)))`` and the bag is ``sum_k a_k h_k``.
That is one query ``w`` attending over keys ``tanh(V h) * sigmoid(U h)`` and values ``h`` with scale 1, so it
runs through :func:`qkv.attention`, with :func:`qkv.masks.padding` hiding the padding of shorter bags; the
weights ``a_k`` (which instances drove the decision) come from :func:`qkv.attention_probs`.

Data (real images): scikit-learn's bundled 8x8 handwritten digits. A bag holds 4-12 digit images from the
training split; it is positive iff it contains a 9 (the MNIST-bags task of the paper). Bags are balanced.

Run: ``python examples/mil_attention.py`` (seconds on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv import masks

__all__ = ["GatedAttentionMIL", "make_bags", "main"]

POSITIVE = 9


class GatedAttentionMIL(nn.Module):
    """Instance encoder, gated attention pooling, bag classifier.

    ``forward(x, lengths)``: x (B, K, 64) instances padded to K, lengths (B,) -> (logits (B,), weights (B, K)).
    """

    def __init__(self, d_in: int = 64, d: int = 64, d_attn: int = 32) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        self.V = nn.Linear(d, d_attn)
        self.U = nn.Linear(d, d_attn)
        self.w = nn.Parameter(torch.randn(d_attn) * d_attn ** -0.5)
        self.classify = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, K, _ = x.shape
        h = self.encode(x)  # (B, K, d)
        keys = (torch.tanh(self.V(h)) * torch.sigmoid(self.U(h))).unsqueeze(1)  # (B, 1, K, d_attn)
        query = self.w.view(1, 1, 1, -1).expand(B, 1, 1, -1)  # (B, 1, 1, d_attn)
        mask = masks.padding(lengths)
        bag = qkv.attention(query, keys, h.unsqueeze(1), mask=mask, scale=1.0)  # (B, 1, 1, d)
        weights = qkv.attention_probs(query, keys, h.unsqueeze(1), mask=mask, scale=1.0)[:, 0, 0]  # (B, K)
        return self.classify(bag.view(B, -1)).squeeze(-1), weights


def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    itr, ite = train_test_split(range(len(y)), test_size=0.3, random_state=0, stratify=d.target)
    return (x[itr], y[itr]), (x[ite], y[ite])


def make_bags(x: torch.Tensor, y: torch.Tensor, n: int, g: torch.Generator, *, lo: int = 4, hi: int = 12):
    """``n`` balanced bags: (instances (n, hi, 64) zero-padded, lengths (n,), bag labels (n,), instance labels
    (n, hi), -1 on padding)."""
    pos_idx, neg_idx = (y == POSITIVE).nonzero().flatten(), (y != POSITIVE).nonzero().flatten()
    bags = torch.zeros(n, hi, x.shape[1])
    inst = torch.full((n, hi), -1)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g)
    labels = (torch.arange(n) % 2).float()
    for b in range(n):
        L = int(lengths[b])
        idx = neg_idx[torch.randint(0, len(neg_idx), (L,), generator=g)]
        if labels[b]:
            k = int(torch.randint(1, 3, (), generator=g))  # one or two positives
            idx[torch.randperm(L, generator=g)[:k]] = pos_idx[torch.randint(0, len(pos_idx), (k,), generator=g)]
        bags[b, :L] = x[idx]
        inst[b, :L] = y[idx]
    return bags, lengths, labels, inst


def main(steps: int = 300, seed: int = 0, *, batch: int = 32) -> dict[str, float]:
    """Train on bags from the training digits; evaluate on bags from held-out digits."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    (xtr, ytr), (xte, yte) = _digits()
    model = GatedAttentionMIL()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    losses = []
    for _ in range(steps):
        bags, lengths, labels, _ = make_bags(xtr, ytr, batch, g)
        logits, _ = model(bags, lengths)
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        bags, lengths, labels, inst = make_bags(xte, yte, 400, g)
        logits, weights = model(bags, lengths)
        accuracy = float(((logits > 0).float() == labels).float().mean())
        # In a positive bag, does the largest weight fall on a 9 (the instance that makes it positive)?
        top = weights.argmax(-1)
        pos = labels.bool()
        localization = float((inst[torch.arange(len(top)), top][pos] == POSITIVE).float().mean())
        padding_weight = float(weights[inst < 0].abs().max()) if (inst < 0).any() else 0.0
    return {"loss_first": losses[0], "loss_last": sum(losses[-10:]) / 10, "accuracy": accuracy,
            "localization": localization, "padding_weight": padding_weight}


if __name__ == "__main__":
    print(main())
