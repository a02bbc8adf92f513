"""A Vision Transformer on synthetic images: Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words:
Transformers for Image Recognition at Scale".

An image is cut into patches, each patch is a token (a linear projection of its pixels), a learned [CLS]
token is prepended, learned absolute positions are added, and a bidirectional
:class:`qkv.nn.TransformerEncoder` mixes the tokens; the [CLS] output is classified.

Data: 16x16 grayscale images holding one line, horizontal, vertical, diagonal or anti-diagonal, at a random
offset, under Gaussian noise. Four classes, chance is 25%.

Run: ``python examples/vit.py`` (a few seconds on a CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn import TransformerConfig, TransformerEncoder

__all__ = ["ViT", "make_images", "main"]

CLASSES = ("horizontal", "vertical", "diagonal", "anti-diagonal")


def make_images(n: int, *, size: int = 16, noise: float = 0.5, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (n, 1, size, size) float32 and their labels (n,) int64 in ``0..3`` (see ``CLASSES``)."""
    labels = torch.randint(0, 4, (n,), generator=generator)
    offset = torch.randint(0, size, (n, 1), generator=generator)
    images = noise * torch.randn(n, size, size, generator=generator)
    i = torch.arange(size).expand(n, size)  # walk along the line
    o = offset.expand(n, size)
    lab = labels.view(-1, 1)
    rows = torch.where(lab == 0, o, i)
    cols = torch.where(lab == 0, i, torch.where(lab == 1, o, torch.where(lab == 2, (i + o) % size, (o - i) % size)))
    images[torch.arange(n).view(-1, 1), rows, cols] += 1.0
    return images.unsqueeze(1), labels


class ViT(nn.Module):
    """Patch embedding + [CLS] + :class:`TransformerEncoder` + linear classifier.

    ``forward(images)``: (B, C, H, W) -> (B, num_classes) logits.
    """

    def __init__(self, *, image_size: int = 16, patch: int = 4, channels: int = 1, num_classes: int = 4,
                 d_model: int = 64, n_heads: int = 4, n_layers: int = 2) -> None:
        super().__init__()
        self.patch = patch
        n_patches = (image_size // patch) ** 2
        cfg = TransformerConfig(d_model=d_model, n_heads=n_heads, n_layers=n_layers, d_ff=2 * d_model,
                                activation="gelu", norm="layer", position="learned",
                                max_position_embeddings=n_patches + 1)
        self.to_tokens = nn.Linear(channels * patch * patch, d_model)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.encoder = TransformerEncoder(cfg)  # adds the learned positions, ends with a LayerNorm
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B = images.shape[0]
        patches = F.unfold(images, self.patch, stride=self.patch).transpose(1, 2)  # (B, P, C * patch^2)
        tokens = torch.cat((self.cls.expand(B, -1, -1), self.to_tokens(patches)), dim=1)  # (B, 1 + P, d)
        return self.head(self.encoder(tokens)[:, 0])  # classify the [CLS] token


def main(steps: int = 150, seed: int = 0, *, batch: int = 64, verbose: bool = False) -> dict[str, float]:
    """Train on fresh synthetic batches; return the first/last training loss and held-out accuracy."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = ViT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        images, labels = make_images(batch, generator=g)
        loss = F.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if verbose and step % 25 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        images, labels = make_images(512, generator=g)
        accuracy = float((model(images).argmax(-1) == labels).float().mean())
    return {"loss_first": losses[0], "loss_last": sum(losses[-10:]) / len(losses[-10:]), "accuracy": accuracy,
            "chance": 1 / len(CLASSES)}


if __name__ == "__main__":
    print(main(verbose=True))
