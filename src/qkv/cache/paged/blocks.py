"""The block manager of paged storage: a pool of fixed-size blocks per group of layers, block tables per row,
reference counts, copy-on-write forks and the prefix index (PagedAttention / vLLM, Kwon et al. 2023,
arXiv:2309.06180; automatic prefix caching as in vLLM and SGLang's RadixAttention, Zheng et al. 2023,
arXiv:2312.07104). The stores (:mod:`qkv.cache.paged.store`) own the pools' tensors; this file owns which block
holds which token.

Shape legend: B rows (sequences), P blocks in the pool, T block size.

- Layers that keep the same tokens share one block table per row: all full-attention (and latent) layers form
  one group, each sliding window ``W`` another. The group owns the positions ``(P + 1, T)``; block ``P`` is the
  null block: it is never written and its positions are ``-1``.
- Padding tokens are not stored: each row holds exactly its real tokens, which is where paging saves memory
  against a batch padded to its longest row.
- A step's slots are allocated once, for every group, before anything is written: by ``cache.prepare(input_ids,
  positions)`` or by the first layer's write. When the pool cannot hold the step, :class:`CacheFull` is raised
  and nothing changes. :meth:`BlockManager.can_admit` answers beforehand whether a request of a given length
  would fit next to the rows already admitted (a scheduler's admission test, as vLLM's asks its KV-cache
  manager).
- ``reorder(idx)`` (beam search, ``fork`` for n samples) copies block tables, not blocks: a block referenced by
  several rows (or indexed by the prefix cache) is copied before it is written.
- Sliding-window groups release the blocks that fall out of the window (plus ``rollback`` tokens).
- Prefix caching: a full block is keyed by its prefix's hash chain (:mod:`qkv.cache.paged.prefix`). A block whose
  last reference goes away keeps its contents and hash; it is reused on a hit, or evicted least recently used
  first when the pool needs room.
- Sharing within one batch: ``match_prefix`` also lets a row reuse the full blocks of its prompt that a longer row
  of the same batch (ties: the earlier row) is about to write. The writer's blocks are reserved at once and both
  tables point at them; the writer fills them during the prefill, and the reader's queries see them in the very
  step they are written (each layer writes every row before any row attends). Because the writer is at least as
  long, its tokens come no later than the reader's first token when the rows are right-aligned (left padding), in
  one pass or in chunks. A step in which a reader would attend to blocks that are still unwritten is refused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import NamedTuple

import torch

from ...pos.ids import batch_positions
from .config import CacheFull, Paged, PoolStats
from .prefix import extend_chain, prefix_hashes, salt_bytes

__all__ = ["BlockManager", "BlockGroup", "StepSlots"]


_FOLD_STEPS = 256  # history entries joined into one once that many steps accumulate


class BlockGroup:
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

    def blocks_in_use(self) -> int:
        return sum(1 for r in self.ref if r > 0)


class StepSlots(NamedTuple):
    """Where one step's tokens go: the block and slot of each real token, and each row's block table and the
    positions of its paged view, per group of layers."""

    n: int
    real: torch.Tensor  # (B, n) bool
    blocks: list[torch.Tensor]  # per group (n_real,) block of each real token
    offsets: torch.Tensor  # (n_real,) slot inside the block
    tables: list[torch.Tensor]  # per group (B, nb) live blocks, null-padded
    view_pos: list[torch.Tensor]  # per group (B, nb * T) positions, -1 past each row's length
    src: torch.Tensor | None  # (n_real,) each real token's flat index b * n + t in the step's (B, n); CPU only

class BlockManager:
    """Allocation state shared by every paged layer of one cache: groups, rows, steps, hashes."""

    def __init__(self, config: Paged, windows: list[int | None], *, rollback: int = 0) -> None:
        self.config, self.T = config, config.block_size
        self.group_of: dict[int | None, int] = {}
        self.groups: list[BlockGroup] = []
        for w in windows:
            if w not in self.group_of:
                self.group_of[w] = len(self.groups)
                keep = None if w is None else w + rollback
                self.groups.append(BlockGroup(config.num_blocks, config.block_size, w, keep))
        self.rows = 0
        self.lens: list[int] = []
        self.base: list[int] = []  # tokens a row started with (prefix hits)
        self.tokens: list[list[int] | None] = []
        self.salts: list[bytes] = []
        self.hashes: list[list[bytes]] = []
        self.promised: list[int] = []  # length by which a row has written the blocks other rows reuse (0: done)
        self.promised_ids: list[list[int]] = []  # the prompt tokens those blocks hold
        self.waits: dict[int, dict[int, int]] = {}  # reader row -> {writer row: tokens it must have written}
        self.history: list[torch.Tensor] = []  # per step (B, n) bool: which tokens were real
        self.folded = 0  # leading history entries that each join _FOLD_STEPS steps' columns
        self.seen = 0
        self.step: StepSlots | None = None
        self.stores: list = []
        self.pending: list[tuple[BlockGroup, int, bytes]] = []
        self.lookup_tokens = self.hit_tokens = self.hit_tokens_in_batch = 0
        self.selected: list[int] | None = None  # rows the steps feed (KVCache.step_rows); None: all
        self.reserved = [0] * len(self.groups)  # blocks per group promised to admitted rows (can_admit)
        self.row_reserved: dict[int, list[int]] = {}  # row -> its share of ``reserved``

    # rows
    def _init_rows(self, B: int, salt=None) -> None:
        salts = salt if isinstance(salt, (list, tuple)) else [salt] * B
        if len(salts) != B:
            raise ValueError(f"salt: got {len(salts)} salts for {B} rows; pass one salt or one per row")
        self.rows = B
        self.lens, self.base, self.promised = [0] * B, [0] * B, [0] * B
        self.promised_ids = [[] for _ in range(B)]
        self.tokens = [[] for _ in range(B)]
        self.salts = [salt_bytes(s) for s in salts]
        self.hashes = [[] for _ in range(B)]
        self.waits = {}
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
        self.folded = 0
        self.promised, self.promised_ids, self.waits = [], [], {}
        self.selected = None
        self._forget_reservations()

    def sharing_in_progress(self) -> str | None:
        """Why rows cannot be reordered or cropped yet: a row still has to write blocks another row of its
        batch reuses (None when every such block is written)."""
        busy = [b for b, t in enumerate(self.promised) if t]
        if not busy:
            return None
        return (f"row(s) {busy} have not yet written every prompt block that other rows of this batch reuse; "
                f"finish the prefill first")

    # row slots (continuous batching)
    def open_rows(self, n: int) -> None:
        """Give a fresh manager ``n`` empty rows."""
        self.commit()
        self._init_rows(n)
        self._forget_reservations()

    def refusal(self, what: str) -> str | None:
        """Paged storage does every row operation: None (:class:`qkv.cache.rows.RowManager`)."""
        return None

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Allocate the step of ``input_ids`` (B, N) at ``positions`` before the forward pass (:meth:`allocate`)."""
        pos = batch_positions(positions, input_ids.shape[0], input_ids.shape[1], owner="prepare")
        self.allocate(pos, input_ids)

    # admission (a scheduler asks before it gives a request a row)
    def blocks_needed(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> list[int]:
        """The most blocks a request holds at once, per group of layers: its prompt and every new token fed back
        (the last one never is), or for a window-``W`` group what a row of ``W`` tokens and one step of at most
        ``chunk`` tokens (default: the whole prompt) spans; one more when a prefix hit may end inside a block,
        which is copied before it is written."""
        T, stored = self.T, prompt_tokens + max_new_tokens - 1
        per_step = max(1, prompt_tokens if chunk is None else min(chunk, prompt_tokens))
        copy = 1 if self.config.prefix_caching and prompt_tokens % T == 0 else 0
        need = []
        for g in self.groups:
            blocks = -(-stored // T)
            if g.window is not None:
                blocks = min(blocks, (g.window + per_step + 2 * T - 2) // T)
            need.append(blocks + copy)
        return need

    def can_admit(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> bool:
        """Whether a request of ``prompt_tokens`` and up to ``max_new_tokens`` fits next to the rows admitted with
        a reservation: in every group, the blocks reserved plus :meth:`blocks_needed` are at most the pool."""
        need = self.blocks_needed(prompt_tokens, max_new_tokens, chunk=chunk)
        return all(have + n <= g.P for have, n, g in zip(self.reserved, need, self.groups, strict=True))

    def never_fits(self, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> str | None:
        """Why no pool of this size could hold such a request even alone, or None."""
        need = self.blocks_needed(prompt_tokens, max_new_tokens, chunk=chunk)
        for g, n in zip(self.groups, need, strict=True):
            if n > g.P:
                what = "full-attention layers" if g.window is None else f"window-{g.window} layers"
                return (f"the request needs up to {n} blocks of {self.T} tokens in the {what} (prompt {prompt_tokens} "
                        f"+ max_new_tokens {max_new_tokens}) but the pool has {g.P}")
        return None

    def reserve(self, b: int, prompt_tokens: int, max_new_tokens: int, *, chunk: int | None = None) -> None:
        """Promise row ``b`` the blocks of such a request until it is released; :class:`CacheFull` (changing
        nothing) when :meth:`can_admit` says no. A row promised blocks before gives its earlier promise back
        first (so promising a row again, as the Engine does when a waiting row attaches, is not counted twice)."""
        earlier = self.row_reserved.get(b)
        self._unreserve(b)
        if not self.can_admit(prompt_tokens, max_new_tokens, chunk=chunk):
            if earlier is not None:
                self.row_reserved[b] = earlier
                self.reserved = [have + n for have, n in zip(self.reserved, earlier, strict=True)]
            raise CacheFull(f"admit_row({b}): the request (prompt {prompt_tokens} + max_new_tokens {max_new_tokens}) "
                            f"needs {self.blocks_needed(prompt_tokens, max_new_tokens, chunk=chunk)} blocks per group "
                            f"but {[g.P - r for g, r in zip(self.groups, self.reserved, strict=True)]} are not "
                            f"reserved by other rows; release a row first. Nothing was changed")
        need = self.blocks_needed(prompt_tokens, max_new_tokens, chunk=chunk)
        self.row_reserved[b] = need
        self.reserved = [have + n for have, n in zip(self.reserved, need, strict=True)]

    def _unreserve(self, b: int) -> None:
        need = self.row_reserved.pop(b, None)
        if need is not None:
            self.reserved = [have - n for have, n in zip(self.reserved, need, strict=True)]

    def _forget_reservations(self) -> None:
        self.reserved = [0] * len(self.groups)
        self.row_reserved = {}

    def step_in_progress(self) -> bool:
        """True while some paged layer has not yet written the step allocated last."""
        return any(s.seen != self.seen for s in self.stores)

    def select(self, rows: list[int] | None) -> None:
        """Steps feed only ``rows`` (increasing row indices) until the next call; None: every row."""
        self.selected = rows
        self.step = None

    def widen(self, positions: torch.Tensor, input_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step over the selected rows as one over every row: the others get padding (position -1)."""
        if self.selected is None:
            return positions, input_ids
        if positions.shape[0] != len(self.selected):
            raise ValueError(f"paged cache: got {positions.shape[0]} rows but steps feed the {len(self.selected)} "
                             f"selected rows {self.selected}; feed those rows, or cache.step_rows(None) for all")
        sel = torch.tensor(self.selected, dtype=torch.int64, device=positions.device)
        wide = positions.new_full((self.rows, positions.shape[1]), -1).index_copy(0, sel, positions)
        ids = None if input_ids is None else input_ids.new_zeros(wide.shape).index_copy(0, sel, input_ids)
        return wide, ids

    def release_row(self, b: int) -> None:
        """Return row ``b``'s blocks to the pool (indexed prompt blocks stay cached for reuse) and make it an
        empty row; the other rows keep their state. Steps already written count no tokens for it (``crop``)."""
        if self.promised[b] or any(b in w for w in self.waits.values()):
            raise ValueError(f"release_row({b}): other rows of this batch reuse prompt blocks row {b} has not "
                             f"written yet; finish the prefill first. Nothing was changed")
        self.commit()
        for g in self.groups:
            for blk in g.tables[b][g.first[b]:]:
                if blk != g.null:
                    g.decref(blk)
            g.tables[b], g.first[b] = [], 0
        self.lens[b] = self.base[b] = self.promised[b] = 0
        self.tokens[b], self.hashes[b], self.salts[b], self.promised_ids[b] = [], [], b"", []
        self.waits.pop(b, None)
        for r in self.history:
            r[b] = False
        self.step = None
        self._unreserve(b)

    def admit_row(self, b: int, prompt_ids: list[int] | None, salt=None, *,
                  reserve: tuple[int, int, int | None] | None = None) -> int:
        """Start a new sequence in empty row ``b``: with prefix caching and ``prompt_ids``, attach the indexed
        blocks of its longest cached prefix; the prompt tokens reused (the last one is always left to compute).
        ``reserve``: ``(prompt_tokens, max_new_tokens, chunk)`` of the request, whose blocks the row is promised
        (:meth:`reserve`) until it is released."""
        if self.lens[b] or any(g.tables[b] for g in self.groups):
            raise ValueError(f"admit_row({b}): row {b} holds {self.lens[b]} tokens; release_row({b}) first")
        salt = salt_bytes(salt)
        if reserve is not None:
            self.reserve(b, reserve[0], reserve[1], chunk=reserve[2])
        self.salts[b] = salt
        if prompt_ids is None or not self.config.prefix_caching:
            return 0
        self.commit()
        hits = self._attach_indexed(b, prompt_ids, prefix_hashes(prompt_ids, self.T, salt=self.salts[b]))
        self.lookup_tokens += len(prompt_ids)
        self.hit_tokens += hits
        self.step = None
        return hits

    # prefix caching
    def match_prefix(self, input_ids: torch.Tensor, positions: torch.Tensor, *, salt=None) -> torch.Tensor:
        """Attach to each row the longest prefix of its prompt that is indexed, or that a longer row of this
        batch is about to write (see the module docstring); the reused tokens per row (B,) int64."""
        if not self.config.prefix_caching:
            raise ValueError("match_prefix: this cache was built with Paged(prefix_caching=False); build it with "
                             "Paged(..., prefix_caching=True)")
        self.commit()
        if self.seen or any(self.lens):
            raise ValueError("match_prefix: the cache already holds tokens; call it on a fresh cache "
                             "(cache.reset() releases rows and keeps cached prefixes)")
        B = input_ids.shape[0]
        self._init_rows(B, salt)
        prompts = [input_ids[b][positions[b] >= 0].tolist() for b in range(B)]
        chains = [prefix_hashes(p, self.T, salt=self.salts[b]) for b, p in enumerate(prompts)]
        hits = [self._attach_indexed(b, prompts[b], chains[b]) for b in range(B)]
        order = sorted(range(B), key=lambda b: (-len(prompts[b]), b))  # writers first: longest, then earliest
        for i, b in enumerate(order):
            shared = self._share_in_batch(b, order[:i], prompts, chains, hits[b])
            if shared > hits[b]:
                self.hit_tokens_in_batch += shared - hits[b]
                hits[b] = shared
        self.lookup_tokens += sum(len(p) for p in prompts)
        self.hit_tokens += sum(hits)
        return torch.tensor(hits, dtype=torch.int64)

    def _window_start(self, g: BlockGroup, tokens: int) -> int:
        """First block a group still needs after ``tokens`` tokens (0 for full-attention groups)."""
        return 0 if g.keep is None else max(0, tokens - (g.window - 1)) // self.T

    def _attach_indexed(self, b: int, ids: list[int], chain: list[bytes]) -> int:
        """Attach row ``b`` to the indexed blocks of its longest cached prefix; the tokens reused (the last
        prompt token is always left to compute, for its logits)."""
        j = len(chain)
        while j > 0 and not all(self._group_has(g, chain, j) for g in self.groups):
            j -= 1
        h = min(j * self.T, max(len(ids) - 1, 0))
        if h == 0:
            return 0
        nblk = -(-h // self.T)
        for g in self.groups:
            start = self._window_start(g, h)
            table = [g.null] * start + [g.by_hash[chain[i]] for i in range(start, nblk)]
            for blk in table[start:]:
                g.incref(blk)
                if blk in g.lru:
                    g.lru.move_to_end(blk)
            g.tables[b], g.first[b] = table, start
        self._set_prefix(b, h, ids, chain)
        return h

    def _set_prefix(self, b: int, h: int, ids: list[int], chain: list[bytes]) -> None:
        self.lens[b] = self.base[b] = h
        self.tokens[b] = ids[:h]
        self.hashes[b] = chain[:h // self.T]

    def _share_in_batch(self, b: int, writers: list[int], prompts: list[list[int]], chains: list[list[bytes]],
                        h: int) -> int:
        """Point row ``b`` at the blocks an earlier-ordered row of this batch holds or will write for their common
        full blocks, when that reuses more than the index gave (``h`` tokens). Returns the tokens reused."""
        limit = (len(prompts[b]) - 1) // self.T  # full blocks b may reuse: its last token is computed
        best, writer = 0, -1
        for a in writers:
            common = 0
            while common < min(limit, len(chains[a])) and chains[a][common] == chains[b][common]:
                common += 1
            if common > best:
                best, writer = common, a
        new_h = best * self.T
        if new_h <= h:
            return h
        for g in self.groups:
            start = self._window_start(g, new_h)
            held = g.tables[writer][start:best]
            if start < g.first[writer] or g.null in held:
                return h  # the writer released blocks this row would need
            if max(0, best - len(g.tables[writer])) > g.available():
                return h  # no room to reserve them now; the prefill will say CacheFull if it matters
        for g in self.groups:
            while len(g.tables[writer]) < best:
                g.tables[writer].append(g.take())  # reserved: the writer fills it during its prefill
            start = self._window_start(g, new_h)
            table = [g.null] * start + g.tables[writer][start:best]
            for blk in table[start:]:
                g.incref(blk)
            for blk in g.tables[b][g.first[b]:]:
                if blk != g.null:
                    g.decref(blk)
            g.tables[b], g.first[b] = table, start
        if new_h > self.base[writer]:
            self.promised[writer] = max(self.promised[writer], new_h)
            self.promised_ids[writer] = prompts[writer][:self.promised[writer]]
        waits = {w: min(t, new_h) for w, t in self.waits.get(writer, {}).items()}
        if new_h > self.base[writer]:
            waits[writer] = new_h
        if waits:
            self.waits[b] = waits
        self._set_prefix(b, new_h, prompts[b], chains[b])
        return new_h

    def _group_has(self, g: BlockGroup, chain: list[bytes], j: int) -> bool:
        start = self._window_start(g, j * self.T)
        return all(chain[i] in g.by_hash for i in range(start, j))

    # steps
    def step_for(self, store_seen: int, positions: torch.Tensor) -> StepSlots:
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

    def allocate(self, positions: torch.Tensor, input_ids: torch.Tensor | None) -> StepSlots:
        """Give a step's real tokens (``positions >= 0``, (B, n)) their slots in every group, all or nothing:
        check the rows, check that rows reusing blocks of their batch read only written ones, plan each group
        (raising :class:`CacheFull` before any change), then release, copy-on-write and take blocks, record
        the positions and token ids, and queue newly filled blocks for the prefix index."""
        self.commit()
        positions, input_ids = self.widen(positions, input_ids)
        B, n = positions.shape
        self._check_rows(B)
        real = positions >= 0
        counts = real.sum(1).tolist()
        self._check_reuse_ready(counts)
        self._check_promised_tokens(positions, input_ids, counts)
        releases = [self._plan_group(g, counts) for g in self.groups]
        blocks, offsets = self._assign_slots(releases, counts)
        self._record_positions(blocks, offsets, positions, real)
        self._record_tokens(positions, input_ids, counts)
        self.history.append(real)
        if len(self.history) - self.folded >= _FOLD_STEPS:  # a long-running engine: bounded list, same columns
            self.history[self.folded:] = [torch.cat(self.history[self.folded:], dim=1)]
            self.folded += 1
        self.seen += n
        device = positions.device
        tables, view_pos = self._views(device)
        self.step = StepSlots(n, real, [torch.tensor(bl, dtype=torch.int64, device=device) for bl in blocks],
                          torch.tensor(offsets, dtype=torch.int64, device=device), tables, view_pos, None)
        if self.selected is not None:  # the layers see the selected rows only
            sel = torch.tensor(self.selected, dtype=torch.int64, device=device)
            self.step = self.step._replace(real=real.index_select(0, sel),
                                           tables=[t.index_select(0, sel) for t in tables],
                                           view_pos=[p.index_select(0, sel) for p in view_pos])
        if device.type == "cpu":  # for the compiled write (nonzero would wait for a GPU: not built there)
            self.step = self.step._replace(src=self.step.real.reshape(-1).nonzero().view(-1))
        return self.step

    def _check_rows(self, B: int) -> None:
        """The step's batch is the cache's (the first step of a fresh cache sets it)."""
        if self.rows == 0 and self.seen == 0:
            self._init_rows(B)
        if B != self.rows:
            raise ValueError(f"paged cache: got {B} rows but the cache holds {self.rows}; use cache.reorder(idx) "
                             f"to change the batch")

    def _check_reuse_ready(self, counts: list[int]) -> None:
        """A row that reuses blocks another row of its batch writes attends only once they are written (by the
        end of this step at the latest: each layer writes every row before any row attends)."""
        for b, waits in self.waits.items():
            if not counts[b]:
                continue
            for w, tokens in waits.items():
                done = self.lens[w] + counts[w]
                if done < tokens:
                    raise ValueError(f"paged cache: row {b} reuses the first {tokens} prompt tokens of row {w} of "
                                     f"this batch, but row {w} has written only {done} of them by this step; feed "
                                     f"the rows right-aligned (left padding) so the longer row's prompt comes first, "
                                     f"or prefill row {w} before row {b}")
        self.waits = {b: waits for b, waits in self.waits.items()
                      if any(self.lens[w] + counts[w] < tokens for w, tokens in waits.items())}

    def _check_promised_tokens(self, positions: torch.Tensor, input_ids: torch.Tensor | None, counts: list[int]
                               ) -> None:
        """A row writing blocks other rows of its batch reuse must write the prompt ``match_prefix`` saw."""
        for w, until in enumerate(self.promised):
            if not until or not counts[w]:
                continue
            if input_ids is None:
                raise ValueError(f"paged cache: row {w} writes prompt blocks other rows of this batch reuse; announce "
                                 f"each step's token ids with cache.prepare(input_ids, positions) before the forward "
                                 f"pass (generate does)")
            fed = input_ids[w][positions[w] >= 0].tolist()[:until - self.lens[w]]
            if fed != self.promised_ids[w][self.lens[w]:self.lens[w] + len(fed)]:
                raise ValueError(f"paged cache: row {w} writes prompt blocks other rows of this batch reuse, but its "
                                 f"tokens differ from the prompt match_prefix was given; feed each row the prompt it "
                                 f"was matched with, from its reused length on")

    def _must_copy(self, g: BlockGroup, b: int, length: int) -> bool:
        """Row ``b`` appends into a partial last block that other rows can see: copy it first. A block the row
        fills for other rows of its batch (below ``promised``) is written in place: that is what they wait for."""
        return bool(length % self.T) and length >= self.promised[b] and g.shared(g.tables[b][length // self.T])

    def _plan_group(self, g: BlockGroup, counts: list[int]) -> list[int]:
        """Blocks each row releases from group ``g`` (out of its window); raises :class:`CacheFull`, changing
        nothing, when the group cannot hold the step."""
        release = [g.releasable(b, self.lens[b]) for b in range(self.rows)]
        need = 0
        for b in range(self.rows):
            length, c = self.lens[b], counts[b]
            if c == 0:
                continue
            need += max(0, -(-(length + c) // self.T) - len(g.tables[b]))
            if self._must_copy(g, b, length):
                need += 1
        freed = sum(1 for b in range(self.rows) for blk in g.tables[b][g.first[b]:g.first[b] + release[b]]
                    if g.ref[blk] == 1)
        if need > g.available() + freed:
            what = "full-attention layers" if g.window is None else f"window-{g.window} layers"
            raise CacheFull(f"paged cache: the {what} need {need} more blocks of {self.T} tokens but only "
                            f"{g.available() + freed} of {g.P} are free; nothing was written. Build the cache "
                            f"with Paged(num_blocks > {g.P}), shorten the request, or reset() finished rows")
        return release

    def _assign_slots(self, releases: list[list[int]], counts: list[int]) -> tuple[list[list[int]], list[int]]:
        """Release out-of-window blocks, copy shared partial blocks, take new ones; the block of every real
        token per group and its slot inside the block (the same in every group)."""
        offsets: list[int] = []
        blocks: list[list[int]] = [[] for _ in self.groups]
        for gi, g in enumerate(self.groups):
            for b in range(self.rows):
                for _ in range(releases[gi][b]):
                    blk = g.tables[b][g.first[b]]
                    g.tables[b][g.first[b]] = g.null
                    g.first[b] += 1
                    g.decref(blk)
            for b in range(self.rows):
                length, c = self.lens[b], counts[b]
                if c == 0:
                    continue
                if self._must_copy(g, b, length):
                    old, new = g.tables[b][length // self.T], g.take()
                    g.copy_block(old, new)
                    g.tables[b][length // self.T] = new
                    g.decref(old)
                while len(g.tables[b]) * self.T < length + c:
                    g.tables[b].append(g.take())
                for t in range(length, length + c):
                    blocks[gi].append(g.tables[b][t // self.T])
                    if gi == 0:
                        offsets.append(t % self.T)
        return blocks, offsets

    def _record_positions(self, blocks: list[list[int]], offsets: list[int], positions: torch.Tensor,
                          real: torch.Tensor) -> None:
        """Write the real tokens' positions into each group's position table."""
        device = positions.device
        for gi, g in enumerate(self.groups):
            if g.pos is None:
                g.pos = torch.full((g.P + 1, self.T), -1, dtype=torch.int64, device=device)
            if blocks[gi]:
                g.pos[torch.tensor(blocks[gi], device=device), torch.tensor(offsets, device=device)] = positions[real]

    def _record_tokens(self, positions: torch.Tensor, input_ids: torch.Tensor | None, counts: list[int]) -> None:
        """Advance the rows' lengths and token ids, and queue their newly filled blocks for the prefix index
        (registered by :meth:`commit` once every layer wrote the step)."""
        ids = None if input_ids is None else input_ids.tolist()
        pos_list = positions.tolist()
        for b in range(self.rows):
            row_real = [t for t, p in enumerate(pos_list[b]) if p >= 0]
            if self.tokens[b] is not None:
                if ids is None or (self.lens[b] == 0 and row_real and pos_list[b][row_real[0]] != 0):
                    self.tokens[b] = None  # unknown ids (or not starting at 0): never indexed
                else:
                    self.tokens[b].extend(ids[b][t] for t in row_real)
            self.lens[b] += counts[b]
            if self.lens[b] >= self.promised[b]:
                self.promised[b] = 0
            if self.config.prefix_caching and self.tokens[b] is not None:
                full = self.lens[b] // self.T
                if full > len(self.hashes[b]):
                    done = len(self.hashes[b])
                    self.hashes[b] = extend_chain(self.hashes[b], self.tokens[b], self.T, self.salts[b])
                    for g in self.groups:
                        for j in range(max(done, g.first[b]), full):
                            self.pending.append((g, g.tables[b][j], self.hashes[b][j]))

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
        if (busy := self.sharing_in_progress()) is not None:
            return busy
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
        self.folded = min(self.folded, len(hist))

    def reorder(self, idx: list[int]) -> None:
        if (busy := self.sharing_in_progress()) is not None:
            raise ValueError(f"reorder: {busy}; nothing was changed")
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
        self.promised, self.promised_ids = [0] * len(idx), [[] for _ in idx]
        t = torch.tensor(idx, dtype=torch.int64)
        self.history = [r.index_select(0, t.to(r.device)) for r in self.history]
        self.rows, self.step = len(idx), None
        self.selected = None
        self._forget_reservations()  # rows were renumbered

    def stats(self) -> dict[str, PoolStats]:
        """:class:`PoolStats` per group of layers: ``"full_attention"`` (full and latent layers) and
        ``"sliding_window_<W>"`` per window."""
        rate = self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
        out = {}
        for w, i in self.group_of.items():
            g = self.groups[i]
            name = "full_attention" if w is None else f"sliding_window_{w}"
            out[name] = PoolStats(self.T, g.P, g.blocks_in_use(), len(g.lru), len(g.free), self.lookup_tokens,
                                  self.hit_tokens, self.hit_tokens_in_batch, rate)
        return out

