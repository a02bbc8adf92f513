"""``SamplingParams``: how one request picks its tokens, in vLLM's vocabulary, shared by :class:`qkv.models.Engine`
and :func:`qkv.models.generate`.

Logit processors run in vLLM's order (its v1 sampler), on the float64 logits of one row:

1. penalties on the raw logits: ``repetition_penalty`` (Keskar et al. 2019, arXiv:1909.05858: a logit of a token seen
   in the prompt or the output is divided by the penalty when positive, multiplied when negative), then
   ``frequency_penalty`` (minus the penalty times the token's count in the output) and ``presence_penalty`` (minus
   the penalty once per token present in the output);
2. ``temperature`` (0: greedy, the argmax of the penalized logits, no filter and no draw);
3. ``min_p`` (Nguyen et al. 2024, arXiv:2407.01082: drop tokens whose probability is below ``min_p`` times the
   largest);
4. ``top_k`` (keep the ``k`` largest logits, ties at the k-th kept);
5. ``top_p`` (nucleus, Holtzman et al. 2020, arXiv:1904.09751: keep the smallest set of the largest probabilities
   whose mass reaches ``top_p``);
6. one draw from the renormalised distribution.

HF transformers applies the same processors in another order (repetition penalty, temperature, top-k, top-p,
min-p), which differs only when ``min_p`` is combined with ``top_k`` or ``top_p``.

A seeded request owns a ``torch.Generator`` seeded with its seed and draws exactly one uniform number per generated
token from it (inverse-CDF sampling), so its tokens depend on its own logits and seed only: the same alone, in any
batch, and after other requests join or leave. (Where a batch changes a row's logits in their last bits, as CPU
GEMMs of float32 models do, a draw can move only when it falls within that distance of a boundary between two
tokens' cumulative probabilities.) Logprobs (``logprobs=n``) are those of the raw logits (vLLM's
default ``raw_logprobs``): the log-softmax of the model's logits before any processor.

Example:
    >>> import torch
    >>> from qkv.models.sampling import RequestSampler, SamplingParams
    >>> params = SamplingParams(temperature=0.8, top_k=3, seed=0, max_tokens=4, logprobs=2)
    >>> sampler = RequestSampler(params, prompt_ids=[1, 2], vocab_size=10)
    >>> token, lp = sampler.choose(torch.linspace(0, 1, 10))
    >>> token in (7, 8, 9), len(lp.top)
    (True, 2)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["SamplingParams", "TokenLogprobs", "RequestSampler", "process_logits", "draw"]


def _number(name: str, value, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
            hi_open: bool = False, fix: str = "") -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"SamplingParams: {name} must be a number, got {type(value).__name__} {value!r}")
    bad = not math.isfinite(value)
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value >= hi if hi_open else value > hi
    if bad:
        low, high = "-inf" if lo is None else f"{lo:g}", "inf" if hi is None else f"{hi:g}"
        span = f"{'(' if lo_open else '['}{low}, {high}{')' if hi_open or hi is None else ']'}"
        raise ValueError(f"SamplingParams: {name} must lie in {span}, got {value!r}{fix}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (vLLM's ``SamplingParams`` names and meanings; see the module notes for the
    order the processors run in).

    Args:
        max_tokens: tokens to generate at most, an int >= 1 (vLLM's default 16).
        temperature: >= 0; 0 is greedy (the argmax), 1 the model's distribution.
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        top_k: keep the ``top_k`` largest logits; 0 or -1 keeps every token (vLLM's convention).
        min_p: in [0, 1]; drop tokens below ``min_p`` times the most likely token's probability.
        seed: an int >= 0 seeding the request's own generator; None draws from a generator seeded from torch's
            global generator (``torch.manual_seed`` makes that reproducible too, in the same order of requests).
        repetition_penalty: > 0; 1 is none. Applies to tokens of the prompt and of the output.
        presence_penalty: in [-2, 2]; subtracted once from every token present in the output.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the output.
        stop: stop strings (a str or a sequence of them; needs a tokenizer): the request ends with the token that
            completes one, and its text stops before it.
        stop_token_ids: token ids that end the request (the token is kept in its output).
        logprobs: None, or n >= 0: return the logprob of each chosen token and of the n most likely tokens.

    Refused values raise ``ValueError`` (``TypeError`` for a wrong type) naming the field, the value and the range.

    Example:
        >>> SamplingParams(temperature=0).greedy
        True
        >>> SamplingParams(top_p=0)
        Traceback (most recent call last):
        ...
        ValueError: SamplingParams: top_p must lie in (0, 1], got 0; 1 keeps every token
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"SamplingParams: {name} must be an int, got {type(v).__name__} {v!r}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens must be an int >= 1, got {self.max_tokens}")
        _number("temperature", self.temperature, lo=0.0, fix="; use temperature=0 for greedy decoding")
        _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, fix="; 1 keeps every token")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams: top_k must be 0 or -1 (keep every token) or >= 1, got {self.top_k}")
        _number("min_p", self.min_p, lo=0.0, hi=1.0, fix="; 0 keeps every token")
        _number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True, fix="; 1 is no penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name), lo=-2.0, hi=2.0, fix="; 0 is no penalty")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ValueError(f"SamplingParams: seed must be an int >= 0 or None, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < 0):
            raise ValueError(f"SamplingParams: logprobs must be None or an int >= 0 (top tokens to report besides "
                             f"the chosen one), got {self.logprobs!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = ()
        if not isinstance(stop, (Sequence, set, frozenset)) or not all(isinstance(s, str) and s for s in stop):
            raise TypeError(f"SamplingParams: stop must be a non-empty str or a sequence of them (stop strings; "
                            f"stop_token_ids takes token ids), got {self.stop!r}")
        ids = self.stop_token_ids
        ids = () if ids is None else (ids,) if isinstance(ids, int) and not isinstance(ids, bool) else ids
        if not isinstance(ids, (Sequence, set, frozenset)) or isinstance(ids, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise TypeError(f"SamplingParams: stop_token_ids must be a sequence of token ids (ints >= 0), got "
                            f"{self.stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        """True for ``temperature == 0``: the argmax, no draw."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """True when some penalty changes the logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_logits(self) -> bool:
        """True unless the request is greedy, unpenalized and asks no logprobs (then a model's screened greedy head,
        ``DecoderLM.next_tokens``, may serve it)."""
        return not self.greedy or self.penalized or self.logprobs is not None


