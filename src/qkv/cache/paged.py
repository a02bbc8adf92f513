"""Paged KV storage: a pool of fixed-size blocks per layer, block tables per sequence, reference
counts, copy-on-write forks and prefix caching (PagedAttention / vLLM, Kwon et al. 2023,
arXiv:2309.06180; automatic prefix caching as in vLLM and SGLang's RadixAttention, Zheng et al. 2023,
arXiv:2312.07104).

Shape legend: B rows (sequences), H key/value heads, P blocks in the pool, T block size, Dk/Dv widths.

- Layers that keep the same tokens share one block table per row: all full-attention (and latent)
  layers form one group, each sliding window ``W`` another. Each layer owns its pools
  ``k (P + 1, H, T, Dk)``, ``v (P + 1, H, T, Dv)``; the group owns the positions ``(P + 1, T)``. Block
  ``P`` is the null block: it is never written and its positions are ``-1``.
- Padding tokens are not stored: each row holds exactly its real tokens, which is where paging saves
  memory against a batch padded to its longest row.
- A step's slots are allocated once, for every group, before anything is written: by
  ``cache.prepare(input_ids, positions)`` or by the first layer's write. When the pool cannot hold the
  step, :class:`CacheFull` is raised and nothing changes.
- ``reorder(idx)`` (beam search, ``fork`` for n samples) copies block tables, not blocks: a block
  referenced by several rows (or indexed by the prefix cache) is copied before it is written.
- Sliding-window groups release the blocks that fall out of the window (plus ``rollback`` tokens).
- Prefix caching: a full block is keyed by a SHA-256 hash chain over the token ids of its row's
  prefix, seeded with an optional ``salt`` (so tenants never share blocks). A block whose last
  reference goes away keeps its contents and hash; it is reused on a hit, or evicted least recently
  used first when the pool needs room.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .storage import Store

__all__ = ["Paged", "PagedStore", "BlockManager", "CacheFull", "PoolStats", "prefix_hashes"]


class CacheFull(RuntimeError):
    """The block pool cannot hold the requested tokens. Nothing was written."""


@dataclass(frozen=True)
class Paged:
    """Block-paged storage.

    Args:
        block_size: tokens per block (vLLM's default is 16).
        num_blocks: blocks in each layer's pool; exhausting them raises :class:`CacheFull`.
        prefix_caching: index full blocks by the hash of their token prefix and reuse them
            (``cache.match_prefix``).
    """

    block_size: int = 16
    num_blocks: int = 1024
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Paged({name}): expected a positive int, got {value!r}")

    def describe(self) -> str:
        return f"paged(block_size={self.block_size}, num_blocks={self.num_blocks})"

    def layer_blocks(self, lengths: list[int], keep: int | None) -> int:
        """Blocks a layer's rows reference after holding ``lengths`` tokens each (padding is never stored);
        ``keep``: the tokens a bounded layer keeps, whose blocks wholly before them are released when the
        next step is allocated."""
        T = self.block_size
        if keep is None:
            return sum(math.ceil(n / T) for n in lengths)
        return sum(math.ceil(n / T) - max(0, (n - 1 - keep) // T) for n in lengths)


class PoolStats(NamedTuple):
    """Occupancy of one group's pool."""

    num_blocks: int
    in_use: int  # referenced by at least one row
    cached: int  # unreferenced but holding a reusable prefix (evictable)
    free: int


def _salt_bytes(salt) -> bytes:
    if salt is None:
        return b""
    if isinstance(salt, bytes):
        return salt
    if isinstance(salt, str):
        return salt.encode()
    raise TypeError(f"salt: expected bytes, str or None, got {type(salt).__name__}")


def prefix_hashes(token_ids: list[int], block_size: int, *, salt=None) -> list[bytes]:
    """SHA-256 hash chain of the full blocks of ``token_ids``: block ``j``'s key covers tokens
    ``0 .. (j + 1) * block_size - 1`` and the salt, so equal keys mean equal prefixes.

    Example:
        >>> a = prefix_hashes(list(range(40)), 16)
        >>> len(a), a == prefix_hashes(list(range(32)) + [7] * 8, 16)
        (2, True)
    """
    return _extend_chain([], token_ids, block_size, _salt_bytes(salt))


def _extend_chain(chain: list[bytes], token_ids: list[int], block_size: int, salt: bytes) -> list[bytes]:
    """``chain`` extended to every full block of ``token_ids`` (its existing keys are kept)."""
    out = list(chain)
    parent = out[-1] if out else hashlib.sha256(b"qkv-prefix:" + salt).digest()
    for j in range(len(out), len(token_ids) // block_size):
        block = token_ids[j * block_size:(j + 1) * block_size]
        h = hashlib.sha256(parent)
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in block))
        parent = h.digest()
        out.append(parent)
    return out


