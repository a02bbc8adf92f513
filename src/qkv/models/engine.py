"""``Engine``: continuous batching over the paged KV cache (iteration-level scheduling as in Orca, Yu et al. 2022,
OSDI; block-paged memory as in vLLM, Kwon et al. 2023, arXiv:2309.06180; chunked prefill as in Sarathi, Agrawal
et al. 2023, arXiv:2308.16369).

Requests are queued by :meth:`Engine.add`: a prompt (token ids, or text with a ``tokenizer``) and either a budget
of greedy tokens with optional stop tokens, or a :class:`qkv.models.SamplingParams` (vLLM's names: temperature,
top-k, top-p, min-p, seed, repetition/presence/frequency penalties, ``max_tokens``, stop token ids and strings,
logprobs; :mod:`qkv.models.sampling` says in which order the processors run). Every :meth:`Engine.step` runs the
requests that hold a row of the cache:

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

Admission asks the cache's block manager (``cache.can_admit``, as vLLM's scheduler asks its KV-cache manager), which
promises each admitted row, per group of layers that share block tables, the most blocks its request can hold (its
prompt plus budget, or its window for sliding-window layers), so a running request never runs out of blocks:
a request waits (first come, first served) until the pool can hold it, and :meth:`Engine.add` refuses one that
no pool of this size could (``cache.never_fits``). Greedy tokens are those of running each request alone through
:func:`qkv.models.generate` (the same model, ``eos_token_id=stop``).

Tokens: a pass whose rows are all greedy without penalties or logprobs takes the model's own next tokens
(``DecoderLM.next_tokens``, which may screen its LM head in int8); a pass with a sampled, penalized or logprobs row
computes the exact logits of its rows, and each such row picks through its own
:class:`qkv.models.sampling.RequestSampler`: a generator seeded with the request's seed, one draw per generated
token, so a seeded request gives the same tokens alone, in any batch, and as ``generate(params=...)``.
:meth:`Engine.abort` ends a request in any phase and frees its blocks at once; :meth:`Engine.results` keeps every
finished request (finish reason ``"stop"``, ``"length"`` or ``"abort"``) after the stream has been consumed.

With ``prefix_caching=True``, a request admitted while another with the same prompt prefix is still reading it
waits (holding its row, computing nothing) until that writer has its common full blocks in the cache, then
attaches them: requests admitted in the same step share their prompt blocks, copy-on-write as any prefix hit.

Hybrid models (recurrent layers beside attention: Gated DeltaNet in Qwen3-Next and Qwen3.5, Kimi Delta Attention in
Kimi-Linear; any layer with a :class:`qkv.cache.RecurrentSpec`) keep one recurrent state per row slot next to the
paged attention rows: zeroed when a request takes the row, read and written only for the rows of each pass. A
state cannot skip padding between a row's tokens, so their prompt chunks run in passes of equal width (no
padding), and prefix caching and ``mixed_steps`` are refused.

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
    >>> from qkv.models import SamplingParams
    >>> c = engine.add([1, 2, 3], params=SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=0, logprobs=2))
    >>> done = engine.run()[c]
    >>> len(done.tokens), done.finish_reason, len(done.logprobs[0].top)
    (4, 'length', 2)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..cache import KVCache, Paged, RowSlots
from ..cache.protocol import decoder_model_problem
from ..cache.specs import RecurrentSpec
from ..cpu import optimize as cpu_optimize
from ..cpu import optimized
from .generate import _vocab_size, greedy, last_logits, last_tokens
from .sampling import RequestSampler, SamplingParams, TokenLogprobs

__all__ = ["Engine", "EngineResult", "EngineUpdate", "prefill_passes"]


class EngineResult(NamedTuple):
    """A finished request.

    - ``request_id``: the id :meth:`Engine.add` returned.
    - ``tokens``: every generated token, the stop token (or the token completing a stop string) included when one
      ended the request.
    - ``finish_reason``: ``"stop"`` (a stop token or stop string), ``"length"`` (``max_tokens``), ``"abort"``
      (:meth:`Engine.abort`), or ``"error (...)"`` naming the exception of a step that could not be undone (see
      :meth:`Engine.step`).
    - ``prompt_tokens``: tokens in the prompt.
    - ``prefix_hits``: prompt tokens reused from the prefix cache instead of computed.
    - ``logprobs``: one :class:`qkv.models.TokenLogprobs` per token when the request asked for ``logprobs``, else
      None.
    - ``text``: the tokens decoded (special tokens skipped), cut before a stop string that ended the request; None
      without a tokenizer.
    """

    request_id: int
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    prefix_hits: int
    logprobs: list[TokenLogprobs] | None = None
    text: str | None = None


class EngineUpdate(NamedTuple):
    """What one step produced for one request: its new tokens (one per step once its prompt is read; none for an
    aborted request), its :class:`EngineResult` when it finished in this step (else None), and the new tokens'
    :class:`qkv.models.TokenLogprobs` when the request asked for ``logprobs`` (else None)."""

    request_id: int
    tokens: list[int]
    finished: EngineResult | None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    budget: int
    stop: frozenset[int]
    salt: bytes | str | None
    row: int = -1
    fed: int = 0  # prompt tokens in the cache (prefix hits included)
    hits: int = 0
    tokens: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    sampler: RequestSampler | None = None  # None: greedy from the model's own next tokens (a screened head)
    logprobs: list[TokenLogprobs] | None = None
    writer: _Request | None = None  # a request admitted with it whose prompt blocks it waits for (same-step sharing)
    shared: int = 0  # prompt tokens it waits for the writer to have in the cache

    def snapshot(self) -> tuple:
        """What a pass may change: restored by :meth:`restore` when the pass fails and its cache writes are undone."""
        return (self.rid, self.fed, len(self.tokens), None if self.logprobs is None else len(self.logprobs),
                None if self.sampler is None else self.sampler.snapshot())

    def restore(self, state: tuple) -> None:
        _, self.fed, n, n_lp, sampler = state
        del self.tokens[n:]
        if n_lp is not None:
            del self.logprobs[n_lp:]
        if sampler is not None:
            self.sampler.restore(sampler)


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
    """Continuous batching of generation requests (greedy or sampled) over one paged cache (see the module notes).

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
        tokenizer: an HF tokenizer (``encode``, ``decode``): text prompts, stop strings, and each result's text.

    Methods: :meth:`add` queues a request and returns its id; :meth:`step` runs one step and returns an
    :class:`EngineUpdate` per request that advanced; :meth:`stream` (also ``iter(engine)``) steps until every
    request finished, yielding the updates; :meth:`run` does the same and returns every finished request by id;
    :meth:`abort` ends a request; :meth:`results` gives every finished request so far.
    """

    def __init__(self, model, *, num_blocks: int = 1024, block_size: int = 16, max_batch: int = 32,
                 prefill_chunk: int = 512, prefix_caching: bool = False, pad_token_id: int = 0,
                 vocab_size: int | None = None, optimize: bool = True, mixed_steps: bool = False,
                 tokenizer=None) -> None:
        if (why := decoder_model_problem(model)) is not None:
            raise TypeError(f"Engine(model): expected a qkv.cache.DecoderModel (forward(ids, positions=, cache=) and "
                            f"cache_specs()), got {type(model).__name__}: {why}")
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
        self._recurrent = self._check_recurrent(model, prefix_caching, mixed_steps)
        if tokenizer is not None and not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
            raise TypeError(f"Engine: tokenizer must have encode(text) and decode(ids) (an HF tokenizer), got "
                            f"{type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.cache = KVCache(model, storage=Paged(block_size=block_size, num_blocks=num_blocks,
                                                  prefix_caching=prefix_caching))
        if not isinstance(self.cache, RowSlots):
            raise TypeError(f"Engine: {type(self.cache).__name__} cannot recycle rows (qkv.cache.RowSlots)")
        self.cache.open_rows(max_batch)
        self._rows: list[_Request | None] = [None] * max_batch
        self._waiting: deque[_Request] = deque()
        self._results: dict[int, EngineResult] = {}
        self._next_id = 0
        params = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        self.device = params.device if params is not None else torch.device("cpu")

    @staticmethod
    def _check_recurrent(model, prefix_caching: bool, mixed_steps: bool) -> bool:
        """Whether the model has recurrent layers (hybrid: their state rows sit beside the paged rows); refuses
        what a recurrent state cannot do."""
        recurrent = [i for i, s in enumerate(model.cache_specs()) if isinstance(s, RecurrentSpec)]
        if recurrent and prefix_caching:
            raise ValueError(f"Engine: layer {recurrent[0]} (RecurrentSpec) keeps one state per row, not its tokens, "
                             "so a cached prompt prefix cannot be reused (the state at the prefix's end is gone); "
                             "build the Engine with prefix_caching=False for this hybrid model")
        if recurrent and mixed_steps:
            raise ValueError(f"Engine: layer {recurrent[0]} (RecurrentSpec) cannot read padding between a row's "
                             "tokens, which mixed_steps=True puts before decoding rows' tokens; use "
                             "mixed_steps=False for this hybrid model")
        return bool(recurrent)

    # requests
    def add(self, prompt_ids, max_new_tokens: int | None = None, *, params: SamplingParams | None = None,
            stop: int | Sequence[int] | None = None, salt: bytes | str | None = None) -> int:
        """Queue a request; returns its id (0, 1, ... in the order of accepted requests).

        Args:
            prompt_ids: the prompt's token ids (a non-empty list of ints or a 1-D integer tensor in the vocabulary), or
                its text (a str, encoded by the Engine's ``tokenizer``).
            max_new_tokens: tokens to generate greedily, an int >= 1 (fewer when a stop token comes first); or
                give ``params`` instead.
            params: a :class:`qkv.models.SamplingParams` (temperature, top-k/p, min-p, seed, penalties,
                ``max_tokens``, stop token ids and strings, logprobs); exclusive with ``max_new_tokens`` and
                ``stop``.
            stop: with ``max_new_tokens``: a stop token or a list of them; the request ends after emitting one.
            salt: prefix-cache salt (bytes or str): prompt blocks are shared only between equal salts.

        A refused request (``TypeError``/``ValueError`` naming the argument) leaves the engine as it was.
        """
        params = self._check_params(params, max_new_tokens, stop)
        prompt = self._check_prompt(prompt_ids)
        budget = params.max_tokens
        stops = self._check_stop(params.stop_token_ids)
        if salt is not None and not isinstance(salt, (bytes, str)):
            raise TypeError(f"Engine.add: salt must be bytes, str or None, got {type(salt).__name__}")
        why = self.cache.never_fits(len(prompt), budget, chunk=self.prefill_chunk)
        if why is not None:
            raise ValueError(f"Engine.add: {why}; build the Engine with more num_blocks, or shorten the request")
        req = _Request(self._next_id, prompt, budget, stops, salt, params=params)
        if params.needs_logits:
            req.sampler = RequestSampler(params, prompt_ids=prompt, vocab_size=self.vocab_size, device=self.device)
            req.logprobs = [] if params.logprobs is not None else None
        self._next_id += 1
        self._waiting.append(req)
        return req.rid

    def _check_params(self, params, max_new_tokens, stop) -> SamplingParams:
        if params is None:
            if max_new_tokens is None:
                raise TypeError("Engine.add: give max_new_tokens (greedy) or params=SamplingParams(...)")
            _check_count("Engine.add", "max_new_tokens", max_new_tokens)
            ids = self._check_stop(stop)
            return SamplingParams(max_tokens=max_new_tokens, temperature=0, stop_token_ids=tuple(sorted(ids)))
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Engine.add: params must be a qkv.models.SamplingParams, got {type(params).__name__}")
        if max_new_tokens is not None or stop is not None:
            raise ValueError(f"Engine.add: got params and also max_new_tokens={max_new_tokens!r} / stop={stop!r}; "
                             f"pass them inside params (SamplingParams(max_tokens=..., stop_token_ids=...))")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"Engine.add: stop strings {list(params.stop)} need text, but this Engine has no "
                             f"tokenizer; build it with Engine(model, tokenizer=...) or pass stop_token_ids")
        return params

    def abort(self, request_id: int) -> bool:
        """End a request now, in any phase (waiting, reading its prompt, decoding): its blocks return to the pool at
        once and :meth:`results` holds it with ``finish_reason="abort"`` and the tokens it had. Returns True, or
        False when it had already finished. An id :meth:`add` never returned is a ``ValueError``."""
        if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id < self._next_id:
            given = f"ids 0 .. {self._next_id - 1} were given out" if self._next_id else "no request was added yet"
            raise ValueError(f"Engine.abort: {request_id!r} is not a request id of this Engine ({given}); pass an id "
                             f"Engine.add returned")
        req = next((r for r in self._waiting if r.rid == request_id), None)
        if req is not None:
            self._waiting.remove(req)
        else:
            req = next((r for r in self._rows if r is not None and r.rid == request_id), None)
            if req is None:
                return False  # finished already
            self._finish(req.row)
        self._record(req, "abort")
        return True

    def results(self, *, clear: bool = False) -> dict[int, EngineResult]:
        """Every request finished so far (stopped, at its length, or aborted), by id, also after :meth:`stream`.
        ``clear=True`` hands them over and forgets them (a long-running engine keeps no record of old requests;
        :meth:`abort` of a forgotten id is then a no-op returning False)."""
        if not isinstance(clear, bool):
            raise TypeError(f"Engine.results: clear must be True or False, got {clear!r}")
        out = dict(self._results)
        if clear:
            self._results.clear()
        return out

    def _record(self, req: _Request, reason: str, text: str | None = None) -> EngineResult:
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(req.tokens, skip_special_tokens=True)
        res = EngineResult(req.rid, req.tokens, reason, len(req.prompt), req.hits, req.logprobs, text)
        self._results[req.rid] = res
        return res

    def _check_prompt(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, str):
            if self.tokenizer is None:
                raise TypeError("Engine.add: a text prompt needs a tokenizer (build the Engine with "
                                "Engine(model, tokenizer=...)); without one prompt_ids must be a list of ints")
            prompt_ids = list(self.tokenizer.encode(prompt_ids))
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
        self._attach_ready()
        prefill = [b for b, r in enumerate(self._rows) if r is not None and r.writer is None and r.fed < len(r.prompt)]
        decode = [b for b, r in enumerate(self._rows) if r is not None and r.fed == len(r.prompt)]
        if self.mixed_steps:
            passes = [sorted(prefill + decode)] if prefill or decode else []
        else:
            passes = self._prefill_groups(prefill) + ([decode] if decode else [])
        updates, self._held = list(self._held), ()
        for rows in passes:
            start, before = self.cache.seq_length, {b: self._rows[b].snapshot() for b in rows}
            try:
                updates += self._run(rows)
            except BaseException as e:
                self._held = tuple(updates + self._undo_pass(rows, start, before, e))
                raise
        return updates

    def _undo_pass(self, rows: list[int], start: int, before: dict, error: BaseException) -> list[EngineUpdate]:
        """Undo a pass over ``rows`` that raised ``error`` (see :meth:`step`): the cache's writes, and each request's
        prompt progress, tokens, logprobs and sampler as they were before it (``before``: row -> snapshot); the
        updates of the requests it ended."""
        why = self.cache.rollback_step(start)
        if why is None:
            for b in rows:
                if self._rows[b] is not None and self._rows[b].rid == before[b][0]:
                    self._rows[b].restore(before[b])
            return []
        ended = []
        for b in rows:
            r = self._rows[b]
            self._finish(b)
            result = self._record(r, f"error ({type(error).__name__}: {error}; the step could not be undone: {why})")
            ended.append(EngineUpdate(r.rid, [], result))
        return ended

    def _feed_width(self, b: int) -> int:
        r = self._rows[b]
        return min(self.prefill_chunk, len(r.prompt) - r.fed)

    def _prefill_groups(self, prefill: list[int]) -> list[list[int]]:
        """The forward passes of this step's prompt chunks: :func:`prefill_passes`, or for a hybrid model one pass
        per chunk width (a recurrent state cannot skip padding between a row's tokens)."""
        widths = {b: self._feed_width(b) for b in prefill}
        if not self._recurrent:
            return prefill_passes(widths)
        return [[b for b in prefill if widths[b] == w] for w in sorted(set(widths.values()), reverse=True)]

    def _attach(self, req: _Request) -> None:
        """Give an admitted request its cache row. With prefix caching, a request whose prompt shares full blocks
        with one still reading its prompt waits for that writer's blocks (:meth:`_attach_ready`) instead of
        computing them a second time in the same step."""
        if self.prefix_caching:
            T, best = self.block_size, 0
            for w in self._rows:
                if w is None or w is req or w.writer is not None or w.salt != req.salt or w.fed >= len(w.prompt):
                    continue
                common = next((i for i, (x, y) in enumerate(zip(w.prompt, req.prompt)) if x != y),
                              min(len(w.prompt), len(req.prompt)))
                shared = min(common, len(req.prompt) - 1) // T * T
                if shared > w.fed and shared > best:
                    best, req.writer, req.shared = shared, w, shared
            if req.writer is not None:  # its place in the pool is promised now, its prompt attached later
                self.cache.reserve_row(req.row, len(req.prompt), req.budget, chunk=self.prefill_chunk)
                return
        req.hits = self.cache.admit_row(req.row, req.prompt, salt=req.salt, max_new_tokens=req.budget,
                                        chunk=self.prefill_chunk)
        req.fed = req.hits

    def _attach_ready(self) -> None:
        """Attach the rows waiting for a writer's prompt blocks once it has them in the cache (or has ended)."""
        for r in self._rows:
            if r is not None and r.writer is not None and (
                    r.writer.fed >= r.shared or r.writer.row < 0 or self._rows[r.writer.row] is not r.writer):
                r.writer = None
                self._attach(r)

    def _admit(self) -> None:
        while self._waiting:
            req = self._waiting[0]
            free = next((b for b, r in enumerate(self._rows) if r is None), None)
            if free is None or not self.cache.can_admit(len(req.prompt), req.budget, chunk=self.prefill_chunk):
                return
            self._waiting.popleft()
            req.row = free
            self._rows[free] = req
            self._attach(req)

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
        picks, logits = self._pick(rows, ids_t.to(self.device), pos_t.to(self.device))
        updates = []
        for i, b in enumerate(rows):
            r = self._rows[b]
            if prefilling[i]:
                r.fed += len(feeds[i][0])
                if r.fed < len(r.prompt):
                    continue
            updates.append(self._emit(r, picks[i], None if logits is None else logits[i]))
        return updates

    def _pick(self, rows: list[int], ids: torch.Tensor, pos: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """One forward pass; the greedy tokens of its rows, and its exact logits (B, V) when some row samples,
        penalizes or asks for logprobs (else None: the model's own next tokens, which may screen its head)."""
        if all(self._rows[b].sampler is None for b in rows):
            return last_tokens(self.model, self.cache, ids, pos).tolist(), None
        logits = last_logits(self.model, self.cache, ids, pos)
        return greedy(logits.float()).tolist(), logits

    def _emit(self, r: _Request, greedy_pick: int, logits: torch.Tensor | None) -> EngineUpdate:
        """Request ``r``'s next token (its sampler's choice from ``logits`` (V,) where it has one), and whether it
        ends the request."""
        token, lp = greedy_pick, None
        if r.sampler is not None:
            token, lp = r.sampler.choose(logits[:self.vocab_size])
            if lp is not None:
                r.logprobs.append(lp)
        r.tokens.append(token)
        reason, text = None, None
        if token in r.stop:
            reason = "stop"
        elif r.params.stop:
            text = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
            cut = [i for i in (text.find(s) for s in r.params.stop) if i >= 0]
            if cut:
                reason, text = "stop", text[:min(cut)]
        if reason is None and len(r.tokens) == r.budget:
            reason, text = "length", None
        done = None
        if reason is not None:
            self._finish(r.row)
            done = self._record(r, reason, text)
        return EngineUpdate(r.rid, [token], done, None if lp is None else [lp])

    def _finish(self, b: int) -> None:
        self.cache.release_row(b)  # its blocks and its promise return to the pool
        self._rows[b] = None

    def stream(self) -> Iterator[EngineUpdate]:
        """Step until no request waits or runs, yielding every :class:`EngineUpdate` as it comes. Requests added
        meanwhile (from the loop body) join."""
        while self.busy:
            yield from self.step()

    __iter__ = stream

    def run(self) -> dict[int, EngineResult]:
        """Step until no request waits or runs; every request finished so far, by id (as :meth:`results`)."""
        for _ in self.stream():
            pass
        return self.results()

    def __repr__(self) -> str:
        return (f"Engine(max_batch={self.max_batch}, {self.cache.storage.describe()}, prefill_chunk="
                f"{self.prefill_chunk}, prefix_caching={self.prefix_caching}, running={len(self.running)}, "
                f"waiting={len(self._waiting)})")
