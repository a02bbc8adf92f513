"""``generate``: batched autoregressive decoding for any :class:`qkv.cache.DecoderModel`.

Shape legend: B rows, N prompt columns, T new tokens, V vocabulary.

Prompts of different lengths are left-padded (``attention_mask`` 0 on the left): a padding token has
position ``-1`` (stored but never attended) and each row's positions count from its first real token,
so row ``b``'s k-th real token sits at position ``k`` whatever the padding. Prefill runs in chunks of
``prefill_chunk_size`` columns when asked (bounded activation memory, the same cache writes). Decoding
is greedy, or samples with temperature, top-k and top-p (nucleus, Holtzman et al. 2020,
arXiv:1904.09751) from a seeded ``torch.Generator``. A row that emits a stop token is finished: it
keeps emitting ``pad_token_id`` at position ``-1``, so it costs nothing in a paged cache.

With a paged cache built with ``prefix_caching=True``, each row's longest cached prompt prefix is
reused (``cache.match_prefix``) and only the rest is prefilled. Rows of one batch with a common prompt
prefix share it too: a row reuses the full blocks a longer row of the batch writes in the same prefill
(no extra pass and no extra columns; the prefill is as wide as the longest remaining prompt either way).

Example:
    >>> import torch
    >>> from qkv.models.generate import generate
    >>> class Bigram(torch.nn.Module):           # the smallest DecoderModel: no attention, no cache use
    ...     def __init__(self):
    ...         super().__init__(); self.emb = torch.nn.Embedding(10, 10)
    ...     def forward(self, ids, *, positions=None, cache=None):
    ...         return self.emb(ids)
    ...     def cache_specs(self):
    ...         return []
    >>> out = generate(Bigram(), torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    >>> out.sequences.shape
    torch.Size([1, 7])
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from ..cache.protocol import PrefixMatchingCache, decoder_model_problem
from ..cpu import optimize as cpu_optimize
from ..cpu import optimized
from ..cpu import step as cpu_step
from ..pos.ids import positions_from_padding
from .sampling import RequestSampler, SamplingParams

__all__ = ["generate", "GenerateOutput", "GreedyDecoder", "prompt_positions", "sample_next", "logits_of",
           "forward_step", "last_logits", "last_tokens", "prefill"]

Streamer = Callable[[torch.Tensor], None]


class GenerateOutput(NamedTuple):
    """The result of :func:`generate`.

    sequences: (B, N + T) the prompt as given (padding included) followed by the new tokens.
    new_tokens: (B, T) generated tokens (``pad_token_id`` after a row finished).
    logits: (B, T, V) float32 logits each new token was chosen from (``return_logits=True``), else None.
    finished: (B,) bool, rows that emitted a stop token.
    prefix_hits: (B,) int64 prompt tokens reused from the prefix cache, written by an earlier request or by a
    longer row of this batch (zeros without prefix caching).
    cache: the cache after decoding (None without a cache).
    """

    sequences: torch.Tensor
    new_tokens: torch.Tensor
    logits: torch.Tensor | None
    finished: torch.Tensor
    prefix_hits: torch.Tensor
    cache: object | None


def prompt_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions (B, N) of a left-padded batch: ``-1`` on padding, ``0, 1, ...`` from each row's first
    real token. Raises when a row is right-padded or empty."""
    m = attention_mask.to(torch.bool)
    if m.dim() != 2:
        raise ValueError(f"attention_mask: expected (B, N), got {tuple(m.shape)}")
    if m.shape[1] and bool((m[:, :-1] & ~m[:, 1:]).any()):
        raise ValueError("attention_mask: padding must be on the left (0s then 1s per row); right-padded rows "
                         "would decode after their padding. Left-pad the prompts (tokenizer padding_side='left')")
    if not bool(m.any(1).all()):
        raise ValueError("attention_mask: every row needs at least one real token")
    return positions_from_padding(m)


