"""Enformer-style relative position basis functions as a score modifier: Avsec et al. 2021, "Effective gene
expression prediction from sequence by integrating long-range interactions" (Nature Methods), Methods,
"Transformer layer": relative positional encodings built from basis functions of the distance.

The bias of head ``h`` for query ``i`` and key ``j`` is ``sum_f W[h, f] * phi_f(j - i)``, where the basis
``phi`` holds, for the distance ``|j - i|`` and its sign, exponentially decaying functions (half-lives spread
over ``[3, N]``), central masks (``1`` if ``|d|`` is below a width spread over ``[1, N]``) and gamma-density
bumps (peaks spread over ``[0, N]``), each also multiplied by ``sign(j - i)`` so that left and right differ.
The basis is fixed; ``W`` is learned. (Enformer also adds a content term ``q . r(j - i)``; the basis-only bias
here is its position-only part.) It is a :func:`qkv.mods.relative_bias` score modifier: a ``(2N - 1, H)``
table over the relative distances, indexed by a precomputed ``(N, N)`` bucket map, added to
``q . k / sqrt(D)`` inside :func:`qkv.attention`.

Task (synthetic DNA-like sequences): predict at every position ``i`` the base found ``+7`` positions away
(``i + 7``, wrapping around). Without positions attention cannot tell where ``i + 7`` is; with the basis bias
a head learns a bump at distance +7. Chance is 1/4.

Run: ``python examples/enformer.py`` (seconds on a CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv import mods

__all__ = ["relative_basis", "BasisRelativeAttention", "EnformerToy", "main"]

BASES = 4
OFFSET = 7


def relative_basis(n: int, features: int = 30) -> torch.Tensor:
    """Basis functions of the relative distance ``d = j - i`` for ``d`` in ``-(n-1) .. n-1``:
    (2n - 1, 2 * features) float32, symmetric features then the same times ``sign(d)``."""
    if features % 3:
        raise ValueError(f"relative_basis: features must be a multiple of 3 (three kinds), got {features}")
    k = features // 3
    d = torch.arange(-(n - 1), n, dtype=torch.float64)
    a = d.abs().unsqueeze(1)  # (2n - 1, 1)
    half_life = 2 ** torch.linspace(math.log2(3), math.log2(n), k, dtype=torch.float64)
    exponential = torch.exp(-math.log(2) / half_life * a)
    widths = 2 ** torch.linspace(0, math.log2(n), k, dtype=torch.float64)
    central = (a < widths).double()
    means = torch.linspace(n / k, n, k, dtype=torch.float64) / 2
    std = n / (2 * k)
    conc = (means / std) ** 2
    rate = means / std**2
    log_density = (conc - 1) * torch.log(a.clamp_min(1e-8)) - rate * a + conc * torch.log(rate) - torch.lgamma(conc)
    gamma = torch.exp(log_density)
    gamma = gamma / gamma.amax(0, keepdim=True)
    sym = torch.cat([exponential, central, gamma], dim=1)  # (2n - 1, features)
    return torch.cat([sym, torch.sign(d).unsqueeze(1) * sym], dim=1).float()


class BasisRelativeAttention(nn.Module):
    """Self-attention with a learned combination of fixed relative basis functions as its score bias.

    ``forward(x)``: x (B, N, d) with ``N <= max_len`` -> (B, N, d).
    """

    def __init__(self, d: int, heads: int, max_len: int, features: int = 30) -> None:
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.register_buffer("basis", relative_basis(max_len, features))  # (2 L - 1, 2 F)
        self.weight = nn.Parameter(torch.zeros(2 * features, heads))
        self.max_len = max_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, d = x.shape
        if N > self.max_len:
            raise ValueError(f"BasisRelativeAttention: N={N} exceeds max_len={self.max_len}")
        q, k, v = self.qkv(x).view(B, N, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        pos = torch.arange(N, device=x.device)
        buckets = pos.view(1, -1) - pos.view(-1, 1) + self.max_len - 1  # (N, N) index of j - i
        bias = mods.relative_bias(self.basis @ self.weight, buckets)  # table (2 L - 1, H)
        o = qkv.attention(q, k, v, score_mod=bias)
        return self.out(o.transpose(1, 2).reshape(B, N, d))


class EnformerToy(nn.Module):
    """Base embeddings, one attention layer with the basis bias and a residual MLP, a per-position head."""

    def __init__(self, d: int = 32, heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(BASES, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = BasisRelativeAttention(d, heads, max_len)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, BASES)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        x = self.embed(seq)
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def main(steps: int = 200, seed: int = 0, *, batch: int = 32, n: int = 48) -> dict[str, float]:
    """Train; return first/last loss and held-out accuracy; chance is 1/4."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = EnformerToy(max_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        seq = torch.randint(0, BASES, (batch, n), generator=g)
        loss = F.cross_entropy(model(seq).flatten(0, 1), seq.roll(-OFFSET, dims=1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        seq = torch.randint(0, BASES, (256, n), generator=g)
        accuracy = float((model(seq).argmax(-1) == seq.roll(-OFFSET, dims=1)).float().mean())
        bias = model.attn.basis @ model.attn.weight  # (2 L - 1, H)
        peak = int(bias.amax(1).argmax()) - (model.attn.max_len - 1)
    return {"loss_first": losses[0], "loss_last": sum(losses[-10:]) / 10, "accuracy": accuracy, "chance": 1 / BASES,
            "bias_peak_offset": peak}


if __name__ == "__main__":
    print(main())
