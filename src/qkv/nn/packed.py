"""Padding-free training of a whole model: every attention call kept within the packed documents.

:func:`qkv.varlen.pack` removes the padding of a batch into one row of real tokens with ``cu_seqlens``; within
:func:`packed_documents`, each attention module's operator hook (:class:`qkv.nn.protocol.AttentionModule`'s
``attention_fn``) also masks across those documents, so the packed row computes what the padded batch would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .. import masks as M
from ..varlen import as_cu_seqlens
from .protocol import attention_modules

__all__ = ["packed_documents"]


@contextlib.contextmanager
def packed_documents(model: torch.nn.Module, cu_seqlens: torch.Tensor) -> Iterator[None]:
    """Within the block, every attention call of ``model`` (each module's ``attention_fn``, the hook every
    qkv attention module runs attention through, :class:`qkv.nn.protocol.AttentionModule`) also masks across
    the packed sequences of ``cu_seqlens``. A model holding an attention module without that hook (linear
    attention) is refused: its attention would cross documents.

    Run the packed tokens as one row with per-sequence positions::

        p = qkv.varlen.pack(input_ids, attention_mask)
        with qkv.nn.packed_documents(model, p.cu_seqlens):
            logits = model(p.values[None], positions=p.positions[None]).logits   # (1, total, V)
    """
    doc = M.document_from_cu_seqlens(as_cu_seqlens(cu_seqlens, "cu_seqlens").cpu())
    found = attention_modules(model)
    if not found:
        raise TypeError(f"packed_documents: {type(model).__name__} has no attention module with an attention_fn "
                        "hook (qkv.nn.protocol.AttentionModule); it is the attribute qkv's attention modules run "
                        "attention through")
    hookless = [f"{name or 'the model'} ({type(m).__name__})" for name, m in found if m.attention_fn is None]
    if hookless:
        raise TypeError(f"packed_documents: {', '.join(hookless)} computes no softmax attention (attention_fn is "
                        "None), so its attention cannot be kept within documents here; run such modules on each "
                        "sequence apart (or with their own state per document)")
    hooked = [m for _, m in found]
    saved = [m.attention_fn for m in hooked]

    def restricted(fn):
        def attention_fn(q, k, v, *, mask=None, **kw):
            return fn(q, k, v, mask=doc if mask is None else mask & doc, **kw)

        return attention_fn

    try:
        for m, fn in zip(hooked, saved):
            m.attention_fn = restricted(fn)
        yield
    finally:
        for m, fn in zip(hooked, saved):
            m.attention_fn = fn