_BLOCK = 256  # greedy(): columns per block


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for (B, V) logits (the first index of each row's maximum), found through the
    maxima of blocks of 256 columns (a vectorized reduction) and one argmax inside the winning block: 5-9x
    faster than torch's CPU argmax over a 32K vocabulary. Rows holding a NaN go through ``argmax`` itself."""
    B, V = logits.shape
    main = V // _BLOCK * _BLOCK
    if main < 4 * _BLOCK or not logits.is_contiguous():
        return logits.argmax(-1)
    blocks = logits[:, :main].view(B, main // _BLOCK, _BLOCK)
    peaks = blocks.amax(-1)  # (B, blocks)
    best = peaks.argmax(-1)  # the first block holding the row's maximum
    top = peaks.gather(1, best[:, None])[:, 0]
    rows = torch.arange(B, device=logits.device)
    idx = best * _BLOCK + blocks[rows, best].argmax(-1)
    if main < V:  # the columns past the last whole block win only when strictly larger
        tail = logits[:, main:]
        t_top, t_idx = tail.max(-1)
        idx = torch.where(t_top > top, main + t_idx, idx)
        top = torch.maximum(top, t_top)
    if bool(torch.isnan(top).any()):
        return logits.argmax(-1)
    return idx


def sample_next(logits: torch.Tensor, *, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens (B,) int64 from logits (B, V): argmax, or a sample after temperature, top-k, top-p."""
    logits = logits.float()
    if not do_sample:
        return greedy(logits)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_sampling(do_sample, temperature, top_k, top_p) -> None:
    if not do_sample:
        return
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"generate: temperature must be > 0 when sampling, got {temperature!r}; use "
                         f"do_sample=False for greedy decoding")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"generate: top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must lie in (0, 1], got {top_p!r}")


def check_token_ids(input_ids: torch.Tensor, pad_token_id, vocab_size: int | None) -> None:
    """Token ids of a ``generate`` call inside the vocabulary (``vocab_size`` None: only non-negative), up front,
    before any work is done."""
    if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool) or pad_token_id < 0 or (
            vocab_size is not None and pad_token_id >= vocab_size):
        limit = f" < vocab_size {vocab_size}" if vocab_size is not None else ""
        raise ValueError(f"generate: pad_token_id must be an int >= 0{limit}, got {pad_token_id!r}; finished rows "
                         "emit it")
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            raise ValueError(f"generate: input_ids hold token ids in [{lo}, {hi}] but the vocabulary is 0 .. "
                             f"{'?' if vocab_size is None else vocab_size - 1}; tokenize with the model's tokenizer")


def _vocab_size(model) -> int | None:
    """The model config's ``vocab_size`` (qkv and HF models carry one), else None."""
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    return v if isinstance(v, int) else None


def _stop_set(eos_token_id) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) for i in ids):
        raise TypeError(f"generate: eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    return torch.tensor(ids, dtype=torch.int64)


def logits_of(output) -> torch.Tensor:
    """The logits a :class:`qkv.cache.DecoderModel` returned: the tensor itself, or its output's ``.logits``
    (:class:`qkv.nn.DecoderOutput`)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def forward_step(model, cache, ids: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False
                 ) -> torch.Tensor:
    """One forward pass over new columns; announces them to the cache first (``cache.prepare``: paged
    allocation). Returns the logits. ``last_only``: the model may compute logits for the last column only
    (``logits_to_keep=1`` where its ``forward`` takes it)."""
    if cache is not None:
        cache.prepare(ids, positions)
    if last_only and ids.shape[1] > 1 and _takes_logits_to_keep(model):  # an optimized model's call is a step
        return logits_of(model(ids, positions=positions, cache=cache, logits_to_keep=1))
    return logits_of(model(ids, positions=positions, cache=cache))


def last_logits(model, cache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`forward_step` over new columns; the logits (B, V) of the last one (the model computes only those
    where it can)."""
    return forward_step(model, cache, ids, positions, last_only=True)[:, -1]


@runtime_checkable
class GreedyDecoder(Protocol):
    """A model that gives its greedy next tokens (B,) after the last column of a step without handing out logits
    (``qkv.nn.DecoderLM.next_tokens``, which may screen its head: :mod:`qkv.cpu.greedy`)."""

    def next_tokens(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                    cache=None) -> torch.Tensor: ...


def last_tokens(model, cache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Greedy tokens (B,) int64 after the last of the new columns: the model's own ``next_tokens``
    (:class:`GreedyDecoder`), else :func:`greedy` of :func:`last_logits`. Announces the columns to the cache first,
    as :func:`forward_step` does."""
    if isinstance(model, GreedyDecoder):
        if cache is not None:
            cache.prepare(ids, positions)
        with cpu_step(model):  # not a call of the model: its step hooks do not run
            return model.next_tokens(ids, positions=positions, cache=cache)
    return greedy(last_logits(model, cache, ids, positions).float())


def _takes_logits_to_keep(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature (a C extension): don't guess
        return False


def prefill(model, cache, ids: torch.Tensor, positions: torch.Tensor, chunk: int | None,
            step: Callable = last_logits) -> torch.Tensor:
    """Run the prompt through the model (in chunks of ``chunk`` columns); what ``step`` gives for the last chunk:
    by default the logits (B, V) of the last column (only those computed where the model allows it,
    ``logits_to_keep``), or with ``step=last_tokens`` the greedy tokens (B,)."""
    N = ids.shape[1]
    width = N if not chunk else chunk
    last = None
    for a in range(0, N, width):
        last = step(model, cache, ids[:, a:a + width], positions[:, a:a + width])
    return last


def _remaining_prompt(ids, positions, hits, pad_token_id):
    """Left-padded prompt columns each row still has to prefill after ``hits`` reused tokens."""
    rows = [(ids[b][positions[b] >= 0][h:], torch.arange(h, h + int((positions[b] >= 0).sum()) - h))
            for b, h in enumerate(hits.tolist())]
    width = max(r[0].numel() for r in rows)
    out_ids = torch.full((len(rows), width), pad_token_id, dtype=ids.dtype, device=ids.device)
    out_pos = torch.full((len(rows), width), -1, dtype=torch.int64, device=ids.device)
    for b, (r_ids, r_pos) in enumerate(rows):
        n = r_ids.numel()
        if n:
            out_ids[b, width - n:] = r_ids
            out_pos[b, width - n:] = r_pos.to(ids.device)
    return out_ids, out_pos


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, *, max_new_tokens: int | None = None, cache=None, use_cache: bool = True,
             attention_mask: torch.Tensor | None = None, do_sample: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int = 0,
             streamer: Streamer | None = None, prefill_chunk_size: int | None = None,
             return_logits: bool = False, salt=None, optimize: bool = True,
             batch_invariant: bool = False, params: SamplingParams | None = None) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens per row.

    The steps: check the arguments (before any work), set up the cache and reuse cached prompt prefixes,
    prefill the rest of the prompts, decode token by token, assemble the output.

    Args:
        model: a :class:`qkv.cache.DecoderModel` (``forward(ids, positions=, cache=)`` and ``cache_specs()``).
        input_ids: (B, N) int64 prompts, left-padded.
        max_new_tokens: tokens to generate per row (fewer when every row stops early); with ``params``, its
            ``max_tokens``.
        cache: a fresh :class:`qkv.cache.KVCache` (or any cache of the protocol); default: a dynamic cache
            built from ``model.cache_specs()``. A reused paged cache must be ``reset()`` first.
        use_cache: ``False`` recomputes the whole sequence every step (the reference for caches).
        attention_mask: (B, N) 1 for real tokens, 0 for left padding; default all ones.
        do_sample, temperature, top_k, top_p, generator: sampling (greedy when ``do_sample=False``).
        eos_token_id: a stop token or a list of them; finished rows then emit ``pad_token_id``.
        streamer: ``streamer(tokens)`` called after every step with that step's tokens (B,).
        prefill_chunk_size: prefill the prompt in chunks of this many columns.
        return_logits: keep the (B, T, V) logits each token was chosen from.
        salt: prefix-cache salt (bytes/str, or one per row) isolating tenants.
        optimize: give an ``nn.Module`` model on the CPU qkv's CPU products first, once
            (:func:`qkv.cpu.optimize`, in place: the same parameters and ``state_dict``; skipped when the
            model already has them). False leaves the model as it is.
        batch_invariant: each row's tokens and logits are bitwise the same alone and inside any batch. CPU GEMMs
            (``F.linear``, ``q @ k.T``) change a row's bits with the number of rows, so the rows are decoded one
            at a time, each without its padding, in a cache of its own: the row-wise path, about ``B`` times the
            cost of a batched decode step. Greedy only (sampling draws would depend on the row order); takes no
            ``cache`` or ``streamer``. A row that stops early has NaN logits for the steps after its stop.
        params: a :class:`qkv.models.SamplingParams`, as :meth:`qkv.models.Engine.add` takes it, instead of
            ``max_new_tokens``, ``do_sample``/``temperature``/``top_k``/``top_p``/``generator`` and
            ``eos_token_id`` (its ``stop_token_ids``): min-p, penalties and a seed too, each row with a generator of
            its own seeded with ``params.seed``, so a row's tokens equal the Engine's for the same request. Stop
            strings and logprobs need the Engine (text and per-token records).

    Returns:
        :class:`GenerateOutput`.
    """
    if params is not None:
        _check_params(params, max_new_tokens, do_sample, temperature, top_k, top_p, generator, eos_token_id,
                      batch_invariant)
        max_new_tokens, eos_token_id = params.max_tokens, list(params.stop_token_ids) or None
    elif max_new_tokens is None:
        raise TypeError("generate: give max_new_tokens, or params=SamplingParams(max_tokens=...)")
    positions, stops = _check_arguments(model, input_ids, max_new_tokens, attention_mask, prefill_chunk_size,
                                        do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id)
    if not isinstance(optimize, bool):
        raise TypeError(f"generate: optimize must be True or False, got {optimize!r}")
    if (optimize and isinstance(model, torch.nn.Module) and optimized(model) is None
            and all(p.device.type == "cpu" for p in model.parameters())):
        cpu_optimize(model)
    if batch_invariant is not False:
        return _row_by_row(model, input_ids, positions, batch_invariant=batch_invariant, cache=cache,
                           use_cache=use_cache, do_sample=do_sample, streamer=streamer, salt=salt,
                           max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                           prefill_chunk_size=prefill_chunk_size, return_logits=return_logits)
    B = input_ids.shape[0]
    # greedy without logits to return: the model's own next tokens where it gives them (a screened head)
    tokens_only = (not do_sample and not return_logits and isinstance(model, GreedyDecoder)
                   and (params is None or not params.needs_logits))
    step = last_tokens if tokens_only else last_logits
    if use_cache:
        cache, hits = _open_cache(model, cache, input_ids, positions, salt)
        logits = _prefill_rest(model, cache, input_ids, positions, hits, pad_token_id, prefill_chunk_size, step)
    else:
        cache, hits = None, torch.zeros(B, dtype=torch.int64)
        logits = step(model, None, input_ids, positions)
    if not tokens_only and pad_token_id >= logits.shape[-1]:  # a model without a config: its logits tell it
        raise ValueError(f"generate: pad_token_id {pad_token_id} is outside the model's vocabulary of "
                         f"{logits.shape[-1]} tokens")

    row_pick = None if params is None or tokens_only else _row_samplers(params, input_ids, positions, stops,
                                                                        pad_token_id, _vocab_size(model))

    def pick(step_logits: torch.Tensor) -> torch.Tensor:
        if tokens_only:
            return step_logits  # already the tokens
        if row_pick is not None:
            return row_pick(step_logits)
        return sample_next(step_logits, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                           generator=generator)

    new_tokens, kept_logits, finished = _decode(model, cache, input_ids, positions, logits, pick, step,
                                                max_new_tokens=max_new_tokens, stops=stops,
                                                pad_token_id=pad_token_id, streamer=streamer,
                                                keep_logits=return_logits)
    return _assemble(input_ids, new_tokens, kept_logits if return_logits else None, finished, hits, cache)


def _check_params(params, max_new_tokens, do_sample, temperature, top_k, top_p, generator, eos_token_id,
                  batch_invariant) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"generate: params must be a qkv.models.SamplingParams, got {type(params).__name__}")
    given = [name for name, value, default in (
        ("max_new_tokens", max_new_tokens, None), ("do_sample", do_sample, False), ("temperature", temperature, 1.0),
        ("top_k", top_k, None), ("top_p", top_p, None), ("generator", generator, None),
        ("eos_token_id", eos_token_id, None), ("batch_invariant", batch_invariant, False)) if value != default]
    if given:
        raise ValueError(f"generate: params=SamplingParams(...) replaces {', '.join(given)}; pass them inside params "
                         f"(max_tokens, temperature, top_k, top_p, seed, stop_token_ids)")
    if params.stop:
        raise ValueError(f"generate: stop strings {list(params.stop)} need text; generate works on token ids. Use "
                         f"stop_token_ids, or qkv.models.Engine(model, tokenizer=...) for stop strings")
    if params.logprobs is not None:
        raise ValueError("generate: logprobs are per-token records of qkv.models.Engine; here pass "
                         "return_logits=True and take log_softmax of GenerateOutput.logits")


def _row_samplers(params: SamplingParams, input_ids: torch.Tensor, positions: torch.Tensor,
                  stops: torch.Tensor | None, pad_token_id: int, vocab_size: int | None
                  ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``pick`` for ``generate(params=...)``: each row a :class:`qkv.models.sampling.RequestSampler` of its own (its
    prompt for the penalties, its own seeded generator); a row that emitted a stop token draws no more."""
    prompts = [input_ids[b][positions[b] >= 0].tolist() for b in range(input_ids.shape[0])]
    vocab = [vocab_size]
    stop_ids = set() if stops is None else set(stops.tolist())
    samplers: list[RequestSampler] = []
    done = [False] * len(prompts)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if not samplers:  # the config's vocabulary (the Engine's), else the logits' width
            vocab[0] = vocab[0] or logits.shape[-1]
            samplers.extend(RequestSampler(params, prompt_ids=p, vocab_size=vocab[0], device=logits.device)
                            for p in prompts)
        out = []
        for b, sampler in enumerate(samplers):
            if done[b]:
                out.append(pad_token_id)
                continue
            token = sampler.choose(logits[b, :vocab[0]])[0]
            done[b] = token in stop_ids
            out.append(token)
        return torch.tensor(out, dtype=torch.int64, device=logits.device)

    return pick


def _row_by_row(model, input_ids: torch.Tensor, positions: torch.Tensor, *, batch_invariant, cache, use_cache,
                do_sample, streamer, salt, max_new_tokens, eos_token_id, pad_token_id, prefill_chunk_size,
                return_logits) -> GenerateOutput:
    """``generate(..., batch_invariant=True)``: every row decoded alone from its unpadded prompt, then assembled
    as the batched call would (left padding kept, ``pad_token_id`` after a row stops)."""
    if batch_invariant is not True:
        raise TypeError(f"generate: batch_invariant must be True or False, got {batch_invariant!r}")
    for name, value in (("cache", cache), ("streamer", streamer), ("salt", salt)):
        if value is not None:
            raise ValueError(f"generate: batch_invariant=True decodes each row alone in a cache of its own and "
                             f"takes no {name}; pass {name}=None")
    if do_sample:
        raise ValueError("generate: batch_invariant=True is greedy only (sampling draws would depend on the row "
                         "order); pass do_sample=False, or call generate per row with a generator each")
    B = input_ids.shape[0]
    rows = []
    for b in range(B):
        real = positions[b] >= 0
        rows.append(generate(model, input_ids[b][real].view(1, -1), max_new_tokens=max_new_tokens,
                             use_cache=use_cache, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                             prefill_chunk_size=prefill_chunk_size, return_logits=return_logits))
    T = max(r.new_tokens.shape[1] for r in rows)
    new = input_ids.new_full((B, T), pad_token_id)
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    logits = None
    if return_logits:
        V = rows[0].logits.shape[-1]
        logits = torch.full((B, T, V), float("nan"), dtype=rows[0].logits.dtype, device=rows[0].logits.device)
    for b, r in enumerate(rows):
        t = r.new_tokens.shape[1]
        new[b, :t] = r.new_tokens[0]
        finished[b] = r.finished[0]
        if logits is not None:
            logits[b, :t] = r.logits[0]
    return GenerateOutput(sequences=torch.cat([input_ids, new], dim=1), new_tokens=new, logits=logits,
                          finished=finished, prefix_hits=torch.zeros(B, dtype=torch.int64), cache=None)


def _check_arguments(model, input_ids, max_new_tokens, attention_mask, prefill_chunk_size, do_sample, temperature,
                     top_k, top_p, eos_token_id, pad_token_id) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 1: every argument checked before any work is done. Returns the prompt positions (B, N) and the
    stop tokens (None without any) on ``input_ids``' device."""
    if (why := decoder_model_problem(model)) is not None:
        raise TypeError(f"generate(model): expected a qkv.cache.DecoderModel, got {type(model).__name__}: {why}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        seen = f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} {tuple(getattr(input_ids, 'shape', ()))}"
        raise ValueError(f"generate: input_ids must be an integer tensor (B, N), got {seen}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if prefill_chunk_size is not None and (not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
        raise ValueError(f"generate: prefill_chunk_size must be a positive int or None, got {prefill_chunk_size!r}")
    _check_sampling(do_sample, temperature, top_k, top_p)
    check_token_ids(input_ids, pad_token_id, _vocab_size(model))
    B, N = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != (B, N):
        raise ValueError(f"generate: attention_mask must match input_ids {(B, N)}, got {tuple(attention_mask.shape)}")
    positions = prompt_positions(attention_mask.to(device))
    stops = _stop_set(eos_token_id)
    return positions, None if stops is None else stops.to(device)


def _open_cache(model, cache, input_ids: torch.Tensor, positions: torch.Tensor, salt):
    """Step 2: the cache to decode with (a new dynamic one by default; a given one must be empty) and, with
    prefix caching, each row's reused prompt tokens (B,) int64: blocks indexed by earlier requests or written
    by a longer row of this batch (``cache.match_prefix``)."""
    if cache is None:
        from ..cache import KVCache
        cache = KVCache(model.cache_specs())
    if cache.seq_length:
        raise ValueError(f"generate: the cache already holds {cache.seq_length} tokens; pass a fresh cache "
                         f"(cache.reset() keeps a paged cache's prefix index)")
    if cache.prefix_caching:
        if not isinstance(cache, PrefixMatchingCache):
            raise TypeError(f"generate: {type(cache).__name__} says prefix_caching=True but has no match_prefix "
                            f"(qkv.cache.PrefixMatchingCache); implement it or report prefix_caching=False")
        return cache, cache.match_prefix(input_ids, positions, salt=salt)
    return cache, torch.zeros(input_ids.shape[0], dtype=torch.int64)


def _prefill_rest(model, cache, input_ids: torch.Tensor, positions: torch.Tensor, hits: torch.Tensor,
                  pad_token_id: int, chunk: int | None, step: Callable = last_logits) -> torch.Tensor:
    """Step 3: prefill what the cache does not hold yet, each row's remaining prompt right-aligned (so a block
    shared with a longer row is written no later than its first reader); logits (B, V) of the last column."""
    if bool(hits.any()):
        run_ids, run_pos = _remaining_prompt(input_ids, positions, hits, pad_token_id)
    else:
        run_ids, run_pos = input_ids, positions
    return prefill(model, cache, run_ids, run_pos, chunk, step)


def _decode(model, cache, input_ids: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor,
            pick: Callable[[torch.Tensor], torch.Tensor], step: Callable = last_logits, *, max_new_tokens: int,
            stops: torch.Tensor | None,
            pad_token_id: int, streamer: Streamer | None, keep_logits: bool
            ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Step 4: the decode loop from the prefill's last logits (B, V), or its tokens (B,) where ``step`` is
    :func:`last_tokens` (``pick`` then passes them on). A finished row emits ``pad_token_id`` at position -1.
    Without a cache, each step recomputes the whole sequence. Returns the tokens (B,) and, when ``keep_logits``,
    the float32 logits (B, V) of every step, and the finished rows (B,) bool."""
    B, device = input_ids.shape[0], input_ids.device
    seq_ids, seq_pos = input_ids, positions
    next_pos = positions.max(dim=1).values + 1  # (B,)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    new_tokens, kept_logits = [], []
    for t in range(max_new_tokens):
        tok = pick(logits).to(device)
        tok = torch.where(finished, torch.full_like(tok, pad_token_id), tok)
        if keep_logits:
            kept_logits.append(logits.float())
        new_tokens.append(tok)
        if streamer is not None:
            streamer(tok)
        step_pos = torch.where(finished, torch.full_like(next_pos, -1), next_pos)
        if stops is not None:
            finished = finished | torch.isin(tok, stops)
        if t == max_new_tokens - 1 or bool(finished.all()):
            break
        if cache is not None:
            logits = step(model, cache, tok.view(B, 1), step_pos.view(B, 1))
        else:
            seq_ids = torch.cat([seq_ids, tok.view(B, 1)], dim=1)
            seq_pos = torch.cat([seq_pos, step_pos.view(B, 1)], dim=1)
            logits = step(model, None, seq_ids, seq_pos)
        next_pos = next_pos + 1
    return new_tokens, kept_logits, finished


def _assemble(input_ids: torch.Tensor, new_tokens: list[torch.Tensor], kept_logits: list[torch.Tensor] | None,
              finished: torch.Tensor, hits: torch.Tensor, cache) -> GenerateOutput:
    """Step 5: stack the steps into a :class:`GenerateOutput`."""
    B = input_ids.shape[0]
    gen = torch.stack(new_tokens, dim=1) if new_tokens else input_ids.new_zeros(B, 0)
    return GenerateOutput(
        sequences=torch.cat([input_ids, gen], dim=1),
        new_tokens=gen,
        logits=torch.stack(kept_logits, dim=1) if kept_logits else None,
        finished=finished,
        prefix_hits=hits,
        cache=cache,
    )
