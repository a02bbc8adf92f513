"""Composable attention masks (``&``, ``|``, ``~``), built analytically.

Every mask answers ``allowed(b, h, q_idx, kv_idx, nq, nk)`` on index tensors and offers
``materialize``, ``block_map``, ``sparsity`` and ``draw``. See :mod:`qkv.masks.base` for positions
and alignment.

Example:
    >>> from qkv import masks
    >>> longformer = masks.sliding_window(1, 1) | masks.global_tokens([0])
    >>> print(longformer.draw(5))
    xxxxx
    xxx..
    xxxx.
    x.xxx
    x..xx
"""

from .base import EMPTY, FULL, PARTIAL, Mask
from .causal import causal, sliding_window
from .explicit import dense, from_fn, graph, graph_from_edges
from .sequence import document, document_from_cu_seqlens, padding, positions, prefix_lm
from .sparse import bigbird, fixed, global_tokens, strided
from .topk import topk

__all__ = [
    "Mask", "EMPTY", "PARTIAL", "FULL",
    "causal", "sliding_window", "padding", "document", "document_from_cu_seqlens", "prefix_lm", "positions",
    "global_tokens", "strided", "fixed", "bigbird", "graph", "graph_from_edges", "dense", "from_fn",
    "topk",
]
