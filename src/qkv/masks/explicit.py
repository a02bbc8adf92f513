"""Masks given element by element: a dense boolean, a graph adjacency, or a user function.

These have no structure to exploit, so their block maps look at every element once (for ``dense`` and
``graph`` that is the size of the input anyway). ``graph`` treats token positions as graph nodes:
Graph Attention Networks (Velickovic et al. 2018) and graph transformers restrict attention to edges.

Example:
    >>> import torch
    >>> from qkv import masks
    >>> m = masks.from_fn(lambda b, h, q, k: (q - k).abs() <= 1)
    >>> print(m.draw(4))
    xx..
    xxx.
    .xxx
    ..xx
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import EMPTY, FULL, Mask, block_map_from_dense, classify, coarse_block_map, row_index
from .causal import _ALIGNS

__all__ = ["dense", "graph", "graph_from_edges", "from_fn", "Dense", "Graph", "FromFn"]


def _bool_tensor(x, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bool:
        raise TypeError(f"{fn}: expected a bool tensor (True = may attend), got {x.dtype}; use tensor.bool() "
                        "or, for an additive float bias, qkv.mods.bias")
    return x


class Dense(Mask):
    """A boolean tensor broadcastable to (B, H, Nq, Nk), indexed by query *row* and key index."""

    def __init__(self, mask: torch.Tensor) -> None:
        m = _bool_tensor(mask, "dense(mask)")
        if m.dim() < 2 or m.dim() > 4:
            raise ValueError(f"dense: expected shape (Nq, Nk), (B, Nq, Nk) or (B, H, Nq, Nk), got {tuple(m.shape)}")
        while m.dim() < 4:
            m = m.unsqueeze(0) if m.dim() != 3 else m.unsqueeze(1)
        self.mask = m.clone()  # a mask is immutable: later in-place edits of the caller's tensor do not reach it
        self.batch = m.shape[0] if m.shape[0] != 1 else None
        self.depends_on_head = m.shape[1] > 1

    def check(self, B, H, nq, nk):
        super().check(B, H, nq, nk)
        _, mh, mq, mk = self.mask.shape
        if (mq, mk) != (nq, nk) or mh not in (1, H):
            raise ValueError(f"dense: mask of shape {tuple(self.mask.shape)} does not fit (B={B}, H={H}, Nq={nq}, "
                             f"Nk={nk}); it must broadcast to (B, H, Nq, Nk)")

    def tensors(self):
        return (self.mask,)

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        m = self.mask.to(kv_idx.device)
        hi = h if m.shape[1] > 1 else torch.zeros_like(h)
        return m[row_index(m, b), hi, q_idx, kv_idx]

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        # A tile is FULL only if full for every head and EMPTY only if empty for every head.
        m = self.mask.to(device)
        full = block_map_from_dense(m.all(1), bq, bk) == FULL
        some = block_map_from_dense(m.any(1), bq, bk) != EMPTY
        return classify(full, some)

    def __repr__(self):
        return f"dense(shape={tuple(self.mask.shape)})"


class Graph(Mask):
    """Attention along the edges of a graph whose nodes are token positions."""

    def __init__(self, adjacency: torch.Tensor, *, self_loops: bool = True) -> None:
        if isinstance(adjacency, torch.Tensor) and adjacency.dtype != torch.bool and adjacency.dim() == 2 \
                and adjacency.shape[0] == 2 and not adjacency.dtype.is_floating_point:
            raise TypeError("graph: an edge list (2, E) needs num_nodes; use graph_from_edges(edge_index, num_nodes)")
        a = _bool_tensor(adjacency, "graph(adjacency)")
        if a.dim() == 2:
            a = a.unsqueeze(0)
        if a.dim() != 3 or a.shape[-1] != a.shape[-2]:
            raise ValueError(f"graph: adjacency must be square (N, N) or (B, N, N), got {tuple(adjacency.shape)}")
        if self_loops:
            a = a | torch.eye(a.shape[-1], dtype=torch.bool, device=a.device)
        self.adj = a if self_loops else a.clone()  # never the caller's tensor: a mask is immutable
        self.batch = a.shape[0] if a.shape[0] != 1 else None

    def check(self, B, H, nq, nk):
        super().check(B, H, nq, nk)
        if self.adj.shape[-1] != nk:
            raise ValueError(f"graph: adjacency has {self.adj.shape[-1]} nodes but keys have length {nk}")

    def tensors(self):
        return (self.adj,)

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        # A query row at a negative position (Nq > Nk) is no node of the graph: it sees nothing.
        a = self.adj.to(kv_idx.device)
        p = q_idx + (nk - nq)
        return a[row_index(a, b), p.clamp(min=0), kv_idx] & (p >= 0)

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        return coarse_block_map(self.adj.to(device), 1, 1, nq, nk, bq, bk, q_offset=nk - nq)

    def __repr__(self):
        return f"graph(nodes={self.adj.shape[-1]}, edges={int(self.adj.sum())})"


class FromFn(Mask):
    """A user predicate ``fn(b, h, q_pos, kv_pos) -> bool tensor`` on query and key *positions*.

    Query row ``i`` reaches the predicate at position ``i + Nk - Nq`` (bottom-right, as every built-in mask
    and ``causal()``), key ``j`` at position ``j``: the same predicate gives the same answer for a token whether
    it is decoded alone, in a chunk or in the full pass. ``align="top_left"`` passes the raw row index ``i``
    instead (as ``causal(align="top_left")``). With ``Nq == Nk`` both agree. Rows before the first position
    (``Nq > Nk``) reach the predicate with negative positions.

    The predicate may read ``b`` and ``h``, so views and block maps evaluate every batch row and head of the
    request they are given (``block_map(..., B=, H=)``), unless the user gives the block map itself
    (``block_map=``, see :func:`from_fn`).
    """

    depends_on_head = True
    depends_on_batch = True

    def __init__(self, fn: Callable, align: str = "bottom_right", block_map: Callable | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"from_fn: expected a callable fn(b, h, q_pos, kv_pos) -> bool, got {type(fn).__name__}")
        if align not in _ALIGNS:
            raise ValueError(f"from_fn: align must be one of {_ALIGNS}, got {align!r}")
        if block_map is not None and not callable(block_map):
            raise TypeError(f"from_fn: block_map must be a callable block_map(nq, nk, block_q, block_k, B, H, device) "
                            f"-> int8 tile classes, got {type(block_map).__name__}")
        self.fn = fn
        self.align = align
        self.tile_fn = block_map

    def predicate_pairs(self, B, H, nq, nk):
        if self.tile_fn is not None:
            return 0
        rows, heads = self.reads(B, H)
        return rows * heads * nq * nk

    def _block_map(self, nq, nk, bq, bk, device, B=1, H=1):
        if self.tile_fn is None:
            return super()._block_map(nq, nk, bq, bk, device, B, H)
        tq, tk = -(-nq // bq), -(-nk // bk)
        bm = self.tile_fn(nq, nk, bq, bk, B, H, device)
        if (not isinstance(bm, torch.Tensor) or bm.dtype != torch.int8 or bm.dim() not in (2, 3)
                or tuple(bm.shape[-2:]) != (tq, tk) or (bm.dim() == 3 and bm.shape[0] not in (1, B))):
            raise ValueError(f"from_fn: block_map returned {getattr(bm, 'dtype', type(bm).__name__)} "
                             f"{tuple(getattr(bm, 'shape', ()))}; expected int8 (TQ, TK) = ({tq}, {tk}) or (1 or B, "
                             "TQ, TK) holding qkv.masks.EMPTY / PARTIAL / FULL")
        if bool(((bm < EMPTY) | (bm > FULL)).any()):
            raise ValueError("from_fn: block_map returned values other than qkv.masks.EMPTY / PARTIAL / FULL")
        return bm.to(device)

    def allowed(self, b, h, q_idx, kv_idx, nq, nk):
        q_pos = q_idx + (nk - nq) if self.align == "bottom_right" and nk != nq else q_idx
        out = self.fn(b, h, q_pos, kv_idx)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            raise TypeError(f"from_fn: fn must return a bool tensor, got {getattr(out, 'dtype', type(out).__name__)}")
        return out

    def __repr__(self):
        align = "" if self.align == "bottom_right" else ", align='top_left'"
        return f"from_fn({getattr(self.fn, '__name__', 'fn')}{align})"


def dense(mask: torch.Tensor) -> Dense:
    """An explicit boolean mask broadcastable to (B, H, Nq, Nk); True = may attend."""
    return Dense(mask)


def graph(adjacency: torch.Tensor, *, self_loops: bool = True) -> Graph:
    """Attend along edges: ``adjacency`` (N, N) or (B, N, N) bool over token positions."""
    return Graph(adjacency, self_loops=self_loops)


def graph_from_edges(edge_index: torch.Tensor, num_nodes: int, *, self_loops: bool = True) -> Graph:
    """Attend along edges given as (2, E) (source=query, target=key) node indices."""
    if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
        shape = getattr(edge_index, "shape", "?")
        raise ValueError(f"graph_from_edges: edge_index must have shape (2, E), got {shape}")
    if edge_index.dtype.is_floating_point or edge_index.dtype == torch.bool:
        raise TypeError(f"graph_from_edges: edge_index must hold integer node ids, got dtype {edge_index.dtype}")
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes <= 0:
        raise ValueError(f"graph_from_edges: num_nodes must be a positive int, got {num_nodes!r}")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
        raise ValueError(f"graph_from_edges: edge_index holds node ids in [{int(edge_index.min())}, "
                         f"{int(edge_index.max())}] but nodes are 0 .. {num_nodes - 1}; negative ids are not "
                         "counted from the end")
    adj = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    adj[edge_index[0].cpu(), edge_index[1].cpu()] = True
    return Graph(adj, self_loops=self_loops)


def from_fn(fn: Callable, *, align: str = "bottom_right", block_map: Callable | None = None) -> FromFn:
    """A mask from a vectorized predicate ``fn(b, h, q_pos, kv_pos) -> bool tensor``.

    The predicate receives broadcastable int64 tensors: batch row, head, query *position* and key position.
    Query row ``i`` sits at position ``i + Nk - Nq`` (bottom-right, the KV-cache convention of every built-in
    mask), so a decode step or a chunk of a prefill sees exactly the rows of the full pass;
    ``align="top_left"`` passes the row index ``i`` instead. See :class:`FromFn`.

    Without structure to exploit, tiled backends learn which tiles to skip by evaluating ``fn`` on every pair
    once per mask object and shape (``qkv.explain`` counts that cost). ``block_map=`` is the extension point
    that avoids it: ``block_map(nq, nk, block_q, block_k, B, H, device)`` returns int8 tile classes, (TQ, TK)
    or (1 or B, TQ, TK), of ``qkv.masks.EMPTY`` (no pair allowed), ``PARTIAL`` or ``FULL`` (every pair allowed,
    for every head), computed from what the user knows about ``fn``. It must be sound: an EMPTY tile with an
    allowed pair or a FULL tile with a masked one gives wrong results;
    ``qkv.masks.predicate_block_map`` gives the exact map to test it against.

    Example:
        >>> import torch, qkv
        >>> window = qkv.masks.from_fn(lambda b, h, q, k: (k <= q) & (q - k < 3))
        >>> window.dense(1, 1, 1, 6)[0, 0, 0].tolist()   # one decode step: the query sits at position 5
        [False, False, False, True, True, True]
    """
    return FromFn(fn, align, block_map)