class _Group:
    """Block pool and per-row tables of the layers that keep the same tokens."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None, keep: int | None) -> None:
        self.P, self.T, self.window, self.keep = num_blocks, block_size, window, keep
        self.null = num_blocks
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced, hashed: reusable, evictable
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.tables: list[list[int]] = []
        self.first: list[int] = []  # table entries before first[b] were released (out of window)
        self.pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pos: torch.Tensor | None = None  # (P + 1, T)

    # -- reference counting
    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.lru.pop(b, None)
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.lru[b] = None  # most recently used at the end
            else:
                self.free.append(b)

    def take(self) -> int:
        if self.free:
            b = self.free.popleft()
        else:
            b, _ = self.lru.popitem(last=False)  # evict the least recently used cached prefix
            del self.by_hash[self.hash_of.pop(b)]
        self.ref[b] = 1
        return b

    def shared(self, b: int) -> bool:
        """A block others can see: written only after a copy."""
        return self.ref[b] > 1 or b in self.hash_of

    def copy_block(self, src: int, dst: int) -> None:
        for kp, vp in self.pools:
            kp[dst] = kp[src]
            vp[dst] = vp[src]
        if self.pos is not None:
            self.pos[dst] = self.pos[src]

    def register(self, block: int, key: bytes) -> None:
        if key not in self.by_hash and block not in self.hash_of:
            self.by_hash[key] = block
            self.hash_of[block] = key

    def releasable(self, b: int, length: int) -> int:
        """Live blocks of row ``b`` that lie wholly before the last ``keep`` tokens."""
        if self.keep is None:
            return 0
        return max(0, (length - self.keep) // self.T - self.first[b])

    def stats(self) -> PoolStats:
        in_use = sum(1 for r in self.ref if r > 0)
        return PoolStats(self.P, in_use, len(self.lru), len(self.free))


class _Step(NamedTuple):
    n: int
    real: torch.Tensor  # (B, n) bool
    blocks: list[torch.Tensor]  # per group (n_real,) block of each real token
    offsets: torch.Tensor  # (n_real,) slot inside the block
    tables: list[torch.Tensor]  # per group (B, nb) live blocks, null-padded
    view_pos: list[torch.Tensor]  # per group (B, nb * T) positions, -1 past each row's length


class BlockManager:
    """Allocation state shared by every paged layer of one cache: groups, rows, steps, hashes."""

    def __init__(self, config: Paged, windows: list[int | None], *, rollback: int = 0) -> None:
        self.config, self.T = config, config.block_size
        self.group_of: dict[int | None, int] = {}
        self.groups: list[_Group] = []
        for w in windows:
            if w not in self.group_of:
                self.group_of[w] = len(self.groups)
                keep = None if w is None else w + rollback
                self.groups.append(_Group(config.num_blocks, config.block_size, w, keep))
        self.rows = 0
        self.lens: list[int] = []
        self.base: list[int] = []  # tokens a row started with (prefix hits)
        self.tokens: list[list[int] | None] = []
        self.salts: list[bytes] = []
        self.hashes: list[list[bytes]] = []
        self.history: list[torch.Tensor] = []  # per step (B, n) bool: which tokens were real
        self.seen = 0
        self.step: _Step | None = None
        self.stores: list[PagedStore] = []
        self.pending: list[tuple[_Group, int, bytes]] = []

    # rows
    def _init_rows(self, B: int, salt=None) -> None:
        salts = salt if isinstance(salt, (list, tuple)) else [salt] * B
        if len(salts) != B:
            raise ValueError(f"salt: got {len(salts)} salts for {B} rows; pass one salt or one per row")
        self.rows = B
        self.lens, self.base = [0] * B, [0] * B
        self.tokens = [[] for _ in range(B)]
        self.salts = [_salt_bytes(s) for s in salts]
        self.hashes = [[] for _ in range(B)]
        for g in self.groups:
            g.tables, g.first = [[] for _ in range(B)], [0] * B

    def reset(self) -> None:
        """Release every row's blocks; cached prefixes stay indexed for later requests."""
        self.commit()
        for g in self.groups:
            for b in range(self.rows):
                for blk in g.tables[b][g.first[b]:]:
                    if blk != g.null:
                        g.decref(blk)
            g.tables, g.first = [], []
        self.rows, self.seen, self.step = 0, 0, None
        self.lens, self.base, self.tokens, self.salts, self.hashes, self.history = [], [], [], [], [], []

    # prefix caching
    def match_prefix(self, input_ids: torch.Tensor, positions: torch.Tensor, *, salt=None) -> torch.Tensor:
        if not self.config.prefix_caching:
            raise ValueError("match_prefix: this cache was built with Paged(prefix_caching=False); build it with "
                             "Paged(..., prefix_caching=True)")
        self.commit()
        if self.seen or any(self.lens):
            raise ValueError("match_prefix: the cache already holds tokens; call it on a fresh cache "
                             "(cache.reset() releases rows and keeps cached prefixes)")
        B = input_ids.shape[0]
        self._init_rows(B, salt)
        hits = []
        for b in range(B):
            ids = input_ids[b][positions[b] >= 0].tolist()
            chain = prefix_hashes(ids, self.T, salt=self.salts[b])
            j = len(chain)
            while j > 0 and not all(self._group_has(g, chain, j) for g in self.groups):
                j -= 1
            h = min(j * self.T, max(len(ids) - 1, 0))  # the last token is recomputed for its logits
            if h == 0:
                hits.append(0)
                continue
            nblk = -(-h // self.T)
            for g in self.groups:
                start = 0 if g.keep is None else max(0, h - (g.window - 1)) // self.T
                table = [g.null] * start + [g.by_hash[chain[i]] for i in range(start, nblk)]
                for blk in table[start:]:
                    g.incref(blk)
                    if blk in g.lru:
                        g.lru.move_to_end(blk)
                g.tables[b], g.first[b] = table, start
            self.lens[b] = self.base[b] = h
            self.tokens[b] = ids[:h]
            self.hashes[b] = chain[:h // self.T]
            hits.append(h)
        return torch.tensor(hits, dtype=torch.int64)

    def _group_has(self, g: _Group, chain: list[bytes], j: int) -> bool:
        h = j * self.T
        start = 0 if g.keep is None else max(0, h - (g.window - 1)) // self.T
        return all(chain[i] in g.by_hash for i in range(start, j))

    # steps
    def step_for(self, store_seen: int, positions: torch.Tensor) -> _Step:
        """The slot map of the step a layer is writing, allocating it on the step's first write."""
        n = positions.shape[1]
        if store_seen == self.seen:
            self.allocate(positions, None)
        elif self.step is None or store_seen + n != self.seen or self.step.n != n:
            raise ValueError(f"paged cache: a layer wrote {n} tokens after {store_seen} while the step in progress "
                             f"covers {self.seen}; every layer must write each step once, with the same positions")
        return self.step

    def commit(self) -> None:
        """Index the blocks filled by the last step, once every layer has written it (a step that
        failed half-way never enters the prefix index)."""
        if self.pending and all(s.seen == self.seen for s in self.stores):
            for g, block, key in self.pending:
                g.register(block, key)
        self.pending = []

    def allocate(self, positions: torch.Tensor, input_ids: torch.Tensor | None) -> _Step:
        self.commit()
        B, n = positions.shape
        if self.rows == 0 and self.seen == 0:
            self._init_rows(B)
        if B != self.rows:
            raise ValueError(f"paged cache: got {B} rows but the cache holds {self.rows}; use cache.reorder(idx) "
                             f"to change the batch")
        real = positions >= 0
        counts = real.sum(1).tolist()
        # Plan every group first; nothing changes unless every group has room.
        plans = []
        for g in self.groups:
            release = [g.releasable(b, self.lens[b]) for b in range(B)]
            need = 0
            for b in range(B):
                length, c = self.lens[b], counts[b]
                if c == 0:
                    continue
                need += -(-(length + c) // self.T) - len(g.tables[b])
                if length % self.T and g.shared(g.tables[b][-1]):
                    need += 1  # copy-on-write of the partial last block
            freed = sum(1 for b in range(B) for blk in g.tables[b][g.first[b]:g.first[b] + release[b]]
                        if g.ref[blk] == 1)
            if need > g.available() + freed:
                what = "full-attention layers" if g.window is None else f"window-{g.window} layers"
                raise CacheFull(f"paged cache: the {what} need {need} more blocks of {self.T} tokens but only "
                                f"{g.available() + freed} of {g.P} are free; nothing was written. Build the cache "
                                f"with Paged(num_blocks > {g.P}), shorten the request, or reset() finished rows")
            plans.append(release)
        ids = None if input_ids is None else input_ids.tolist()
        pos_list = positions.tolist()
        offsets: list[int] = []
        blocks: list[list[int]] = [[] for _ in self.groups]
        for gi, g in enumerate(self.groups):
            for b in range(B):
                for _ in range(plans[gi][b]):
                    blk = g.tables[b][g.first[b]]
                    g.tables[b][g.first[b]] = g.null
                    g.first[b] += 1
                    g.decref(blk)
            for b in range(B):
                length, c = self.lens[b], counts[b]
                if c == 0:
                    continue
                if length % self.T and g.shared(g.tables[b][-1]):
                    old = g.tables[b][-1]
                    new = g.take()
                    g.copy_block(old, new)
                    g.tables[b][-1] = new
                    g.decref(old)
                while len(g.tables[b]) * self.T < length + c:
                    g.tables[b].append(g.take())
                for t in range(length, length + c):
                    blocks[gi].append(g.tables[b][t // self.T])
                    if gi == 0:
                        offsets.append(t % self.T)
        device = positions.device
        for gi, g in enumerate(self.groups):
            if g.pos is None:
                g.pos = torch.full((g.P + 1, self.T), -1, dtype=torch.int64, device=device)
            if blocks[gi]:
                g.pos[torch.tensor(blocks[gi], device=device), torch.tensor(offsets, device=device)] = positions[real]
        # Token bookkeeping and the prefix index.
        for b in range(B):
            row_real = [t for t, p in enumerate(pos_list[b]) if p >= 0]
            if self.tokens[b] is not None:
                if ids is None or (self.lens[b] == 0 and row_real and pos_list[b][row_real[0]] != 0):
                    self.tokens[b] = None  # unknown ids (or not starting at 0): never indexed
                else:
                    self.tokens[b].extend(ids[b][t] for t in row_real)
            self.lens[b] += counts[b]
            if self.config.prefix_caching and self.tokens[b] is not None:
                full = self.lens[b] // self.T
                if full > len(self.hashes[b]):
                    done = len(self.hashes[b])
                    self.hashes[b] = _extend_chain(self.hashes[b], self.tokens[b], self.T, self.salts[b])
                    for g in self.groups:
                        for j in range(max(done, g.first[b]), full):
                            self.pending.append((g, g.tables[b][j], self.hashes[b][j]))
        self.history.append(real)
        self.seen += n
        tables, view_pos = self._views(device)
        self.step = _Step(n, real, [torch.tensor(bl, dtype=torch.int64, device=device) for bl in blocks],
                          torch.tensor(offsets, dtype=torch.int64, device=device), tables, view_pos)
        return self.step

    def _views(self, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        tables, view_pos = [], []
        lens = torch.tensor(self.lens, dtype=torch.int64, device=device)
        for g in self.groups:
            live = [g.tables[b][g.first[b]:] for b in range(self.rows)]
            nb = max((len(t) for t in live), default=0)
            tab = torch.tensor([t + [g.null] * (nb - len(t)) for t in live], dtype=torch.int64,
                               device=device).view(self.rows, nb)
            pos = g.pos[tab].view(self.rows, nb * self.T)
            first = torch.tensor(g.first, dtype=torch.int64, device=device).view(-1, 1) * self.T
            slot = first + torch.arange(nb * self.T, device=device).view(1, -1)
            tables.append(tab)
            view_pos.append(torch.where(slot < lens.view(-1, 1), pos, torch.full_like(pos, -1)))
        return tables, view_pos

    # crop and reorder
    def _lens_after_drop(self, n: int) -> list[int]:
        kept = self.history[:len(self.history)]
        total, out = 0, list(self.base)
        steps = []
        for r in kept:
            if total + r.shape[1] <= self.seen - n:
                steps.append(r)
            else:
                steps.append(r[:, :max(self.seen - n - total, 0)])
            total += r.shape[1]
        if steps:
            counts = torch.cat(steps, dim=1).sum(1).tolist()
            out = [a + c for a, c in zip(self.base, counts, strict=True)]
        return out

    def cannot_drop(self, n: int) -> str | None:
        if n > self.seen:
            return f"paged cache holds {self.seen} written slots, cannot drop {n}"
        new = self._lens_after_drop(n)
        for g in self.groups:
            if g.keep is None:
                continue
            for b in range(self.rows):
                need_from = max(0, new[b] - (g.window - 1))
                if g.first[b] * self.T > need_from:
                    return (f"paged window-{g.window} layers released row {b}'s tokens before "
                            f"{g.first[b] * self.T}; dropping {n} needs them. Build the cache with rollback >= {n}")
        return None

    def drop_last(self, n: int) -> None:
        if n <= 0:
            return
        self.commit()
        new = self._lens_after_drop(n)
        for g in self.groups:
            for b in range(self.rows):
                keep_blocks = -(-new[b] // self.T)
                for blk in g.tables[b][keep_blocks:]:
                    if blk != g.null:
                        g.decref(blk)
                del g.tables[b][keep_blocks:]
        for b in range(self.rows):
            self.lens[b] = new[b]
            if self.tokens[b] is not None:
                del self.tokens[b][new[b]:]
            del self.hashes[b][new[b] // self.T:]
        target, total, hist = self.seen - n, 0, []
        for r in self.history:
            if total + r.shape[1] <= target:
                hist.append(r)
            elif total < target:
                hist.append(r[:, :target - total])
            total += r.shape[1]
        self.history, self.seen, self.step = hist, target, None

    def reorder(self, idx: list[int]) -> None:
        self.commit()
        for g in self.groups:
            tables = [list(g.tables[i]) for i in idx]
            firsts = [g.first[i] for i in idx]
            for b, t in enumerate(tables):
                for blk in t[firsts[b]:]:
                    if blk != g.null:
                        g.incref(blk)
            for b in range(self.rows):
                for blk in g.tables[b][g.first[b]:]:
                    if blk != g.null:
                        g.decref(blk)
            g.tables, g.first = tables, firsts
        self.lens = [self.lens[i] for i in idx]
        self.base = [self.base[i] for i in idx]
        self.tokens = [None if self.tokens[i] is None else list(self.tokens[i]) for i in idx]
        self.salts = [self.salts[i] for i in idx]
        self.hashes = [list(self.hashes[i]) for i in idx]
        t = torch.tensor(idx, dtype=torch.int64)
        self.history = [r.index_select(0, t.to(r.device)) for r in self.history]
        self.rows, self.step = len(idx), None

    def stats(self) -> dict[int | None, PoolStats]:
        return {w: self.groups[i].stats() for w, i in self.group_of.items()}


class PagedStore(Store):
    """One layer's pools; slots come from the shared :class:`BlockManager`."""

    def __init__(self, manager: BlockManager, window: int | None, *, layer: str = "layer") -> None:
        self.manager, self.layer = manager, layer
        self.gi = manager.group_of[window]
        self.group = manager.groups[self.gi]
        self.kp: torch.Tensor | None = None
        self.vp: torch.Tensor | None = None
        self.seen = 0
        manager.stores.append(self)

    @property
    def batch(self) -> int | None:
        return self.manager.rows or None

    def write(self, k, v, pos):
        step = self.manager.step_for(self.seen, pos)
        g, T = self.group, self.manager.T
        B, H, n, Dk = k.shape
        if self.kp is None:
            self.kp = k.new_zeros(g.P + 1, H, T, Dk)
            self.vp = v.new_zeros(g.P + 1, H, T, v.shape[-1])
            g.pools.append((self.kp, self.vp))
        if step.offsets.numel():
            self.kp[step.blocks[self.gi], :, step.offsets] = k.transpose(1, 2)[step.real]  # (n_real, H, Dk)
            self.vp[step.blocks[self.gi], :, step.offsets] = v.transpose(1, 2)[step.real]
        self.seen += n
        tab = step.tables[self.gi]  # (B, nb)
        nb = tab.shape[1]
        k_all = self.kp[tab].permute(0, 2, 1, 3, 4).reshape(B, H, nb * T, Dk)
        v_all = self.vp[tab].permute(0, 2, 1, 3, 4).reshape(B, H, nb * T, self.vp.shape[-1])
        return k_all, v_all, step.view_pos[self.gi]

    def decode(self, q: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
               window: int | None = None) -> torch.Tensor | None:
        """Attention of the step just written (one query per row) straight over this layer's blocks,
        without gathering them: the Triton paged-decode kernel, when ``gpu_decode_ready`` holds for the
        query and the pools (CUDA, no gradients, triton installed); None otherwise, and the caller
        attends over the view :meth:`write` returned.

        Args:
            q: (B, Hq, 1, D) rotated queries; q_positions (B, 1) int64.
            window: as in ``masks.positions(..., window=W)``.

        Returns:
            (B, Hq, 1, Dv) in q's dtype, or None.
        """
        from ..backends.triton import gpu_decode_ready

        step = self.manager.step
        if step is None or q.dim() != 4 or q.shape[2] != 1 or not gpu_decode_ready(q, self.kp, self.vp):
            return None
        from ..backends.triton.decode import paged_decode

        out, _ = paged_decode(q[:, :, 0], self.kp, self.vp, step.tables[self.gi], step.view_pos[self.gi],
                              q_positions[:, 0], scale=scale, window=window)
        return out.unsqueeze(2)

    def cannot_drop(self, n):
        return None  # the manager checks for the whole cache

    def drop_last(self, n):
        self.seen -= n

    def reorder(self, idx):
        pass  # tables live in the manager

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.kp, self.vp) if t is not None)

    def used_bytes(self):
        if self.kp is None:
            return 0
        per_token = (self.kp[0, :, 0].numel() * self.kp.element_size()
                     + self.vp[0, :, 0].numel() * self.vp.element_size())
        keep = self.group.window  # tokens a sliding layer still needs; the rest of its blocks is waste
        return per_token * sum(n if keep is None else min(n, keep) for n in self.manager.lens)

    def block_bytes(self) -> int:
        """Bytes of one block in this layer (keys and values)."""
        if self.kp is None:
            return 0
        return (self.kp[0].numel() * self.kp.element_size() + self.vp[0].numel() * self.vp.element_size())

    def held(self):
        return max(self.manager.lens, default=0)
