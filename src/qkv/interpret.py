"""Reading attention maps: rollout, flow, head importance, and heatmaps.

- Attention rollout and attention flow: Abnar & Zuidema 2020, "Quantifying Attention Flow in
  Transformers". Rollout multiplies the per-layer attention (heads averaged, the residual path added
  as ``0.5 A + 0.5 I`` and rows renormalized) from the last layer down to the input. Flow treats the
  layers as a graph whose edge capacities are those attention weights and computes, for each output
  token and input token, the maximum flow between them (scipy's max-flow; capacities are scaled to
  integers, so values carry a ``1 / resolution`` quantization).
- Head importance: Michel et al. 2019, "Are Sixteen Heads Really Better than One?": a gate ``xi_h = 1``
  multiplies each head's output, and importance is ``E_x |dL / d xi_h|``, normalized per layer by the
  L2 norm as in the paper.

Attention maps come from ``qkv.attention_probs`` (exact, recomputed from any backend's lse) or from a
model's own per-layer probabilities; every function takes plain tensors.

Shape legend: L layers, B batch, H heads, N tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["attention_rollout", "attention_flow", "head_importance", "plot_attention"]


def _fuse(a: torch.Tensor, head_fusion: str) -> torch.Tensor:
    if a.dim() != 4 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"attention maps must be (B, H, N, N) self-attention, got {tuple(a.shape)}")
    if head_fusion == "mean":
        return a.mean(1)
    if head_fusion == "max":
        return a.amax(1)
    if head_fusion == "min":
        return a.amin(1)
    raise ValueError(f"head_fusion must be 'mean', 'max' or 'min', got {head_fusion!r}")


def _with_residual(a_BNN: torch.Tensor, residual: bool) -> torch.Tensor:
    if residual:
        eye = torch.eye(a_BNN.shape[-1], dtype=a_BNN.dtype, device=a_BNN.device)
        a_BNN = 0.5 * a_BNN + 0.5 * eye
    return a_BNN / a_BNN.sum(-1, keepdim=True).clamp_min(1e-12)


def attention_rollout(attentions: Sequence[torch.Tensor], *, head_fusion: str = "mean",
                      residual: bool = True) -> torch.Tensor:
    """How much each input token contributes to each output token, through all layers.

    Args:
        attentions: per layer, bottom first, probabilities (B, H, N, N).
        head_fusion: ``"mean"`` (the paper), ``"max"`` or ``"min"`` over heads.
        residual: add the identity for the residual connection (the paper's ``0.5 A + 0.5 I``).

    Returns:
        (B, N, N) float, rows sum to 1: row ``i`` is output token ``i``'s mix over input tokens.

    Example:
        >>> import torch
        >>> a = torch.softmax(torch.randn(3, 1, 2, 5, 5), -1)
        >>> attention_rollout(list(a)).sum(-1).allclose(torch.ones(1, 5))
        True
    """
    if not attentions:
        raise ValueError("attention_rollout: need at least one layer of attention maps")
    out = None
    for a in attentions:
        a_BNN = _with_residual(_fuse(a.double(), head_fusion), residual)
        out = a_BNN if out is None else a_BNN @ out
    return out.float()


def attention_flow(attentions: Sequence[torch.Tensor], *, head_fusion: str = "mean", residual: bool = True,
                   resolution: int = 1_000_000) -> torch.Tensor:
    """Maximum flow from each output token to each input token through the layered attention graph.

    Args:
        attentions: per layer, bottom first, (B, H, N, N) probabilities. Cost grows as N^2 max-flow
            problems on (L + 1) * N nodes: meant for sentences, not documents.
        resolution: capacities are scaled by this and rounded to integers for the max-flow solver.

    Returns:
        (B, N, N) float32 flow values in [0, 1].
    """
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    if not attentions:
        raise ValueError("attention_flow: need at least one layer of attention maps")
    fused = [_with_residual(_fuse(a.double(), head_fusion), residual) for a in attentions]
    B, N = fused[0].shape[0], fused[0].shape[-1]
    L = len(fused)
    out = torch.zeros(B, N, N)
    for b in range(B):
        rows, cols, caps = [], [], []
        # Node (l, i) = l * N + i; layer 0 is the input, layer L the output. Edges point downwards:
        # output token i at layer l+1 draws on token j at layer l with capacity A_l[i, j].
        for l, a in enumerate(fused):
            w = (a[b] * resolution).round().to(torch.int64)
            i, j = torch.nonzero(w, as_tuple=True)
            rows.append((l + 1) * N + i)
            cols.append(l * N + j)
            caps.append(w[i, j])
        graph = csr_matrix((torch.cat(caps).numpy().astype("int32"),
                            (torch.cat(rows).numpy(), torch.cat(cols).numpy())), shape=((L + 1) * N,) * 2)
        for i in range(N):
            for j in range(N):
                out[b, i, j] = maximum_flow(graph, L * N + i, j).flow_value / resolution
    return out


def head_importance(loss_fn: Callable[[torch.Tensor], torch.Tensor], num_layers: int, num_heads: int, *,
                    batches: int = 1, normalize: bool = True) -> torch.Tensor:
    """Michel et al.'s head importance ``E |dL/d xi|`` for gates ``xi`` (L, H) on head outputs.

    Args:
        loss_fn: ``loss_fn(gates, batch_index) -> scalar loss`` where the model multiplies head ``h`` of
            layer ``l``'s output by ``gates[l, h]`` (all ones: the model is unchanged).
        batches: how many batches to average over (``batch_index`` runs over ``range(batches)``).
        normalize: divide each layer's scores by their L2 norm (the paper's normalization).

    Returns:
        (L, H) float32 importance scores.
    """
    gates = torch.ones(num_layers, num_heads, requires_grad=True)
    total = torch.zeros(num_layers, num_heads)
    for i in range(batches):
        loss = loss_fn(gates, i)
        (grad,) = torch.autograd.grad(loss, gates)
        total += grad.abs()
    scores = total / batches
    if normalize:
        scores = scores / scores.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return scores


def plot_attention(probs: torch.Tensor, path: str | Path, *, tokens_q: Sequence[str] | None = None,
                   tokens_k: Sequence[str] | None = None, title: str = "") -> Path:
    """Write a heatmap PNG of one (Nq, Nk) attention map; rows are queries, columns keys."""
    if probs.dim() != 2:
        raise ValueError(f"plot_attention: expected one (Nq, Nk) map, got shape {tuple(probs.shape)}")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    nq, nk = probs.shape
    fig = Figure(figsize=(1.2 + 0.45 * nk, 1.0 + 0.45 * nq))
    ax = fig.add_subplot()
    im = ax.imshow(probs.detach().float().cpu().numpy(), cmap="viridis", vmin=0.0)
    ax.set_xticks(range(nk), list(tokens_k) if tokens_k else range(nk), rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(nq), list(tokens_q) if tokens_q else range(nq), fontsize=8)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
