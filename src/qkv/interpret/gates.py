"""Head gates, head importance and pruning on qkv models.

Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?": a gate ``xi_h`` multiplies each
head's output (before the output projection); the importance of a head is ``E_x |dL/dxi_h|`` at
``xi = 1``, normalized per layer by the L2 norm; heads are pruned in increasing order of importance.

Every qkv attention module carries a ``head_gate`` attribute: None (the default) means 1 and costs
nothing; a (H,) tensor multiplies head ``h``'s output by ``head_gate[h]``. :func:`head_gates` sets them for
the duration of a block.

Shape legend: L attention modules (see :func:`qkv.interpret.attention_modules`), H heads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from ..nn.protocol import attention_modules

__all__ = ["head_counts", "head_gates", "prune_heads", "model_head_importance", "PruningCurve", "pruning_curve"]


def head_counts(model: nn.Module) -> list[int]:
    """Query heads of each attention module (its ``n_heads``), in :func:`attention_modules` order."""
    return [m.n_heads for _, m in attention_modules(model)]


def _shape(model: nn.Module) -> tuple[list[nn.Module], int]:
    mods = [m for _, m in attention_modules(model)]
    counts = head_counts(model)
    if not mods:
        raise ValueError(f"head_gates: {type(model).__name__} has no qkv attention module")
    if len(set(counts)) != 1:
        raise ValueError(f"head_gates: the attention modules have different head counts {counts}; gate them one by "
                         "one through their head_gate attribute")
    return mods, counts[0]


@contextmanager
def head_gates(model: nn.Module, gates: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Within the block, module ``l``'s head ``h`` output is multiplied by ``gates[l, h]``.

    Args:
        model: a qkv model.
        gates: (L, H) float tensor (default ones); make it ``requires_grad`` for importance gradients.

    Yields:
        The (L, H) gates in use. Every module's previous ``head_gate`` is restored on exit.

    Example:
        >>> import torch
        >>> from qkv.nn import TransformerConfig, TransformerEncoder
        >>> enc = TransformerEncoder(TransformerConfig(d_model=16, n_heads=2, n_layers=2)).eval()
        >>> x = torch.randn(1, 5, 16)
        >>> with head_gates(enc) as g:
        ...     same = torch.allclose(enc(x), enc(x))
        >>> same, g.shape
        (True, torch.Size([2, 2]))
    """
    mods, H = _shape(model)
    if gates is None:
        gates = torch.ones(len(mods), H)
    if not isinstance(gates, torch.Tensor) or tuple(gates.shape) != (len(mods), H) or not gates.is_floating_point():
        raise ValueError(f"head_gates: gates must be a float ({len(mods)}, {H}) tensor (modules x heads), got "
                         f"{tuple(getattr(gates, 'shape', ())) or type(gates).__name__}")
    saved = [m.head_gate for m in mods]
    try:
        for m, g in zip(mods, gates):
            m.head_gate = g
        yield gates
    finally:
        for m, g in zip(mods, saved):
            m.head_gate = g


@contextmanager
def prune_heads(model: nn.Module, heads: Iterable[tuple[int, int]]) -> Iterator[torch.Tensor]:
    """Within the block, the listed ``(module, head)`` pairs output zeros (gates 0, the rest 1)."""
    mods, H = _shape(model)
    gates = torch.ones(len(mods), H)
    for pair in heads:
        l, h = pair
        if not (0 <= l < len(mods) and 0 <= h < H):
            raise ValueError(f"prune_heads: head {pair} is outside ({len(mods)} modules, {H} heads)")
        gates[l, h] = 0.0
    with head_gates(model, gates) as g:
        yield g


def model_head_importance(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor],
                          *, normalize: bool = True) -> torch.Tensor:
    """Michel et al.'s importance ``E_batch |dL/dxi|`` of every head of ``model``.

    Args:
        model: a qkv model (kept in its mode; use eval for deterministic scores).
        batches: the data to average over; each is handed to ``loss_fn``.
        loss_fn: ``loss_fn(model, batch) -> scalar`` differentiable loss (the model runs with gates in place).
        normalize: divide each module's scores by their L2 norm (the paper's normalization).

    Returns:
        (L, H) float32 importance scores.
    """
    if not callable(loss_fn):
        raise TypeError(f"model_head_importance: loss_fn must be callable as loss_fn(model, batch), got "
                        f"{type(loss_fn).__name__} (arguments: model, batches, loss_fn)")
    mods, H = _shape(model)
    total = torch.zeros(len(mods), H, dtype=torch.float64)
    n = 0
    for batch in batches:
        gates = torch.ones(len(mods), H, requires_grad=True)
        with head_gates(model, gates):
            loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"model_head_importance: loss_fn must return a scalar tensor, got "
                             f"{getattr(loss, 'shape', type(loss).__name__)}")
        (grad,) = torch.autograd.grad(loss, gates)
        total += grad.abs().double()
        n += 1
    if n == 0:
        raise ValueError("model_head_importance: batches is empty")
    scores = total / n
    if normalize:
        scores = scores / scores.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return scores.float()


class PruningCurve(NamedTuple):
    """``removed[i]`` heads pruned (least important first) gives ``measure[i]``; ``order`` lists the
    ``(module, head)`` pairs in pruning order."""

    removed: list[int]
    measure: list[float]
    order: list[tuple[int, int]]

    def table(self) -> str:
        """A plain-text table, one line per point."""
        lines = ["heads removed | measure", "------------- | -------"]
        lines += [f"{r:13d} | {m:.4f}" for r, m in zip(self.removed, self.measure)]
        return "\n".join(lines)


def pruning_curve(model: nn.Module, importance: torch.Tensor, measure: Callable[[nn.Module], float],
                  steps: Sequence[int]) -> PruningCurve:
    """Prune heads in increasing order of ``importance`` and evaluate ``measure(model)`` after each step.

    Args:
        importance: (L, H) scores (e.g. :func:`model_head_importance`).
        measure: ``measure(model) -> float`` (higher is better, e.g. embedding agreement).
        steps: numbers of heads removed at which to measure (e.g. ``range(0, L * H + 1, 6)``).
    """
    mods, H = _shape(model)
    if tuple(importance.shape) != (len(mods), H):
        raise ValueError(f"pruning_curve: importance must be ({len(mods)}, {H}), got {tuple(importance.shape)}")
    total = len(mods) * H
    steps = list(steps)
    if not steps or any(not isinstance(s, int) or not 0 <= s <= total for s in steps):
        raise ValueError(f"pruning_curve: steps must be ints in [0, {total}], got {steps}")
    flat = importance.flatten().argsort(stable=True).tolist()
    order = [(i // H, i % H) for i in flat]
    values = []
    for s in steps:
        with prune_heads(model, order[:s]), torch.no_grad():
            value = measure(model)
            if not isinstance(value, (int, float)) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
                raise TypeError(f"pruning_curve: measure(model) must return a number, got {type(value).__name__}")
            values.append(float(value))
    return PruningCurve(steps, values, order)
