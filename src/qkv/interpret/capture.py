"""Capture the attention probabilities of a qkv model while it runs on its fast backend.

Every qkv attention module (:class:`qkv.nn.protocol.AttentionModule`: the decoder's self attention,
:class:`qkv.nn.MultiHeadAttention` and its BERT subclass, :class:`qkv.nn.LatentAttention`, T5's self and cross
attention) calls its operator through one attribute, ``attention_fn``; :func:`attention_modules` lists them in
forward order (T5: every encoder layer, then per decoder layer its self and its cross attention). Modules
without softmax attention (``attention_fn`` None: linear attention, Performer) have no map; choosing one is
refused. :func:`capture` swaps in a recorder for the chosen modules: it runs the
module's own operator unchanged (the forward keeps its backend and result) and, from the very ``q``, ``k``
(already rotated by RoPE), mask, score modifiers and scale the module passed, recomputes the chosen heads
and query rows exactly with :func:`qkv.attention_probs` (a log-sum-exp pass, skipped when the module
asked its operator for the log-sum-exp, then the requested rows a chunk at a time). Memory is the returned
maps: ``B * heads * rows * Nk`` floats per layer.

Shape legend: B batch, H query heads, Nq query rows, Nk keys, nh/nr chosen heads/rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .._probs import attention_probs
from .._request import AttentionOutput
from ..nn.protocol import attention_modules

__all__ = ["attention_modules", "capture", "capture_stats", "hooked", "run_model"]


def choose_modules(model: nn.Module, layers) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs ``layers`` selects (indices or names; None: all), validated."""
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"capture: {type(model).__name__} has no qkv attention module (qkv.nn.protocol."
                         "AttentionModule: MultiHeadAttention, LatentAttention, a DecoderLM layer); load HF models "
                         "with qkv.models.from_hf")
    if layers is None:
        return mods
    if isinstance(layers, (int, str)):
        layers = [layers]
    names = [n for n, _ in mods]
    out = []
    for sel in layers:
        if isinstance(sel, bool) or not isinstance(sel, (int, str)):
            raise TypeError(f"capture: layers must hold ints (indices into attention_modules(model)) or module "
                            f"names, got {type(sel).__name__}")
        if isinstance(sel, int):
            if not -len(mods) <= sel < len(mods):
                raise ValueError(f"capture: layer {sel} is out of range; the model has {len(mods)} attention "
                                 f"modules (indices 0..{len(mods) - 1})")
            out.append(mods[sel])
        else:
            if sel not in names:
                raise ValueError(f"capture: no attention module named {sel!r}; the model has {names[:6]}"
                                 f"{' ...' if len(names) > 6 else ''}")
            out.append(mods[names.index(sel)])
    return out


@contextmanager
def hooked(modules: Sequence[nn.Module], make: Callable[[int, nn.Module, Callable], Callable]) -> Iterator[None]:
    """Within the block, module ``i``'s ``attention_fn`` is ``make(i, module, original)``; restored after,
    whatever happens. A module without an operator hook (``attention_fn`` None) is refused before any is set."""
    for m in modules:
        if m.attention_fn is None:
            raise TypeError(f"{type(m).__name__} (layer_idx {m.layer_idx}) computes no softmax attention (its "
                            "attention_fn is None): there are no attention probabilities or head outputs to hook; "
                            "choose the model's softmax attention modules (layers=[...])")
    saved = [m.attention_fn for m in modules]
    try:
        for i, (m, fn) in enumerate(zip(modules, saved)):
            m.attention_fn = make(i, m, fn)
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.attention_fn = fn


