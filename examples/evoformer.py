"""Evoformer-style axial attention with a pair bias: Jumper et al. 2021, "Highly accurate protein structure
prediction with AlphaFold" (Supplementary Information 1.6, Algorithms 7 and 8).

An MSA representation ``m`` (S sequences x R residues x c) is updated by

- row-wise gated self-attention with pair bias: within each sequence, residue ``i`` attends to residue ``j``
  with score ``q_i . k_j / sqrt(D) + b_ij^h``, where the bias ``b^h = Linear(LayerNorm(z))`` comes from the
  pair representation ``z`` (R x R x c_z); the output is gated by ``sigmoid(Linear(m))``;
- column-wise gated self-attention: within each residue column, sequences attend to each other.

Both run through :func:`qkv.attention`: rows and columns are folded into the batch (axial attention), the
pair bias is a :func:`qkv.mods.bias` score modifier broadcast over the sequences, and gradients flow into
the pair representation through it.

Task (synthetic): every residue ``i`` has a partner ``p(i)`` (a random pairing, like base pairs or contacts,
drawn per example and given only through ``z``: ``z_ij = 1`` iff ``j = p(i)``); each MSA row holds random
tokens; predict at ``(s, i)`` the token at ``(s, p(i))``. Only the pair bias tells a residue where its
partner is. Chance is 1 / 8.

Run: ``python examples/evoformer.py`` (seconds on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv import mods

__all__ = ["RowAttentionWithPairBias", "ColumnAttention", "EvoformerToy", "make_batch", "main"]

TOKENS = 8


class RowAttentionWithPairBias(nn.Module):
    """Gated row-wise self-attention with pair bias (AlphaFold 2, Algorithm 7).

    ``forward(m, z)``: m (B, S, R, c), z (B, R, R, cz) -> (B, S, R, c).
    """

    def __init__(self, c: int, cz: int, heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.h, self.d = heads, head_dim
        self.norm_m, self.norm_z = nn.LayerNorm(c), nn.LayerNorm(cz)
        self.qkv = nn.Linear(c, 3 * heads * head_dim, bias=False)
        self.pair_bias = nn.Linear(cz, heads, bias=False)
        self.gate = nn.Linear(c, heads * head_dim)
        self.out = nn.Linear(heads * head_dim, c)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        B, S, R, _ = m.shape
        x = self.norm_m(m)
        q, k, v = self.qkv(x).view(B * S, R, 3, self.h, self.d).permute(2, 0, 3, 1, 4)  # (B S, H, R, D) each
        bias = self.pair_bias(self.norm_z(z)).permute(0, 3, 1, 2)  # (B, H, R, R)
        bias = bias.unsqueeze(1).expand(B, S, self.h, R, R).reshape(B * S, self.h, R, R)  # shared by rows
        o = qkv.attention(q, k, v, score_mod=mods.bias(bias))  # (B S, H, R, D)
        o = o.transpose(1, 2).reshape(B, S, R, self.h * self.d) * torch.sigmoid(self.gate(x))
        return self.out(o)


class ColumnAttention(nn.Module):
    """Gated column-wise self-attention (AlphaFold 2, Algorithm 8): sequences attend within a residue column.

    ``forward(m)``: m (B, S, R, c) -> (B, S, R, c).
    """

    def __init__(self, c: int, heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.h, self.d = heads, head_dim
        self.norm = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * heads * head_dim, bias=False)
        self.gate = nn.Linear(c, heads * head_dim)
        self.out = nn.Linear(heads * head_dim, c)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        B, S, R, _ = m.shape
        x = self.norm(m).transpose(1, 2)  # (B, R, S, c): columns become the batch
        q, k, v = self.qkv(x).reshape(B * R, S, 3, self.h, self.d).permute(2, 0, 3, 1, 4)  # (B R, H, S, D)
        o = qkv.attention(q, k, v).transpose(1, 2).reshape(B, R, S, self.h * self.d)
        o = o * torch.sigmoid(self.gate(x))
        return self.out(o).transpose(1, 2)


class EvoformerToy(nn.Module):
    """Embeddings, ``blocks`` x (row attention with pair bias, column attention, transition), a token head."""

    def __init__(self, c: int = 32, cz: int = 8, blocks: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(TOKENS, c)
        self.pair_in = nn.Linear(1, cz)
        self.rows = nn.ModuleList(RowAttentionWithPairBias(c, cz) for _ in range(blocks))
        self.cols = nn.ModuleList(ColumnAttention(c) for _ in range(blocks))
        self.transitions = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(c), nn.Linear(c, 2 * c), nn.ReLU(), nn.Linear(2 * c, c)) for _ in range(blocks))
        self.head = nn.Linear(c, TOKENS)

    def forward(self, msa: torch.Tensor, contacts: torch.Tensor) -> torch.Tensor:
        """msa (B, S, R) int64, contacts (B, R, R) float -> logits (B, S, R, TOKENS)."""
        m = self.embed(msa)
        z = self.pair_in(contacts.unsqueeze(-1))
        for row, col, tr in zip(self.rows, self.cols, self.transitions):
            m = m + row(m, z)
            m = m + col(m)
            m = m + tr(m)
        return self.head(m)


def make_batch(batch: int, seqs: int, residues: int, g: torch.Generator):
    """(msa (B, S, R), contacts (B, R, R), targets (B, S, R)): a random perfect pairing per example."""
    perm = torch.stack([torch.randperm(residues, generator=g) for _ in range(batch)])
    partner = torch.empty_like(perm)
    half = residues // 2
    partner.scatter_(1, perm[:, :half], perm[:, half:2 * half])
    partner.scatter_(1, perm[:, half:2 * half], perm[:, :half])
    contacts = F.one_hot(partner, residues).float()  # (B, R, R)
    msa = torch.randint(0, TOKENS, (batch, seqs, residues), generator=g)
    targets = msa.gather(2, partner.unsqueeze(1).expand(-1, seqs, -1))
    return msa, contacts, targets


def main(steps: int = 300, seed: int = 0, *, batch: int = 16, seqs: int = 4, residues: int = 16) -> dict[str, float]:
    """Train; return first/last loss and held-out accuracy (chance 1/8)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = EvoformerToy()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        msa, contacts, targets = make_batch(batch, seqs, residues, g)
        loss = F.cross_entropy(model(msa, contacts).flatten(0, 2), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        msa, contacts, targets = make_batch(128, seqs, residues, g)
        accuracy = float((model(msa, contacts).argmax(-1) == targets).float().mean())
    return {"loss_first": losses[0], "loss_last": sum(losses[-10:]) / 10, "accuracy": accuracy, "chance": 1 / TOKENS}


if __name__ == "__main__":
    print(main())
