"""A Set Transformer with inducing-point attention: Lee et al. 2019, "Set Transformer: A Framework for
Attention-based Permutation-Invariant Neural Networks".

Blocks, all built on :class:`qkv.nn.MultiHeadAttention` in cross-attention mode (no positions, so every
block is permutation equivariant and the pooled output permutation invariant)::

    MAB(X, Y)  = LN(H + rFF(H)),  H = LN(X + Multihead(X, Y, Y))      multihead attention block
    ISAB_m(X)  = MAB(X, MAB(I, X))     I: m learned inducing points   O(n m) instead of O(n^2)
    PMA_k(Z)   = MAB(S, rFF(Z))        S: k learned seed vectors      attention pooling

Task (the paper's section 5.1): regress the maximum of a set of real numbers. Sets have different sizes
in one batch; padded elements are hidden from every attention by ``qkv.masks.padding(lengths)``.

Run: ``python examples/set_transformer.py`` (a few seconds on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv import masks
from qkv.nn import FeedForward, MultiHeadAttention

__all__ = ["MAB", "ISAB", "PMA", "SetTransformer", "make_sets", "main"]


class MAB(nn.Module):
    """Multihead attention block: queries ``x`` (B, Nq, d) attend to ``y`` (B, Nk, d); ``mask`` hides keys."""

    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(d, n_heads, cross=True)
        self.ff = FeedForward(d, 2 * d, activation="relu")
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, mask=None) -> torch.Tensor:
        h = self.norm1(x + self.attn(x, y, mask=mask).out)
        return self.norm2(h + self.ff(h))


class ISAB(nn.Module):
    """Induced set attention block: the set attends to itself through ``m`` inducing points."""

    def __init__(self, d: int, n_heads: int, m: int) -> None:
        super().__init__()
        self.inducing = nn.Parameter(torch.randn(1, m, d) * d ** -0.5)
        self.mab1, self.mab2 = MAB(d, n_heads), MAB(d, n_heads)

    def forward(self, x: torch.Tensor, *, mask=None) -> torch.Tensor:
        h = self.mab1(self.inducing.expand(x.shape[0], -1, -1), x, mask=mask)  # (B, m, d): padded keys hidden
        return self.mab2(x, h)  # (B, N, d)


class PMA(nn.Module):
    """Pooling by multihead attention onto ``k`` learned seeds."""

    def __init__(self, d: int, n_heads: int, k: int) -> None:
        super().__init__()
        self.seeds = nn.Parameter(torch.randn(1, k, d) * d ** -0.5)
        self.ff = FeedForward(d, 2 * d, activation="relu")
        self.mab = MAB(d, n_heads)

    def forward(self, z: torch.Tensor, *, mask=None) -> torch.Tensor:
        return self.mab(self.seeds.expand(z.shape[0], -1, -1), self.ff(z), mask=mask)  # (B, k, d)


class SetTransformer(nn.Module):
    """Encoder ISAB x 2, decoder PMA_1, linear readout: (B, N, in_dim) sets -> (B, out_dim)."""

    def __init__(self, *, in_dim: int = 1, out_dim: int = 1, d: int = 32, n_heads: int = 4, inducing: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, d)
        self.isab1, self.isab2 = ISAB(d, n_heads, inducing), ISAB(d, n_heads, inducing)
        self.pma = PMA(d, n_heads, 1)
        self.out = nn.Linear(d, out_dim)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        mask = None if lengths is None else masks.padding(lengths)  # hides padded set elements as keys
        h = self.isab2(self.isab1(self.embed(x), mask=mask), mask=mask)
        return self.out(self.pma(h, mask=mask)[:, 0])


def make_sets(n: int, *, max_size: int = 10, generator: torch.Generator | None = None):
    """``n`` sets of 2..max_size numbers in [0, 10): values (n, max_size, 1) (padding filled with noise the
    model must ignore), lengths (n,), and each set's maximum (n, 1)."""
    lengths = torch.randint(2, max_size + 1, (n,), generator=generator)
    values = 10 * torch.rand(n, max_size, 1, generator=generator)
    valid = torch.arange(max_size).view(1, -1, 1) < lengths.view(-1, 1, 1)
    target = values.masked_fill(~valid, float("-inf")).amax(dim=1)
    values = torch.where(valid, values, 100 * torch.rand(values.shape, generator=generator))  # junk padding
    return values, lengths, target


def main(steps: int = 300, seed: int = 0, *, batch: int = 64, verbose: bool = False) -> dict[str, float]:
    """Train on fresh sets; return first/last MSE, a predict-the-mean baseline MSE and the permutation gap."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = SetTransformer()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, lengths, y = make_sets(batch, generator=g)
        loss = F.mse_loss(model(x, lengths), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if verbose and step % 50 == 0:
            print(f"step {step:4d}  mse {loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        x, lengths, y = make_sets(512, generator=g)
        pred = model(x, lengths)
        perm = torch.randperm(x.shape[1], generator=g)
        # Shuffle only inside each set (valid elements stay valid): sort the permuted validity to the front.
        valid = (torch.arange(x.shape[1]).view(1, -1) < lengths.view(-1, 1))[:, perm]
        order = perm[torch.argsort((~valid).int(), dim=1, stable=True)]
        shuffled = torch.gather(x, 1, order.unsqueeze(-1))
        gap = float((model(shuffled, lengths) - pred).abs().max())
        mse = float(F.mse_loss(pred, y))
        baseline = float(F.mse_loss(torch.full_like(y, float(y.mean())), y))
    return {"mse_first": losses[0], "mse_last": sum(losses[-10:]) / len(losses[-10:]), "mse_eval": mse,
            "mse_baseline": baseline, "permutation_gap": gap}


if __name__ == "__main__":
    print(main(verbose=True))
