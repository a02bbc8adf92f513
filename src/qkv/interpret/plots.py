"""PNG pictures of attention: one head, a layer's heads as a grid, rollout, and a pruning curve (matplotlib,
imported when called, drawn with the Agg backend: no display needed).

Every function takes plain tensors (captured with :func:`qkv.interpret.capture`) and token labels, writes
one PNG and returns its path. Past ``label_limit`` tokens the axis labels are left out (they would overlap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["plot_attention", "plot_layer_grid", "plot_rollout", "plot_pruning_curve"]

_LABEL_LIMIT = 80


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _check_tokens(tokens: Sequence[str] | None, n: int, name: str, fn: str) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, str) or len(tokens) != n:
        raise ValueError(f"{fn}: {name} must be a sequence of {n} token strings (one per row/column), got "
                         f"{'a str' if isinstance(tokens, str) else f'{len(tokens)} items'}")
    return [str(t) for t in tokens]


def _heatmap(ax, probs: torch.Tensor, tokens_q, tokens_k, *, fontsize: int = 8, cmap: str = "viridis"):
    nq, nk = probs.shape
    im = ax.imshow(probs.detach().float().cpu().numpy(), cmap=cmap, vmin=0.0, interpolation="nearest")
    if tokens_k and nk <= _LABEL_LIMIT:
        ax.set_xticks(range(nk), tokens_k, rotation=60, ha="right", fontsize=fontsize)
    if tokens_q and nq <= _LABEL_LIMIT:
        ax.set_yticks(range(nq), tokens_q, fontsize=fontsize)
    return im


def plot_attention(probs: torch.Tensor, path: str | Path, *, tokens_q: Sequence[str] | None = None,
                   tokens_k: Sequence[str] | None = None, title: str = "") -> Path:
    """Write a heatmap PNG of one (Nq, Nk) attention map; rows are queries, columns keys.

    Example:
        >>> import torch, tempfile, pathlib
        >>> p = plot_attention(torch.softmax(torch.randn(3, 3), -1), pathlib.Path(tempfile.mkdtemp()) / "a.png",
        ...                    tokens_q=list("abc"), tokens_k=list("abc"))
        >>> p.suffix
        '.png'
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError(f"plot_attention: expected one (Nq, Nk) map, got shape {tuple(getattr(probs, 'shape', ()))}")
    nq, nk = probs.shape
    tq = _check_tokens(tokens_q, nq, "tokens_q", "plot_attention")
    tk = _check_tokens(tokens_k, nk, "tokens_k", "plot_attention")
    side = min(0.3 * max(nq, nk), 14.0)
    fig = _figure(2.0 + side * nk / max(nq, nk), 1.5 + side * nq / max(nq, nk))
    ax = fig.add_subplot()
    im = _heatmap(ax, probs, tq, tk)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    return _save(fig, path)


def plot_layer_grid(probs: torch.Tensor, path: str | Path, *, tokens: Sequence[str] | None = None,
                    title: str = "", columns: int | None = None) -> Path:
    """Write every head of one layer, (H, Nq, Nk), as a grid of heatmaps (head ``h`` titled ``h``); token
    labels on the outer axes."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 3:
        raise ValueError(f"plot_layer_grid: expected one layer's maps (H, Nq, Nk), got shape "
                         f"{tuple(getattr(probs, 'shape', ()))}; index a captured (B, H, Nq, Nk) map with [0]")
    H, nq, nk = probs.shape
    toks = _check_tokens(tokens, nk, "tokens", "plot_layer_grid") if nq == nk else None
    cols = columns or math.ceil(math.sqrt(H))
    rows = math.ceil(H / cols)
    cell = 2.6 if max(nq, nk) <= 24 else 3.2
    fig = _figure(cols * cell + 0.8, rows * cell + 0.8)
    for h in range(H):
        ax = fig.add_subplot(rows, cols, h + 1)
        small = max(nq, nk) <= 24
        _heatmap(ax, probs[h], toks if small and h % cols == 0 else None,
                 toks if small and h // cols == rows - 1 else None, fontsize=5)
        if not (small and h % cols == 0):
            ax.set_yticks([])
        if not (small and h // cols == rows - 1):
            ax.set_xticks([])
        ax.set_title(f"head {h}", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_rollout(rollout: torch.Tensor, path: str | Path, *, tokens: Sequence[str] | None = None,
                 title: str = "attention rollout") -> Path:
    """Write an (N, N) rollout (or flow) map: row ``i`` is output token ``i``'s mix over input tokens."""
    if not isinstance(rollout, torch.Tensor) or rollout.dim() != 2:
        raise ValueError(f"plot_rollout: expected one (N, N) map (index the batch of attention_rollout's (B, N, N) "
                         f"result), got shape {tuple(getattr(rollout, 'shape', ()))}")
    return plot_attention(rollout, path, tokens_q=tokens, tokens_k=tokens, title=title)


def plot_pruning_curve(removed: Sequence[int], measure: Sequence[float], path: str | Path, *,
                       ylabel: str = "measure", title: str = "head pruning") -> Path:
    """Write a line plot of a measure against the number of heads removed."""
    if len(removed) != len(measure) or not removed:
        raise ValueError(f"plot_pruning_curve: removed and measure must be equal-length, non-empty, got "
                         f"{len(removed)} and {len(measure)}")
    fig = _figure(5.0, 3.4)
    ax = fig.add_subplot()
    ax.plot(list(removed), list(measure), marker="o")
    ax.set_xlabel("heads removed (least important first)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)
