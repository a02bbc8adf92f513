"""Sharding layouts: which global sequence positions each rank holds, and ``shard`` / ``unshard``.

A layout maps rank ``r`` to an ascending list of global token indices. Every rank holds the same number.

::

    N = 8, W = 2        rank 0            rank 1
    contiguous          0 1 2 3           4 5 6 7         ring, ulysses, usp
    zigzag (2W chunks)  0 1 6 7           2 3 4 5         zigzag, allgather
    stripe (t mod W)    0 2 4 6           1 3 5 7         stripe

Zigzag (Brandon et al. 2023 and Llama 3's all-gather context parallelism) splits the sequence into 2W chunks
and gives rank ``r`` chunks ``r`` and ``2W-1-r``, so causal work is even. Given document ids, the zigzag is
taken per document (each document split into 2W pieces, lengths that do not divide spread round-robin over
the ranks), which keeps the work of a packed batch with a document-causal mask even. Where per-document pieces
cannot balance (many documents shorter than 2W tokens: their leftovers decide), the plain zigzag is used instead
whenever it is more even (:func:`document_spread` measures both), so the layout given documents is never less
balanced than the plain zigzag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .groups import UspGroups

__all__ = ["Layout", "SCHEMES", "MAX_SEGMENTS", "layout", "segments", "shard", "unshard", "world_and_rank",
           "document_spread"]

#: Every scheme, and the layout it shards with.
SCHEMES: dict[str, str] = {"ring": "contiguous", "zigzag": "zigzag", "stripe": "stripe", "allgather": "zigzag",
                           "ulysses": "contiguous", "usp": "contiguous"}

#: A rank whose positions form more contiguous runs than this is computed as one block per chunk pair.
MAX_SEGMENTS = 8


@dataclass(frozen=True, eq=False)
class Layout:
    """Global token indices per rank. ``index[r]``: (n,) int64 ascending; ``n_global = world * n``."""

    kind: str
    n_global: int
    index: tuple[torch.Tensor, ...]
    pieces: tuple[tuple[int, ...], ...] | None = None  # zigzag: lengths of each rank's chunks, in order

    @property
    def world(self) -> int:
        return len(self.index)

    @property
    def n_local(self) -> int:
        return self.index[0].numel()

    def segments(self, rank: int) -> list[slice]:
        """Local slices over which rank ``rank``'s global indices are consecutive (a stripe is one block: its
        tokens interleave with every other rank's, so no sub-block is ever empty under a causal mask)."""
        if self.kind == "stripe":
            return [slice(0, self.n_local)]
        if self.pieces is not None and len(self.pieces[rank]) <= MAX_SEGMENTS:
            # zigzag chunks stay apart even where they touch (rank W-1 holds chunks W-1 and W): each is its own
            # block, so the causal skip sees the same shapes on every rank
            bounds = [0]
            for size in self.pieces[rank]:
                bounds.append(bounds[-1] + size)
            return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        return segments(self.index[rank])



def segments(index: torch.Tensor) -> list[slice]:
    """Slices of ``index`` (ascending global indices) that are runs of consecutive values; one slice over
    everything when there would be more than ``MAX_SEGMENTS`` (a stripe: blocks are whole chunks)."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1).tolist()
    if len(breaks) + 1 > MAX_SEGMENTS:
        return [slice(0, index.numel())]
    bounds = [0, *breaks, index.numel()]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def world_and_rank(group) -> tuple[int, int]:
    """World size and this process's rank in ``group`` (a process group, ``UspGroups`` or None = world)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("qkv.distributed: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first (backend 'gloo' on CPU, 'nccl' on GPUs) "
                           "or launch with torchrun")
    if isinstance(group, UspGroups):
        return group.world, group.rank
    return dist.get_world_size(group), dist.get_rank(group)


