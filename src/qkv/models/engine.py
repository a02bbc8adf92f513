"""``Engine``: continuous batching over the paged KV cache (iteration-level scheduling as in Orca, Yu et al. 2022,
OSDI; block-paged memory as in vLLM, Kwon et al. 2023, arXiv:2309.06180; chunked prefill as in Sarathi, Agrawal
et al. 2023, arXiv:2308.16369).

Requests (a prompt, a budget of new tokens, optional stop tokens) are queued by :meth:`Engine.add` and decoded
greedily. Every :meth:`Engine.step` runs the requests that hold a row of the cache:

- rows still reading their prompt feed the next ``prefill_chunk`` prompt tokens, in forward passes over those
  rows (each as wide as its longest chunk, shorter chunks right-aligned behind padding at position -1), the rows
  split into passes of similar chunk width where that saves more padding than a pass costs
  (:func:`prefill_passes`);
- rows decoding feed their last token, in one forward pass of width 1 over those rows.

Each pass covers only its own rows (``cache.step_rows``), so a long prompt costs its own tokens and never
stalls the decoding rows for more than one chunk. The alternative, one pass per step over every running row
with the decoding rows padded to the chunk width (``mixed_steps=True``), computes every padding position of
every row: on ``benchmarks/engine.py``'s Llama (width 512, 4 layers, 1 thread, 16 requests of 16-512 prompt
tokens and 8-128 new ones, a loaded machine) it ran at 0.39x the per-phase rate, and static batches of 8 (the
requests sorted by length, each batch decoding to its longest budget) at 0.61x; the greedy tokens were the
same in all three. A request that emits a stop token or reaches its budget
releases its blocks at once (``cache.release_row``), and the next waiting request takes its row
(``cache.admit_row``, which with ``prefix_caching=True`` attaches the cached blocks of its longest indexed
prompt prefix, so only the rest is computed).

Admission reserves, per group of layers that share block tables, the most blocks the request can hold (its
prompt plus budget, or its window for sliding-window layers), so a running request never runs out of blocks:
a request waits (first come, first served) until the pool can hold it, and :meth:`Engine.add` refuses one that
no pool of this size could. Greedy tokens are those of running each request alone through
:func:`qkv.models.generate` (the same model, ``eos_token_id=stop``).

Example:
    >>> import torch
    >>> from qkv.nn import DecoderConfig, DecoderLM
    >>> from qkv.models import Engine
    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> model = DecoderLM(DecoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
    ...                                 num_attention_heads=4, intermediate_size=64)).eval()
    >>> engine = Engine(model, num_blocks=32, block_size=4, max_batch=2)
    >>> a = engine.add([1, 2, 3], max_new_tokens=5)
    >>> b = engine.add([4, 5, 6, 7, 8, 9], max_new_tokens=2)
    >>> results = engine.run()
    >>> [len(results[r].tokens) for r in (a, b)]
    [5, 2]
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..cache import KVCache, Paged, RowSlots
from ..cache.protocol import DecoderModel
from ..cache.specs import FullSpec, LatentSpec, RecurrentSpec, SlidingWindowSpec
from ..cpu import optimize as cpu_optimize
from ..cpu import optimized
from .generate import _vocab_size, last_tokens

__all__ = ["Engine", "EngineResult", "EngineUpdate", "prefill_passes"]


class EngineResult(NamedTuple):
    """A finished request.

    request_id: the id :meth:`Engine.add` returned.
    tokens: every generated token, the stop token included when one ended the request.
    finish_reason: ``"stop"`` (a stop token), ``"length"`` (the budget), or ``"error (...)"`` naming the exception
        of a step that could not be undone (see :meth:`Engine.step`).
    prompt_tokens: tokens in the prompt.
    prefix_hits: prompt tokens reused from the prefix cache instead of computed.
    """

    request_id: int
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    prefix_hits: int


class EngineUpdate(NamedTuple):
    """What one step produced for one request: its new tokens (one per step once its prompt is read), and its
    :class:`EngineResult` when it finished in this step (else None)."""

    request_id: int
    tokens: list[int]
    finished: EngineResult | None


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    budget: int
    stop: frozenset[int]
    salt: bytes | str | None
    need: list[int]  # blocks reserved per group while the request holds a row
    row: int = -1
    fed: int = 0  # prompt tokens in the cache (prefix hits included)
    hits: int = 0
    tokens: list[int] = field(default_factory=list)


#: What one more forward pass costs, in padded token positions: a pass reads every weight once and pays its
#: per-layer launch and Python work whatever its width, about as much as the products of 32 token positions on
#: benchmarks/vs_vllm.py's Llama (width 512) at one thread; splitting the prompt chunks of one step into passes of
#: similar width pays when it removes more padding than this per extra pass.
PASS_COST_TOKENS = 32


def prefill_passes(widths: dict[int, int], pass_cost: int = PASS_COST_TOKENS) -> list[list[int]]:
    """Rows reading their prompts, split into forward passes so that padding plus the passes' fixed cost is least.

    A pass is as wide as its widest chunk (narrower ones are padded), so it costs ``pass_cost + rows x width``
    token positions; with the rows sorted by width, the cheapest split into runs of neighbours is found exactly
    by dynamic programming (each pass's rows in ascending row order). ``widths`` maps row -> chunk width.

    Example:
        >>> prefill_passes({0: 128, 1: 128, 2: 3, 3: 2})   # two long chunks, two short ones: two passes
        [[0, 1], [2, 3]]
        >>> prefill_passes({0: 128, 1: 120, 2: 126})        # close widths share one pass
        [[0, 1, 2]]
    """
    if not isinstance(widths, dict):
        raise TypeError(f"prefill_passes: widths must be a dict of row -> chunk width, got {type(widths).__name__}")
    bad = [(b, w) for b, w in widths.items() if not all(isinstance(x, int) and not isinstance(x, bool) for x in (b, w))
           or b < 0 or w < 1]
    if bad:
        raise ValueError(f"prefill_passes: widths must map row ids (ints >= 0) to chunk widths (ints >= 1), got "
                         f"{bad[0][0]!r}: {bad[0][1]!r}")
    if not isinstance(pass_cost, (int, float)) or isinstance(pass_cost, bool) or not pass_cost >= 0:
        raise ValueError(f"prefill_passes: pass_cost must be a number >= 0 (token positions), got {pass_cost!r}")
    order = sorted(widths, key=lambda b: (-widths[b], b))
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[j]: least cost of the first j rows (widest first)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # rows i .. j - 1 in one pass, as wide as row i
            c = best[i] + pass_cost + (j - i) * widths[order[i]]
            if c < best[j]:
                best[j], cut[j] = c, i
    passes, j = [], n
    while j:
        passes.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return passes[::-1]


def _check_count(owner: str, name: str, value, *, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int >= {low}, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{owner}: {name} must be an int >= {low}, got {value!r}")
    return value


class Engine:
    """Continuous batching of greedy generation requests over one paged cache (see the module notes).

    Args:
        model: a :class:`qkv.cache.DecoderModel` (``forward(ids, positions=, cache=)``, ``cache_specs()``).
        num_blocks: blocks in each layer's pool (:class:`qkv.cache.Paged`).
        block_size: tokens per block.
        max_batch: rows of the cache: requests decoded at once.
        prefill_chunk: prompt tokens a row feeds per step (a longer prompt is read in chunks, so it never stalls
            the decoding rows for more than one chunk's pass). On ``benchmarks/vs_vllm.py``'s stream (prompts of
            16-512 tokens) 512, every prompt in one pass, ran faster than 128 or 256 (passes of a few thousand
            tokens keep the products' operands in cache better than more, smaller passes).
        prefix_caching: reuse the cached blocks of prompt prefixes seen before (``Paged(prefix_caching=True)``).
        pad_token_id: the token fed in padding positions (never attended to).
        vocab_size: the model's vocabulary; default ``model.config.vocab_size``.
        optimize: give an ``nn.Module`` model on the CPU qkv's CPU products first, as
            :func:`qkv.models.generate` does (:func:`qkv.cpu.optimize`, in place).
        mixed_steps: run each step as one forward pass over every running row, decoding rows padded to the
            prompt chunks' width, instead of one pass per phase (the default, measured cheaper: see the module
            notes).

    Methods: :meth:`add` queues a request and returns its id; :meth:`step` runs one step and returns an
    :class:`EngineUpdate` per request that advanced; :meth:`stream` (also ``iter(engine)``) steps until every
    request finished, yielding the updates; :meth:`run` does the same and returns the results by id.
    """

    def __init__(self, model, *, num_blocks: int = 1024, block_size: int = 16, max_batch: int = 32,
                 prefill_chunk: int = 512, prefix_caching: bool = False, pad_token_id: int = 0,
                 vocab_size: int | None = None, optimize: bool = True, mixed_steps: bool = False) -> None:
        if not isinstance(model, DecoderModel):
            raise TypeError(f"Engine(model): expected a qkv.cache.DecoderModel (forward(ids, positions=, cache=) and "
                            f"cache_specs()), got {type(model).__name__}")
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_batch", max_batch),
                            ("prefill_chunk", prefill_chunk)):
            _check_count("Engine", name, value)
        for name, value in (("prefix_caching", prefix_caching), ("optimize", optimize), ("mixed_steps", mixed_steps)):
            if not isinstance(value, bool):
                raise TypeError(f"Engine: {name} must be True or False, got {value!r}")
        vocab = _vocab_size(model) if vocab_size is None else _check_count("Engine", "vocab_size", vocab_size)
        if vocab is None:
            raise ValueError(f"Engine: cannot tell the vocabulary of {type(model).__name__} (no config.vocab_size); "
                             f"pass vocab_size=")
        _check_count("Engine", "pad_token_id", pad_token_id, low=0)
        if pad_token_id >= vocab:
            raise ValueError(f"Engine: pad_token_id must lie in [0, {vocab}), got {pad_token_id}")
        if (optimize and isinstance(model, torch.nn.Module) and optimized(model) is None
                and all(p.device.type == "cpu" for p in model.parameters())):
            cpu_optimize(model)
        self.model, self.vocab_size, self.pad_token_id = model, vocab, pad_token_id
        self.block_size, self.num_blocks, self.max_batch = block_size, num_blocks, max_batch
        self.prefill_chunk, self.prefix_caching, self.mixed_steps = prefill_chunk, prefix_caching, mixed_steps
        recurrent = [i for i, s in enumerate(model.cache_specs()) if isinstance(s, RecurrentSpec)]
        if recurrent:  # chunks behind padding and per-row steps would need a state per row slot and phase
            raise ValueError(f"Engine: layer {recurrent[0]} (RecurrentSpec) keeps a recurrent state; continuous "
                             "batching of hybrid models (recurrent layers) is not supported; decode them with "
                             "qkv.models.generate")
        self.cache = KVCache(model, storage=Paged(block_size=block_size, num_blocks=num_blocks,
                                                  prefix_caching=prefix_caching))
        if not isinstance(self.cache, RowSlots):
            raise TypeError(f"Engine: {type(self.cache).__name__} cannot recycle rows (qkv.cache.RowSlots)")
        self.cache.open_rows(max_batch)
        windows = {s.window if isinstance(s, SlidingWindowSpec) else None for s in self.cache.specs
                   if isinstance(s, (FullSpec, SlidingWindowSpec, LatentSpec))}
        self._windows: list[int | None] = sorted(windows, key=lambda w: -1 if w is None else w)
        self._reserved = [0] * len(self._windows)
        self._rows: list[_Request | None] = [None] * max_batch
        self._waiting: deque[_Request] = deque()
        self._next_id = 0
        params = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        self.device = params.device if params is not None else torch.device("cpu")

    # requests
    def add(self, prompt_ids, max_new_tokens: int, *, stop: int | Sequence[int] | None = None,
            salt: bytes | str | None = None) -> int:
        """Queue a request; returns its id (0, 1, ... in the order of accepted requests).

        Args:
            prompt_ids: the prompt's token ids: a non-empty list of ints (or a 1-D integer tensor) in the vocabulary.
            max_new_tokens: tokens to generate, an int >= 1 (fewer when a stop token comes first).
            stop: a stop token or a list of them: the request ends after emitting one.
            salt: prefix-cache salt (bytes or str): prompt blocks are shared only between equal salts.

        A refused request (``TypeError``/``ValueError`` naming the argument) leaves the engine as it was.
        """
        prompt = self._check_prompt(prompt_ids)
        budget = _check_count("Engine.add", "max_new_tokens", max_new_tokens)
        stops = self._check_stop(stop)
        if salt is not None and not isinstance(salt, (bytes, str)):
            raise TypeError(f"Engine.add: salt must be bytes, str or None, got {type(salt).__name__}")
        need = self._blocks_needed(len(prompt), budget)
        for w, n in zip(self._windows, need, strict=True):
            if n > self.num_blocks:
                what = "full-attention layers" if w is None else f"window-{w} layers"
                raise ValueError(f"Engine.add: the request needs up to {n} blocks of {self.block_size} tokens in the "
                                 f"{what} (prompt {len(prompt)} + max_new_tokens {budget}) but the pool has "
                                 f"{self.num_blocks}; build the Engine with num_blocks >= {n}, or shorten the request")
        req = _Request(self._next_id, prompt, budget, stops, salt, need)
        self._next_id += 1
        self._waiting.append(req)
        return req.rid

    def _check_prompt(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex() \
                    or prompt_ids.dtype == torch.bool:
                raise TypeError(f"Engine.add: prompt_ids must be a 1-D integer tensor or a list of ints, got a "
                                f"{prompt_ids.dtype} tensor of shape {tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        if not isinstance(prompt_ids, Sequence) or isinstance(prompt_ids, (str, bytes)):
            raise TypeError(f"Engine.add: prompt_ids must be a list of ints, got {type(prompt_ids).__name__}")
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise TypeError(f"Engine.add: prompt_ids must hold ints (token ids), got {type(bad[0]).__name__} "
                            f"{bad[0]!r}")
        if not prompt_ids:
            raise ValueError("Engine.add: prompt_ids is empty; a request needs at least one prompt token")
        lo, hi = min(prompt_ids), max(prompt_ids)
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"Engine.add: prompt_ids hold token ids in [{lo}, {hi}] but the vocabulary is 0 .. "
                             f"{self.vocab_size - 1}; tokenize with the model's tokenizer")
        return list(prompt_ids)

    def _check_stop(self, stop) -> frozenset[int]:
        if stop is None:
            return frozenset()
        ids = [stop] if isinstance(stop, int) and not isinstance(stop, bool) else stop
        if (not isinstance(ids, (Sequence, set, frozenset)) or isinstance(ids, (str, bytes))
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise TypeError(f"Engine.add: stop must be a token id (int) or a list of them, got {stop!r}")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"Engine.add: stop tokens must lie in the vocabulary 0 .. {self.vocab_size - 1}, got "
                             f"{sorted(ids)}")
        return frozenset(ids)

    def _blocks_needed(self, prompt: int, budget: int) -> list[int]:
        """The most blocks a request holds at once, per group of layers: its prompt and every token fed back
        (the last new token is never fed), or for a window-``W`` group what a row of ``W`` tokens and one step
        spans; one more when a prefix hit may end inside a block, which is copied before it is written."""
        T, stored = self.block_size, prompt + budget - 1
        per_step = max(1, min(self.prefill_chunk, prompt))
        copy = 1 if self.prefix_caching and prompt % T == 0 else 0
        need = []
        for w in self._windows:
            blocks = math.ceil(stored / T)
            if w is not None:
                blocks = min(blocks, (w + per_step + 2 * T - 2) // T)
            need.append(blocks + copy)
        return need

    # stepping
    @property
    def busy(self) -> bool:
        """True while some request waits or runs."""
        return bool(self._waiting) or any(r is not None for r in self._rows)

    @property
    def waiting(self) -> list[int]:
        """Ids of the queued requests that hold no row yet, first come first."""
        return [r.rid for r in self._waiting]

    @property
    def running(self) -> list[int]:
        """Ids of the requests holding a row."""
        return [r.rid for r in self._rows if r is not None]

    #: Updates of a step that raised after some of its passes had finished, handed out by the next step.
    _held: tuple[EngineUpdate, ...] = ()

    @torch.no_grad()
    def step(self) -> list[EngineUpdate]:
        """Admit waiting requests into free rows, then run one step: a prompt chunk for every row reading its
        prompt and one token for every decoding row. Returns an :class:`EngineUpdate` per request that got new
        tokens (none for a row still reading its prompt); empty when nothing runs.

        When a pass raises (any exception, ``KeyboardInterrupt`` included), its writes to the cache are undone and
        the exception propagates: its requests keep their rows and the next step runs them again, with the same
        tokens. Where a sliding-window layer already released blocks the undo needs, the pass's requests end
        instead, ``finish_reason="error (...)"`` naming the exception, and their blocks return to the pool. The
        updates of the passes that finished before come with the next step's."""
        self._admit()
        prefill = [b for b, r in enumerate(self._rows) if r is not None and r.fed < len(r.prompt)]
        decode = [b for b, r in enumerate(self._rows) if r is not None and r.fed == len(r.prompt)]
        if self.mixed_steps:
            passes = [sorted(prefill + decode)] if prefill or decode else []
        else:
            passes = prefill_passes({b: self._feed_width(b) for b in prefill}) + ([decode] if decode else [])
        updates, self._held = list(self._held), ()
        for rows in passes:
            start = self.cache.seq_length
            try:
                updates += self._run(rows)
            except BaseException as e:
                self._held = tuple(updates + self._undo_pass(rows, start, e))
                raise
        return updates

    def _undo_pass(self, rows: list[int], start: int, error: BaseException) -> list[EngineUpdate]:
        """Undo a pass over ``rows`` that raised ``error`` (see :meth:`step`); the updates of the requests it ended."""
        why = self.cache.rollback_step(start)
        if why is None:
            return []
        ended = []
        for b in rows:
            r = self._rows[b]
            result = EngineResult(r.rid, r.tokens, f"error ({type(error).__name__}: {error}; the step could not be "
                                  f"undone: {why})", len(r.prompt), r.hits)
            self._finish(b)
            ended.append(EngineUpdate(r.rid, [], result))
        return ended

    def _feed_width(self, b: int) -> int:
        r = self._rows[b]
        return min(self.prefill_chunk, len(r.prompt) - r.fed)

    def _admit(self) -> None:
        while self._waiting:
            req = self._waiting[0]
            free = next((b for b, r in enumerate(self._rows) if r is None), None)
            if free is None or any(have + n > self.num_blocks for have, n in zip(self._reserved, req.need)):
                return
            self._waiting.popleft()
            req.row = free
            req.hits = self.cache.admit_row(free, req.prompt if self.prefix_caching else None, salt=req.salt)
            req.fed = req.hits
            self._rows[free] = req
            self._reserved = [have + n for have, n in zip(self._reserved, req.need)]

    def _run(self, rows: list[int]) -> list[EngineUpdate]:
        """One forward pass over ``rows`` (prompt chunks or last tokens, right-aligned); their updates."""
        feeds, prefilling = [], []
        for b in rows:
            r = self._rows[b]
            prefilling.append(r.fed < len(r.prompt))
            if prefilling[-1]:
                ids = r.prompt[r.fed:r.fed + self.prefill_chunk]
                feeds.append((ids, r.fed))
            else:
                feeds.append((r.tokens[-1:], len(r.prompt) + len(r.tokens) - 1))
        width = max(len(ids) for ids, _ in feeds)
        pad = [self.pad_token_id] * width, [-1] * width
        ids_t = torch.tensor([pad[0][len(ids):] + ids for ids, _ in feeds], dtype=torch.int64)  # right-aligned
        pos_t = torch.tensor([pad[1][len(ids):] + list(range(start, start + len(ids))) for ids, start in feeds],
                             dtype=torch.int64)
        self.cache.step_rows(rows if len(rows) < self.max_batch else None)
        picks = last_tokens(self.model, self.cache, ids_t.to(self.device), pos_t.to(self.device)).tolist()
        updates = []
        for i, b in enumerate(rows):
            r = self._rows[b]
            if prefilling[i]:
                r.fed += len(feeds[i][0])
                if r.fed < len(r.prompt):
                    continue
            r.tokens.append(picks[i])
            done = None
            if picks[i] in r.stop or len(r.tokens) == r.budget:
                done = EngineResult(r.rid, r.tokens, "stop" if picks[i] in r.stop else "length", len(r.prompt),
                                    r.hits)
                self._finish(b)
            updates.append(EngineUpdate(r.rid, [picks[i]], done))
        return updates

    def _finish(self, b: int) -> None:
        req = self._rows[b]
        self.cache.release_row(b)
        self._rows[b] = None
        self._reserved = [have - n for have, n in zip(self._reserved, req.need)]

    def stream(self) -> Iterator[EngineUpdate]:
        """Step until no request waits or runs, yielding every :class:`EngineUpdate` as it comes. Requests added
        meanwhile (from the loop body) join."""
        while self.busy:
            yield from self.step()

    __iter__ = stream

    def run(self) -> dict[int, EngineResult]:
        """Step until no request waits or runs; the results of the requests that finished, by id."""
        return {u.request_id: u.finished for u in self.stream() if u.finished is not None}

    def __repr__(self) -> str:
        return (f"Engine(max_batch={self.max_batch}, {self.cache.storage.describe()}, prefill_chunk="
                f"{self.prefill_chunk}, prefix_caching={self.prefix_caching}, running={len(self.running)}, "
                f"waiting={len(self._waiting)})")