class TokenLogprobs(NamedTuple):
    """The logprobs of one generated token, from the raw logits of its step.

    token: the chosen token id.
    logprob: its log-probability.
    top: the ``n`` most likely tokens as ``(token id, logprob)`` pairs, most likely first (``n = logprobs``).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def process_logits(logits: torch.Tensor, params: SamplingParams, *, seen: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 logits (V,) a sampled token is drawn from: penalties, temperature, min-p, top-k, top-p in that
    order (the module notes), dropped tokens at ``-inf``. For a greedy request only the penalties apply.

    Args:
        logits: (V,) one row's raw logits.
        params: the request's :class:`SamplingParams`.
        seen: (V,) bool, tokens of the prompt or the output (``repetition_penalty``); None: none.
        counts: (V,) int64, each token's count in the output (presence and frequency penalties); None: none.
    """
    x = logits.detach().to(torch.float64)
    if params.repetition_penalty != 1 and seen is not None:
        pen = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
        x = torch.where(seen, pen, x)
    if counts is not None and (params.frequency_penalty or params.presence_penalty):
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(x.dtype)
    if params.greedy:
        return x
    x = x / params.temperature
    if params.min_p > 0:
        p = torch.softmax(x, -1)
        x = x.masked_fill(p < params.min_p * p.max(), -math.inf)
    if params.top_k >= 1 and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1:
        sorted_x, order = x.sort(descending=True)
        p = torch.softmax(sorted_x, -1)
        drop = p.cumsum(-1) - p >= params.top_p  # mass before a token already reaches top_p: not needed
        drop[0] = False
        x = x.scatter(-1, order[drop], -math.inf)
    return x


def draw(logits: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``softmax(logits)`` (V,) by inverse CDF: exactly one uniform number drawn from ``generator``.
    A token at ``-inf`` is never drawn."""
    p = torch.softmax(logits.to(torch.float64), -1)
    cdf = p.cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u.to(cdf.device).view(1), right=True))
    return min(i, int(p.nonzero()[-1]))  # u * total rounds to total: the last token that has mass


class RequestSampler:
    """One request's sampling state: its parameters, its own generator and the token counts its penalties need.

    Args:
        params: the request's :class:`SamplingParams`.
        prompt_ids: the prompt's token ids (repetition penalty).
        vocab_size: the model's vocabulary V.
        device: where the logits live.
    """

    def __init__(self, params: SamplingParams, *, prompt_ids: Sequence[int], vocab_size: int,
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"RequestSampler: params must be a qkv.models.SamplingParams, got {type(params).__name__}")
        self.params, self.vocab_size = params, vocab_size
        device = torch.device(device)
        self.generator = torch.Generator(device=device)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, ()))
        self.generator.manual_seed(seed)
        self.seen = self.counts = None
        if params.penalized:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_ids:
                self.seen[torch.tensor(list(prompt_ids), dtype=torch.int64, device=device)] = True
            self.counts = torch.zeros(vocab_size, dtype=torch.int64, device=device)

    def choose(self, logits: torch.Tensor) -> tuple[int, TokenLogprobs | None]:
        """The next token from one row's raw logits (V,), and its logprobs when the request asks for them; records
        the token for the penalties."""
        if logits.dim() != 1 or logits.shape[0] < self.vocab_size:
            raise ValueError(f"RequestSampler.choose: logits must be (V,) with V >= {self.vocab_size}, got "
                             f"{tuple(logits.shape)}")
        if self.params.greedy and not self.params.penalized:  # as generate's greedy: the float32 logits' argmax
            token = int(logits.float().argmax())
        else:
            x = process_logits(logits, self.params, seen=self.seen, counts=self.counts)
            token = int(x.argmax()) if self.params.greedy else draw(x, self.generator)
        lp = None
        if self.params.logprobs is not None:
            raw = torch.log_softmax(logits.detach().to(torch.float64), -1)
            n = min(self.params.logprobs, raw.shape[0])
            vals, ids = raw.topk(n) if n else (raw[:0], raw[:0].long())
            lp = TokenLogprobs(token, float(raw[token]), tuple(zip(ids.tolist(), vals.tolist())))
        self.record(token)
        return token, lp

    def snapshot(self) -> tuple:
        """The sampler's state (its generator's and the penalties' counts), for :meth:`restore` after a failed step."""
        return (self.generator.get_state(), None if self.counts is None else self.counts.clone(),
                None if self.seen is None else self.seen.clone())

    def restore(self, state: tuple) -> None:
        """Go back to a :meth:`snapshot`: the next :meth:`choose` draws as it would have then."""
        self.generator.set_state(state[0])
        self.counts, self.seen = state[1], state[2]

    def record(self, token: int) -> None:
        """Count a token of the output (one the request emitted without :meth:`choose`)."""
        if self.counts is not None:
            self.counts[token] += 1
            self.seen[token] = True