def _document_runs(documents: torch.Tensor, n: int) -> list[int]:
    if not isinstance(documents, torch.Tensor) or documents.dtype.is_floating_point or documents.dtype == torch.bool:
        raise TypeError(f"documents: expected integer document ids of shape (N,) or (B, N), got "
                        f"{type(documents).__name__} {getattr(documents, 'dtype', '')}")
    ids = documents if documents.dim() == 1 else documents[0]
    if documents.dim() == 2 and not bool((documents == documents[:1]).all()):
        raise ValueError("documents: the layout is one for the whole batch, so every batch row must pack the same "
                         "document boundaries; shard rows with different packings in separate calls")
    if documents.dim() not in (1, 2) or ids.numel() != n:
        raise ValueError(f"documents: expected shape (N,) or (B, N) with N = {n}, got {tuple(documents.shape)}")
    ids = ids.cpu()
    change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), n]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _zigzag(n: int, world: int, documents: torch.Tensor | None) -> tuple[list[list[int]], list[list[int]]]:
    """Global indices per rank (ascending) and the lengths of the pieces they come in."""
    runs = [n] if documents is None else _document_runs(documents, n)
    owned: list[list[int]] = [[] for _ in range(world)]
    sizes: list[list[int]] = [[] for _ in range(world)]
    pointer, start = 0, 0
    for length in runs:
        pieces = [length // (2 * world)] * (2 * world)
        extra_front = [False] * world
        for _ in range(length % (2 * world)):  # leftover tokens go round-robin, carried across documents
            r = pointer % world
            pointer += 1
            pieces[r if not extra_front[r] else 2 * world - 1 - r] += 1
            extra_front[r] = True
        at = start
        for i, size in enumerate(pieces):
            owner = i if i < world else 2 * world - 1 - i
            owned[owner].extend(range(at, at + size))
            if size:
                sizes[owner].append(size)
            at += size
        start += length
    return owned, sizes


def _spread(owned: list[list[int]], runs: list[int]) -> float:
    first = torch.repeat_interleave(torch.tensor([0, *_cumsum(runs)[:-1]]), torch.tensor(runs))
    seen = torch.arange(first.numel()) - first + 1  # keys a token sees: its document's prefix
    work = [int(seen[torch.tensor(rank, dtype=torch.int64)].sum()) for rank in owned]
    mean = sum(work) / len(work)
    return max(abs(w - mean) for w in work) / mean if mean else 0.0


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def document_spread(lay: Layout, documents: torch.Tensor) -> float:
    """How uneven a layout leaves the work of a document-causal mask: ``max |w_r - mean| / mean`` over the
    ranks' allowed (query, key) pairs ``w_r`` (a token sees its document's prefix); 0 is perfectly even.

    Args:
        lay: a :class:`Layout` of ``lay.n_global`` tokens.
        documents: (N,) or (B, N) integer document ids, as for :func:`layout`.

    Example:
        >>> ids = torch.repeat_interleave(torch.arange(9), torch.tensor([7] * 8 + [8]))
        >>> per_doc = document_spread(layout("zigzag", 64, 8, documents=ids), ids)
        >>> per_doc <= document_spread(layout("zigzag", 64, 8), ids)
        True
    """
    runs = _document_runs(documents, lay.n_global)
    return _spread([i.tolist() for i in lay.index], runs)


def layout(scheme: str, n_global: int, world: int, *, documents: torch.Tensor | None = None) -> Layout:
    """The layout ``scheme`` shards a sequence of ``n_global`` tokens with over ``world`` ranks.

    Args:
        scheme: one of :data:`SCHEMES`.
        n_global: global sequence length; must divide evenly (2W chunks for zigzag without documents).
        world: number of ranks.
        documents: (N,) or (B, N) integer document ids (packed sequences): zigzag-type layouts balance per
            document. Only for the schemes that shard by zigzag (``zigzag``, ``allgather``).

    Example:
        >>> [i.tolist() for i in layout("zigzag", 8, 2).index]
        [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    if scheme not in SCHEMES:
        raise ValueError(f"qkv.distributed: unknown scheme {scheme!r}; choose one of {sorted(SCHEMES)}")
    kind = SCHEMES[scheme]
    if documents is not None and kind != "zigzag":
        raise ValueError(f"qkv.distributed: documents= balances the zigzag layout, but scheme {scheme!r} shards "
                         f"{kind}; pass the document mask as mask=qkv.masks.document(ids) (it holds by global "
                         "position under every scheme) or use scheme='zigzag'")
    if n_global % world:
        raise ValueError(f"qkv.distributed: sequence length {n_global} does not divide over {world} ranks; "
                         f"pad it to a multiple of {world}")
    n = n_global // world
    if kind == "contiguous":
        index = [torch.arange(r * n, (r + 1) * n) for r in range(world)]
    elif kind == "stripe":
        index = [torch.arange(r, n_global, world) for r in range(world)]
    else:
        if documents is None and n_global % (2 * world):
            raise ValueError(f"qkv.distributed: zigzag splits the sequence into 2W = {2 * world} chunks; length "
                             f"{n_global} does not divide, pad it to a multiple of {2 * world}")
        owned, sizes = _zigzag(n_global, world, documents)
        if documents is not None and n_global % (2 * world) == 0:
            plain = _zigzag(n_global, world, None)
            runs = _document_runs(documents, n_global)
            if _spread(plain[0], runs) < _spread(owned, runs):
                owned, sizes = plain
        index = [torch.tensor(o, dtype=torch.int64) for o in owned]
        return Layout(kind, n_global, tuple(index), tuple(tuple(s) for s in sizes))
    return Layout(kind, n_global, tuple(index))


def _check_dim(x: torch.Tensor, dim: int, fn: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{fn}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x: torch.Tensor, *, scheme: str, group=None, dim: int = 2,
          documents: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part of the global tensor ``x`` along ``dim`` (the sequence), in ``scheme``'s layout.

    Works for activations (``dim=2`` of (B, H, N, D)), token ids and position ids (``dim=1`` or ``0``).

    Example:
        >>> # on rank r of W:  q_local = shard(q, scheme="zigzag")            (B, H, N / W, D)
        >>> #                  pos_local = shard(torch.arange(N), scheme="zigzag", dim=0)
    """
    dim = _check_dim(x, dim, "shard")
    world, rank = world_and_rank(group)
    lay = layout(scheme, x.shape[dim], world, documents=documents)
    if lay.kind == "contiguous":
        return x.narrow(dim, rank * lay.n_local, lay.n_local)
    return x.index_select(dim, lay.index[rank].to(x.device))


def unshard(x_local: torch.Tensor, *, scheme: str, group=None, dim: int = 2, documents: torch.Tensor | None = None,
            timeout: float | None = None) -> torch.Tensor:
    """Reassemble the global tensor from every rank's ``x_local`` (a collective: every rank calls it).

    Not differentiable (it is for results and checks); the inverse of :func:`shard`.
    """
    from .exchange import Exchange

    dim = _check_dim(x_local, dim, "unshard")
    world, rank = world_and_rank(group)
    pg = group.parent if isinstance(group, UspGroups) else group
    lay = layout(scheme, x_local.shape[dim] * world, world, documents=documents)
    parts = Exchange(pg, scheme, timeout).all_gather(x_local.detach().contiguous(), "unshard")
    cat = torch.cat(parts, dim)
    if lay.kind == "contiguous":
        return cat
    order = torch.cat(lay.index).to(x_local.device)
    out = torch.empty_like(cat)
    out.index_copy_(dim, order, cat)
    return out
