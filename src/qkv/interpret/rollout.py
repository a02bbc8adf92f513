"""Attention rollout and attention flow across layers; Michel et al.'s head-importance formula.

- Attention rollout and attention flow: Abnar & Zuidema 2020, "Quantifying Attention Flow in
  Transformers". Rollout multiplies the per-layer attention (heads averaged, the residual path added
  as ``0.5 A + 0.5 I`` and rows renormalized) from the last layer down to the input. Flow treats the
  layers as a graph whose edge capacities are those attention weights and computes, for each output
  token and input token, the maximum flow between them (scipy's max-flow; capacities are scaled to
  integers, so values carry a ``1 / resolution`` quantization). Flow solves one max-flow problem per
  (output, input) pair; :func:`attention_flow` refuses work past ``max_cost`` and says what it would cost.
- Head importance: Michel et al. 2019, "Are Sixteen Heads Really Better than One?": a gate ``xi_h = 1``
  multiplies each head's output, and importance is ``E_x |dL / d xi_h|``, normalized per layer by the
  L2 norm as in the paper.

Attention maps come from ``qkv.attention_probs`` (exact, recomputed from any backend's lse) or from a
model's own per-layer probabilities; every function takes plain tensors.

Shape legend: L layers, B batch, H heads, N tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["attention_rollout", "attention_flow", "head_importance", "FLOW_MAX_COST"]

#: Default limit of :func:`attention_flow`: max-flow problems times graph edges (about 1-10 s of SciPy).
FLOW_MAX_COST = 2 * 10**9


def _fuse(a: torch.Tensor, head_fusion: str) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"attention maps must be a list of (B, H, N, N) tensors, one per layer, got an item of type "
                        f"{type(a).__name__}")
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
        a_BNN = _with_residual(_fuse(a, head_fusion).double(), residual)
        if out is not None and a_BNN.shape != out.shape:
            raise ValueError(f"attention_rollout: every layer must have the same batch and tokens (B, _, N, N), got "
                             f"{[tuple(getattr(x, 'shape', ())) for x in attentions]}")
        out = a_BNN if out is None else a_BNN @ out
    return out.float()


def attention_flow(attentions: Sequence[torch.Tensor], *, head_fusion: str = "mean", residual: bool = True,
                   resolution: int = 1_000_000, rows=None, max_cost: int = FLOW_MAX_COST) -> torch.Tensor:
    """Maximum flow from each output token to each input token through the layered attention graph.

    Args:
        attentions: per layer, bottom first, (B, H, N, N) probabilities.
        head_fusion, residual: as in :func:`attention_rollout`.
        resolution: capacities are scaled by this and rounded to integers for the max-flow solver.
        rows: output tokens to compute (int, list or 1-D tensor in ``[0, N)``; default all); e.g. ``[0]``
            for the ``[CLS]`` token alone.
        max_cost: refuse when ``B * len(rows) * N`` max-flow problems times ``L * N^2`` edges exceeds it.

    Returns:
        (B, len(rows), N) float32 flow values in [0, 1].

    Example:
        >>> import torch
        >>> a = torch.softmax(torch.randn(2, 1, 1, 4, 4), -1)
        >>> attention_flow(list(a)).shape
        torch.Size([1, 4, 4])
    """
    from .._probs import index_selection

    if not attentions:
        raise ValueError("attention_flow: need at least one layer of attention maps")
    if not isinstance(resolution, int) or not 1 <= resolution <= 2**30 // max(1, len(attentions)):
        raise ValueError(f"attention_flow: resolution must be an int in [1, 2**30 / layers], got {resolution!r}")
    fused = [_with_residual(_fuse(a, head_fusion).double(), residual) for a in attentions]
    B, N = fused[0].shape[0], fused[0].shape[-1]
    if any(f.shape != fused[0].shape for f in fused):
        raise ValueError(f"attention_flow: every layer must have the same (B, H, N, N) shape, got "
                         f"{[tuple(a.shape) for a in attentions]}")
    L = len(fused)
    rows_t = index_selection(rows, N, "rows", "attention_flow")
    problems, edges = B * rows_t.numel() * N, L * N * N
    if problems * edges > max_cost:
        raise ValueError(f"attention_flow: B={B}, N={N}, L={L} and {rows_t.numel()} output rows need {problems:,} "
                         f"max-flow problems over a graph of {edges:,} edges, cost {problems * edges:.2e} > "
                         f"max_cost={max_cost:.2e}; pass rows= (e.g. [0]), fewer tokens, a larger max_cost, or "
                         "use attention_rollout")
    from scipy.sparse import csr_matrix  # after the checks: bad input is refused without scipy installed
    from scipy.sparse.csgraph import maximum_flow

    out = torch.zeros(B, rows_t.numel(), N)
    for b in range(B):
        rows_, cols, caps = [], [], []
        # Node (l, i) = l * N + i; layer 0 is the input, layer L the output. Edges point downwards:
        # output token i at layer l+1 draws on token j at layer l with capacity A_l[i, j].
        for l, a in enumerate(fused):
            w = (a[b] * resolution).round().to(torch.int64)
            i, j = torch.nonzero(w, as_tuple=True)
            rows_.append((l + 1) * N + i)
            cols.append(l * N + j)
            caps.append(w[i, j])
        graph = csr_matrix((torch.cat(caps).numpy().astype("int32"),
                            (torch.cat(rows_).numpy(), torch.cat(cols).numpy())), shape=((L + 1) * N,) * 2)
        for r, i in enumerate(rows_t.tolist()):
            for j in range(N):
                out[b, r, j] = maximum_flow(graph, L * N + i, j).flow_value / resolution
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
    if not callable(loss_fn):
        raise TypeError(f"head_importance: loss_fn must be callable as loss_fn(gates, batch_index), got "
                        f"{type(loss_fn).__name__}")
    for name, value in (("num_layers", num_layers), ("num_heads", num_heads), ("batches", batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"head_importance: {name} must be a positive int, got {value!r}")
    gates = torch.ones(num_layers, num_heads, requires_grad=True)
    total = torch.zeros(num_layers, num_heads)
    for i in range(batches):
        loss = loss_fn(gates, i)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise ValueError(f"head_importance: loss_fn must return a scalar tensor that depends on the gates, got "
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
                             f"{'' if not isinstance(loss, torch.Tensor) or loss.requires_grad else ' without grad'}")
        (grad,) = torch.autograd.grad(loss, gates)
        total += grad.abs()
    scores = total / batches
    if normalize:
        scores = scores / scores.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return scores
