"""A wav2vec 2.0-style speech encoder: Baevski et al. 2020, "wav2vec 2.0: A Framework for Self-Supervised
Learning of Speech Representations" (NeurIPS), Sec. 2 and 4.2.

- Feature encoder: strided 1-D convolutions with GELU turn the raw waveform into frames (the paper's
  seven layers, strides 5,2,2,2,2,2,2 and 20 ms frames; here three layers, strides 5,4,4: one frame per 80
  samples), then LayerNorm and a projection.
- Convolutional relative positions: instead of absolute position embeddings, a grouped 1-D convolution over
  the frames (kernel 128, 16 groups in the paper; here kernel 15, 4 groups), followed by GELU, is added to the
  frames: positions are relative by construction.
- Span masking: each frame starts a masked span of ``M`` frames with probability ``p`` (paper: p = 0.065,
  M = 10, about half the frames masked); masked frames are replaced by one learned vector before the
  transformer.
- Transformer: :class:`qkv.nn.TransformerEncoder` with ``position="none"`` (the convolution carries the
  positions), key padding for shorter clips through ``lengths``.

Task (synthetic audio, masked prediction as in the paper's pre-training but with known targets): each clip
is a sequence of tone segments, each segment 3-6 frames long with a pitch from 8 classes plus noise; the
model must name the pitch class of the *masked* frames from the unmasked context (the loss covers masked
frames only, like wav2vec 2.0's contrastive loss). Chance is 1/8.

Run: ``python examples/wav2vec.py`` (seconds to a minute on a CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn import TransformerConfig, TransformerEncoder

__all__ = ["FeatureEncoder", "ConvPositions", "span_mask", "Wav2Vec2Toy", "make_clips", "main"]

HOP = 80  # samples per frame: 5 * 4 * 4
CLASSES = 8


class FeatureEncoder(nn.Module):
    """Waveform (B, T) -> frames (B, T // 80, d): three strided convolutions with GELU."""

    def __init__(self, channels: int = 64, d: int = 64) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv1d(1, channels, 10, stride=5, padding=3),
                                    nn.Conv1d(channels, channels, 4, stride=4),
                                    nn.Conv1d(channels, channels, 4, stride=4)])
        self.norm = nn.LayerNorm(channels)
        self.proj = nn.Linear(channels, d)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        x = wave.unsqueeze(1)
        for conv in self.convs:
            x = F.gelu(conv(x))
        return self.proj(self.norm(x.transpose(1, 2)))  # (B, F, d)


class ConvPositions(nn.Module):
    """Relative positions by a grouped convolution over frames, added to them (wav2vec 2.0 Sec. 2)."""

    def __init__(self, d: int = 64, kernel: int = 15, groups: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)


def span_mask(batch: int, frames: int, *, p: float = 0.065, span: int = 10, g: torch.Generator | None = None
              ) -> torch.Tensor:
    """Boolean (batch, frames): each frame starts a masked span of ``span`` frames with probability ``p``."""
    starts = torch.rand(batch, frames, generator=g) < p
    mask = torch.zeros(batch, frames, dtype=torch.bool)
    for offset in range(span):
        mask[:, offset:] |= starts[:, : frames - offset]
    return mask


class Wav2Vec2Toy(nn.Module):
    """Feature encoder, span masking with a learned mask vector, conv positions, transformer, frame head."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.features = FeatureEncoder(d=d)
        self.mask_embedding = nn.Parameter(torch.randn(d) * 0.1)
        self.positions = ConvPositions(d)
        self.encoder = TransformerEncoder(TransformerConfig(d_model=d, n_heads=heads, n_layers=layers, d_ff=2 * d,
                                                            activation="gelu", norm="layer", position="none"))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, wave: torch.Tensor, mask: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
        """wave (B, T); mask (B, F) frames to hide; lengths (B,) valid frames -> logits (B, F, CLASSES)."""
        x = self.features(wave)
        if mask is not None:
            x = torch.where(mask.unsqueeze(-1), self.mask_embedding.to(x.dtype), x)
        return self.head(self.encoder(self.positions(x), lengths=lengths))


def make_clips(batch: int, frames: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(waveforms (B, frames * 80), pitch class per frame (B, frames)): tone segments of 3-6 frames."""
    labels = torch.empty(batch, frames, dtype=torch.int64)
    for b in range(batch):
        f = 0
        while f < frames:
            n = int(torch.randint(3, 7, (), generator=g))
            labels[b, f:f + n] = torch.randint(0, CLASSES, (), generator=g)
            f += n
    freq = 0.02 + 0.03 * labels.float()  # cycles per sample, one pitch per class
    phase = torch.cumsum(2 * math.pi * freq.repeat_interleave(HOP, dim=1), dim=1)
    wave = torch.sin(phase) + 0.3 * torch.randn(batch, frames * HOP, generator=g)
    return wave, labels


def main(steps: int = 250, seed: int = 0, *, batch: int = 16, frames: int = 40) -> dict[str, float]:
    """Train masked prediction; return the first/last loss and held-out accuracy on masked frames."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = Wav2Vec2Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(steps):
        wave, labels = make_clips(batch, frames, g)
        mask = span_mask(batch, frames, p=0.1, span=3, g=g)
        mask[:, 0] |= ~mask.any(1)  # at least one masked frame per clip
        logits = model(wave, mask)
        loss = F.cross_entropy(logits[mask], labels[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        wave, labels = make_clips(128, frames, g)
        mask = span_mask(128, frames, p=0.1, span=3, g=g)
        accuracy = float((model(wave, mask).argmax(-1)[mask] == labels[mask]).float().mean())
        masked_share = float(mask.float().mean())
    return {"loss_first": losses[0], "loss_last": sum(losses[-10:]) / 10, "accuracy": accuracy,
            "chance": 1 / CLASSES, "masked_share": masked_share}


if __name__ == "__main__":
    print(main())