def run_model(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
    """One forward of a qkv model on ``input_ids`` (B, N) with HF's ``attention_mask`` (B, N) 1 real / 0
    padding (BERT, T5 and the decoder all take it); T5 encoder-decoders take ``decoder_input_ids`` in
    ``kwargs``. A :mod:`qkv.nn` stack over embeddings (``TransformerEncoder``, ``TransformerDecoder``, a
    ``MultiHeadAttention``) takes a floating (B, N, d) ``input_ids``; its padding goes in ``kwargs``
    (``lengths=``, ``mask=``)."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"capture: input_ids must be a (B, N) integer tensor (token ids) or a (B, N, d) floating "
                         f"tensor (embeddings for a qkv.nn stack), got {type(input_ids).__name__}")
    embeddings = input_ids.dtype.is_floating_point
    if input_ids.dim() != (3 if embeddings else 2) or input_ids.dtype == torch.bool:
        raise ValueError(f"capture: input_ids must be a (B, N) integer tensor (token ids) or a (B, N, d) floating "
                         f"tensor (embeddings for a qkv.nn stack), got {input_ids.dtype} of shape "
                         f"{tuple(input_ids.shape)}")
    if attention_mask is not None and embeddings:
        raise ValueError("capture: attention_mask (B, N) is for models that take token ids; a qkv.nn stack over "
                         "embeddings takes its padding as a forward keyword: capture(model, x, lengths=...) or "
                         "mask=qkv.masks.padding(...)")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        raise ValueError(f"capture: attention_mask must be (B, N) like input_ids {tuple(input_ids.shape)}, got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if "decoder_input_ids" in kwargs:
        return model(input_ids, kwargs.pop("decoder_input_ids"), **kwargs)
    return model(input_ids, **kwargs)


def folded_heads(module: nn.Module, q: torch.Tensor) -> int:
    """How many of ``module``'s heads its operator call stacked as query rows of one head: ``n_heads`` when the
    call's queries carry one head for several (MLA's absorbed path: (B, 1, H * Nq, D)), else 1."""
    H = module.n_heads
    if q.shape[1] == H:
        return 1
    if q.shape[1] == 1:
        return H
    raise ValueError(f"capture: {type(module).__name__} has {H} query heads but called its operator with "
                     f"{q.shape[1]}; only all heads, or all heads stacked as rows of one, can be read back")


def capture(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
            layers=None, heads=None, rows=None, **forward_kwargs) -> list[torch.Tensor]:
    """The attention probabilities of a qkv model's layers on one input, from its fast backend.

    Args:
        model: a qkv model (``qkv.models.from_hf(...)``, a :class:`qkv.nn.DecoderLM`, BERT, T5,
            any module built from ``qkv.nn`` attention modules). Run in eval mode: probabilities are those
            before dropout.
        input_ids: (B, N) int64 token ids, or (B, N, d) floating embeddings for a :mod:`qkv.nn` stack that
            takes them (``TransformerEncoder``, ``TransformerDecoder``; its padding goes in ``forward_kwargs``:
            ``lengths=`` or ``mask=``).
        attention_mask: (B, N) 1 for real tokens, 0 for padding (HF convention), or None; token ids only.
        layers: which attention modules (indices into :func:`attention_modules` or module names); default all.
        heads: query heads to keep (int, list or 1-D integer tensor); default all.
        rows: query rows to keep; default all. Bound memory on long inputs by choosing heads and rows (or use
            :func:`qkv.attention_stats` for statistics over all rows in O(N) memory).
        forward_kwargs: passed to the model's forward (``decoder_input_ids`` for T5, ``positions``, ...).

    Returns:
        One (B, nh, nr, Nk) float32 tensor per captured module, in forward order. Padded query rows hold
        whatever the model computed for them (a row with no allowed key is zeros).

    Example:
        >>> import torch
        >>> from qkv.nn import DecoderConfig, DecoderLM
        >>> lm = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
        ...                              num_attention_heads=4, intermediate_size=64)).eval()
        >>> maps = capture(lm, torch.randint(0, 50, (1, 6)), layers=[1], heads=[0, 2])
        >>> len(maps), maps[0].shape
        (1, torch.Size([1, 2, 6, 6]))
    """
    chosen = choose_modules(model, layers)
    modules = [m for _, m in chosen]
    names = [n for n, _ in chosen]
    got: list[torch.Tensor | None] = [None] * len(modules)

    def make(i, module, original):
        def record(q, k, v, *, mask=None, score_mod=None, scale=None, **kw):
            out = original(q, k, v, mask=mask, score_mod=score_mod, scale=scale, **kw)
            if got[i] is not None:
                raise RuntimeError(f"capture: {names[i]} ran attention twice in one forward; capture one forward "
                                   "pass (no generation loop, no packed segments)")
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            folded = folded_heads(module, qd)
            lse = out.lse.detach() if isinstance(out, AttentionOutput) else None  # the module asked for it: reuse
            if folded == 1:
                got[i] = attention_probs(qd, kd, vd, mask=mask, score_mod=score_mod, scale=scale, heads=heads,
                                         rows=rows, lse=lse)
            else:
                nq = qd.shape[2] // folded
                h_sel = torch.arange(folded) if heads is None else _as_index(heads, folded, "heads")
                r_sel = torch.arange(nq) if rows is None else _as_index(rows, nq, "rows")
                flat = (h_sel.view(-1, 1) * nq + r_sel.view(1, -1)).reshape(-1)
                p = attention_probs(qd, kd, vd, mask=mask, score_mod=score_mod, scale=scale, rows=flat, lse=lse)
                got[i] = p.view(p.shape[0], h_sel.numel(), r_sel.numel(), p.shape[-1])
            return out
        return record

    return _collect("capture", model, modules, names, got, make, input_ids, attention_mask, forward_kwargs)


def capture_stats(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  layers=None, positions=None, block_rows: int | None = None, **forward_kwargs) -> list:
    """Per captured module, :class:`qkv.AttentionStats` over every head and query row (column sums, entropy,
    attention to the key ``positions``), streamed from the log-sum-exp with :func:`qkv.attention_stats`:
    O(N) memory per layer, so long inputs need not choose rows. Arguments as in :func:`capture`.

    Example:
        >>> import torch
        >>> from qkv.nn import DecoderConfig, DecoderLM
        >>> lm = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
        ...                              num_attention_heads=4, intermediate_size=64)).eval()
        >>> st = capture_stats(lm, torch.randint(0, 50, (1, 9)), positions=[0])
        >>> st[0].column_sums.shape, st[0].to_positions.shape
        (torch.Size([1, 4, 9]), torch.Size([1, 4, 9, 1]))
    """
    from .._probs import attention_stats

    chosen = choose_modules(model, layers)
    modules = [m for _, m in chosen]
    names = [n for n, _ in chosen]
    got: list = [None] * len(modules)

    def make(i, module, original):
        def record(q, k, v, *, mask=None, score_mod=None, scale=None, **kw):
            out = original(q, k, v, mask=mask, score_mod=score_mod, scale=scale, **kw)
            if got[i] is not None:
                raise RuntimeError(f"capture_stats: {names[i]} ran attention twice in one forward")
            if folded_heads(module, q) != 1:
                raise ValueError(f"capture_stats: {names[i]} runs MLA's absorbed path (heads folded into rows); "
                                 "build its LatentAttention with path='expanded'")
            got[i] = attention_stats(q.detach(), k.detach(), v.detach(), mask=mask, score_mod=score_mod,
                                     scale=scale, positions=positions, block_rows=block_rows)
            return out
        return record

    return _collect("capture_stats", model, modules, names, got, make, input_ids, attention_mask, forward_kwargs)


def _collect(caller: str, model, modules, names, got: list, make, input_ids, attention_mask, forward_kwargs) -> list:
    """Run the model once with ``make``'s recorders on ``modules`` and return what they filled in ``got``;
    raises naming the modules that ran no attention."""
    with hooked(modules, make), torch.no_grad():
        run_model(model, input_ids, attention_mask, **forward_kwargs)
    missing = [n for n, g in zip(names, got) if g is None]
    if missing:
        raise RuntimeError(f"{caller}: {missing} ran no attention in this forward (a cached cross attention, or a "
                           "module the model does not call)")
    return got


def _as_index(sel, n: int, name: str) -> torch.Tensor:
    from .._probs import index_selection

    return index_selection(sel, n, name, "capture")
