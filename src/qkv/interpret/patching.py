"""Activation patching and ablation at the head level.

A head's output is what its attention returns, (B, Nq, Dv) per head, before the output projection mixes
heads. :func:`head_outputs` records it; :func:`patch_heads` replaces chosen heads' outputs during a forward
with given tensors (those of another input: activation patching) and :func:`ablate_heads` with zeros or
with their mean over a reference batch (mean ablation). Both go through the modules' ``attention_fn``
hook, so the rest of the forward is the model's own.

Shape legend: B batch, H heads, Nq query rows, Dv value width.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from .._request import AttentionOutput
from .capture import attention_modules, choose_modules, hooked, run_model

__all__ = ["head_outputs", "patch_heads", "ablate_heads"]


def _split_out(res):
    return (res.out, res) if isinstance(res, AttentionOutput) else (res, None)


def _refuse_folded(name: str, q: torch.Tensor, H: int) -> None:
    if q.shape[1] != H:
        raise ValueError(f"patching: {name} ran {q.shape[1]} attention heads for {H} query heads (MLA's absorbed "
                         "path folds heads); build LatentAttention with path='expanded' to patch it")


def head_outputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 layers=None, **forward_kwargs) -> list[torch.Tensor]:
    """Every head's output, (B, H, Nq, Dv) per chosen attention module, on one input (no gradients)."""
    chosen = choose_modules(model, layers)
    got: list[torch.Tensor | None] = [None] * len(chosen)

    def make(i, module, original):
        def record(q, k, v, **kw):
            res = original(q, k, v, **kw)
            got[i] = _split_out(res)[0].detach().clone()
            return res
        return record

    with hooked([m for _, m in chosen], make), torch.no_grad():
        run_model(model, input_ids, attention_mask, **forward_kwargs)
    return got  # type: ignore[return-value]


@contextmanager
def patch_heads(model: nn.Module, replacements: Mapping[tuple[int, int], torch.Tensor]) -> Iterator[None]:
    """Within the block, head ``h`` of attention module ``l`` outputs ``replacements[(l, h)]``.

    Args:
        model: a qkv model.
        replacements: ``{(module index, head): tensor}``, each tensor broadcastable to that head's (B, Nq, Dv)
            output (e.g. ``head_outputs(model, other_ids)[l][:, h]`` for activation patching, or a (Dv,)
            mean for mean ablation).

    Example:
        >>> import torch
        >>> from qkv.nn import TransformerConfig, TransformerEncoder
        >>> enc = TransformerEncoder(TransformerConfig(d_model=16, n_heads=2, n_layers=1)).eval()
        >>> x = torch.randn(1, 4, 16)
        >>> with patch_heads(enc, {(0, 1): torch.zeros(8)}):
        ...     y = enc(x)
        >>> y.shape
        torch.Size([1, 4, 16])
    """
    mods = attention_modules(model)
    per_module: dict[int, dict[int, torch.Tensor]] = {}
    for key, t in replacements.items():
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(x, int) for x in key)):
            raise TypeError(f"patch_heads: keys must be (module index, head) int pairs, got {key!r}")
        l, h = key
        if not 0 <= l < len(mods):
            raise ValueError(f"patch_heads: module {l} is out of range; the model has {len(mods)} attention modules")
        if not 0 <= h < mods[l][1].n_heads:
            raise ValueError(f"patch_heads: head {h} is out of range for {mods[l][0]} "
                             f"({mods[l][1].n_heads} heads)")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"patch_heads: replacement for {key} must be a tensor, got {type(t).__name__}")
        per_module.setdefault(l, {})[h] = t
    index = sorted(per_module)
    modules = [mods[l][1] for l in index]

    def make(i, module, original):
        l = index[i]
        name = mods[l][0]

        def patched(q, k, v, **kw):
            res = original(q, k, v, **kw)
            out, full = _split_out(res)
            _refuse_folded(name, q, module.n_heads)
            out = out.clone()
            for h, t in per_module[l].items():
                if not 0 <= h < out.shape[1]:
                    raise ValueError(f"patch_heads: head {h} is out of range for {name} ({out.shape[1]} heads)")
                try:
                    out[:, h] = t.to(out.dtype).expand_as(out[:, h])
                except RuntimeError as e:
                    raise ValueError(f"patch_heads: replacement for ({l}, {h}) of shape {tuple(t.shape)} does not "
                                     f"broadcast to the head's output {tuple(out[:, h].shape)} (B, Nq, Dv)") from e
            return out if full is None else full._replace(out=out)
        return patched

    with hooked(modules, make):
        yield


@contextmanager
def ablate_heads(model: nn.Module, heads: Iterable[tuple[int, int]], *,
                 reference: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Within the block, the listed ``(module, head)`` pairs output zeros, or, with ``reference`` (the
    :func:`head_outputs` of a reference batch), their mean output over that batch and its positions."""
    n_mods = len(attention_modules(model))
    if reference is not None and (not isinstance(reference, (list, tuple)) or len(reference) != n_mods):
        raise ValueError(f"ablate_heads: reference must be head_outputs(model, ids) for all {n_mods} attention "
                         f"modules (layers=None), got {type(reference).__name__} of "
                         f"{len(reference) if isinstance(reference, (list, tuple)) else '?'} items")
    reps = {}
    for pair in heads:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"ablate_heads: heads must be (module index, head) pairs, got {pair!r}")
        l, h = pair
        if reference is None:
            reps[(l, h)] = torch.zeros(())
        elif not 0 <= l < n_mods:  # patch_heads words the error
            reps[(l, h)] = torch.zeros(())
        else:
            reps[(l, h)] = reference[l][:, h].mean(dim=(0, 1))  # (Dv,)
    with patch_heads(model, reps):
        yield
