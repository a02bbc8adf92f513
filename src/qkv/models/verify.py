"""``verify_cache``: cached decoding must equal full recomputation.

For a :class:`qkv.cache.DecoderModel` and a factory of fresh caches it runs, on a left-padded batch of
prompts of different lengths:

- ``decode``: (chunked) prefill then greedy decoding with the cache; every step's logits against a
  full recomputation of the same sequence, held to an error budget (``qkv.testing``: at most ``k``
  times the error of the same-dtype full recomputation against a float64 one, plus a floor), and the
  greedy tokens against the float64 recomputation's argmax;
- ``crop``: roll back the last ``crop`` tokens (speculative decoding) and feed them again in one
  multi-token step;
- ``fork``: after prefill, ``cache.fork(2)``; one copy of each row follows the greedy token, the other
  the runner-up, so the copies diverge (copy-on-write under paged storage); each against its own
  recomputation;
- ``prefix``: for paged caches with prefix caching, run the batch with every prompt twice (the second
  copy reuses the blocks the first writes in the same prefill, and must match), ``reset()``, then run
  prompts that share the prefix: the second run must hit the prefix cache, as much as the copies did
  within the batch, and still match.

A lossy cache (quantized, evicting) passes ``tolerance=``: the largest absolute logit error allowed
(it replaces the budget and tokens are reported, not required, to match).

Example:
    >>> from qkv.cache import KVCache, Paged
    >>> from qkv.models.verify import verify_cache
    >>> from qkv.nn import DecoderLM, get_config
    >>> lm = DecoderLM(get_config("tiny-mistral")).eval()
    >>> report = verify_cache(lm, lambda: KVCache(lm, storage=Paged(block_size=4, num_blocks=64, prefix_caching=True)))
    >>> [c.name for c in report.checks], report.ok
    (['decode', 'crop', 'fork', 'prefix'], True)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..cache.protocol import CroppableCache, ForkableCache, ResettableCache
from ..testing import budget as _budget
from .generate import forward_step, generate, logits_of, prefill, prompt_positions

__all__ = ["verify_cache", "VerifyReport", "CheckResult"]


class CheckResult(NamedTuple):
    name: str
    ok: bool
    max_error: float
    allowed: float
    tokens_match: bool | None
    detail: str = ""


class VerifyReport(NamedTuple):
    ok: bool
    checks: tuple[CheckResult, ...]

    def __str__(self) -> str:
        lines = ["verify_cache: " + ("PASS" if self.ok else "FAIL")]
        for c in self.checks:
            tok = "" if c.tokens_match is None else f" tokens {'equal' if c.tokens_match else 'DIFFER'}"
            lines.append(f"  {c.name:<8} {'ok ' if c.ok else 'BAD'} err {c.max_error:.3e} <= {c.allowed:.3e}?{tok}"
                         + (f"  ({c.detail})" if c.detail else ""))
        return "\n".join(lines)


def _device_of(model) -> torch.device:
    for p in getattr(model, "parameters", lambda: iter(()))():
        return p.device
    return torch.device("cpu")


class _Reference:
    """Full recomputation of any sequence, in the model's dtype and (for an ``nn.Module``) in float64: on a
    copy, or, when the model cannot be copied, by casting it to float64 and back (exact for float weights)."""

    def __init__(self, model) -> None:
        self.model = model
        self.model64 = None
        self.dtype = None
        if isinstance(model, torch.nn.Module):
            try:
                self.model64 = copy.deepcopy(model).to(torch.float64)
            except (TypeError, RuntimeError, copy.Error):
                self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        base = logits_of(self.model(ids, positions=positions, cache=None))
        if self.model64 is not None:
            return logits_of(self.model64(ids, positions=positions, cache=None)), base
        if self.dtype is None:
            return base.double(), base
        try:
            self.model.to(torch.float64)
            ref = logits_of(self.model(ids, positions=positions, cache=None))
        finally:
            self.model.to(self.dtype)
        return ref, base


def _positions_of(sequences: torch.Tensor, prompt_pos: torch.Tensor) -> torch.Tensor:
    B, N = prompt_pos.shape
    T = sequences.shape[1] - N
    gen = prompt_pos.max(1).values.view(B, 1) + 1 + torch.arange(T, device=sequences.device).view(1, T)
    return torch.cat([prompt_pos, gen], dim=1)


def _compare(name, cand, ref, base, *, tolerance, k, floor, tokens=None, detail="") -> CheckResult:
    if tolerance is not None:
        err = float((cand.detach().double() - ref).abs().max()) if cand.numel() else 0.0
        allowed = float(tolerance)
    else:
        b = _budget(cand, ref, base, k=k, floor=floor)
        err, allowed = b.candidate_error, b.allowed
    match = None
    if tokens is not None:
        match = bool(torch.equal(ref.argmax(-1), tokens))
        if not match:
            top2 = ref.topk(2, dim=-1).values
            margin = float((top2[..., 0] - top2[..., 1]).min())
            detail = (detail + "; " if detail else "") + f"smallest top-2 margin {margin:.2e}"
    ok = err <= allowed and (match is not False or tolerance is not None)
    return CheckResult(name, ok, err, allowed, match, detail)


@torch.no_grad()
def _check_factory(cache_factory) -> None:
    if not callable(cache_factory) or isinstance(cache_factory, torch.Tensor):
        raise TypeError(f"verify_cache: cache_factory must be a function returning a fresh cache, got "
                        f"{type(cache_factory).__name__}; pass e.g. lambda: KVCache(model.cache_specs())")


def verify_cache(model, cache_factory: Callable[[], object], *, input_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, prompt_lengths: tuple[int, ...] = (11, 7),
                 max_new_tokens: int = 6, prefill_chunk_size: int | None = None, crop: int = 2,
                 fork: bool = True, prefix: bool = True, tolerance: float | None = None,
                 k: float | None = None, floor: float | None = None, seed: int = 0,
                 raise_on_failure: bool = True) -> VerifyReport:
    """Check that decoding with caches from ``cache_factory`` equals full recomputation.

    Args:
        model: a :class:`qkv.cache.DecoderModel`; an ``nn.Module`` is also copied to float64 for the
            reference.
        cache_factory: ``() -> cache``, a fresh cache per call.
        input_ids, attention_mask: the prompts (left-padded); default random prompts of
            ``prompt_lengths`` tokens (one row per length) drawn with ``seed``.
        max_new_tokens: greedy steps per run.
        prefill_chunk_size: prefill in chunks of this many columns.
        crop: tokens to roll back in the crop check (0 skips it).
        fork, prefix: run those checks (prefix only applies to caches with prefix caching).
        tolerance: lossy caches: the largest absolute logit error allowed.
        k, floor: error-budget parameters (default by dtype, ``qkv.testing``).
        raise_on_failure: raise ``AssertionError`` with the report when a check fails.

    Returns:
        :class:`VerifyReport`.
    """
    _check_factory(cache_factory)
    if input_ids is None:
        input_ids, attention_mask = _random_prompts(model, prompt_lengths, seed)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    run = _Checks(model, cache_factory, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                  prefill_chunk_size=prefill_chunk_size, tolerance=tolerance, k=k, floor=floor)
    run.check("decode", run.decode)
    if crop and run.decoded is not None:
        run.check("crop", lambda: run.crop(crop))
    if fork:
        run.check("fork", run.fork)
    if prefix and cache_factory().prefix_caching:
        run.check("prefix", run.prefix)
    report = VerifyReport(all(c.ok for c in run.results), tuple(run.results))
    if raise_on_failure and not report.ok:
        raise AssertionError(str(report))
    return report


def _random_prompts(model, prompt_lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts, one row per length, over the model's vocabulary."""
    device = _device_of(model)
    zero = torch.zeros(1, 1, dtype=torch.int64, device=device)
    vocab = logits_of(model(zero, positions=zero, cache=None)).shape[-1]
    g = torch.Generator().manual_seed(seed)
    N = max(prompt_lengths)
    input_ids = torch.randint(0, vocab, (len(prompt_lengths), N), generator=g).to(device)
    attention_mask = torch.zeros_like(input_ids)
    for b, n in enumerate(prompt_lengths):
        attention_mask[b, N - n:] = 1
    return input_ids, attention_mask


def _require(cache, protocol: type, method: str, skip: str) -> None:
    if not isinstance(cache, protocol):
        raise TypeError(f"verify_cache: this check calls cache.{method}(), but {type(cache).__name__} does not follow "
                        f"qkv.cache.{protocol.__name__}; implement {method} or pass {skip} to skip the check")


class _Decoded(NamedTuple):
    cache: object
    seq: torch.Tensor
    seq_pos: torch.Tensor
    ref: torch.Tensor
    base: torch.Tensor


class _Checks:
    """The checks of one :func:`verify_cache` call, each a method returning a :class:`CheckResult`."""

    def __init__(self, model, cache_factory, input_ids, attention_mask, *, max_new_tokens, prefill_chunk_size,
                 **budget) -> None:
        self.model, self.cache_factory = model, cache_factory
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.pos = prompt_positions(attention_mask)
        self.max_new, self.chunk, self.budget = max_new_tokens, prefill_chunk_size, budget
        self.reference = _Reference(model)
        self.results: list[CheckResult] = []
        self.decoded: _Decoded | None = None
        N = input_ids.shape[1]
        self.cols = slice(N - 1, N - 1 + max_new_tokens)  # the logits each new token was chosen from

    def check(self, name: str, fn: Callable[[], CheckResult]) -> None:
        try:
            self.results.append(fn())
        except Exception as e:  # a check that raises fails with the reason, the others still run
            self.results.append(CheckResult(name, False, float("inf"), 0.0, None, f"{type(e).__name__}: {e}"))

    def decode(self) -> CheckResult:
        """(Chunked) prefill + greedy decoding against recomputation of the same sequence."""
        cache = self.cache_factory()
        out = generate(self.model, self.input_ids, attention_mask=self.attention_mask, max_new_tokens=self.max_new,
                       cache=cache, prefill_chunk_size=self.chunk, return_logits=True)
        seq_pos = _positions_of(out.sequences, self.pos)
        ref, base = self.reference.logits(out.sequences, seq_pos)
        self.decoded = _Decoded(cache, out.sequences, seq_pos, ref, base)
        return _compare("decode", out.logits, ref[:, self.cols], base[:, self.cols], tokens=out.new_tokens,
                        **self.budget, detail=f"B={self.input_ids.shape[0]} prompts "
                        f"{self.attention_mask.sum(1).tolist()} chunk={self.chunk}")

    def crop(self, n: int) -> CheckResult:
        """Roll back the last ``n`` tokens of the decode run and feed them again in one step."""
        d = self.decoded
        _require(d.cache, CroppableCache, "crop", "crop=0")
        L = d.seq.shape[1] - 1  # the last generated token was never fed
        d.cache.crop(-n)
        logits = forward_step(self.model, d.cache, d.seq[:, L - n:L], d.seq_pos[:, L - n:L])
        cols = slice(L - n, L)
        return _compare("crop", logits, d.ref[:, cols], d.base[:, cols], **self.budget,
                        detail=f"rolled back {n}, re-fed them in one step")

    def fork(self) -> CheckResult:
        """After prefill, ``fork(2)``: one copy follows the greedy token, the other the runner-up."""
        B = self.input_ids.shape[0]
        cache = self.cache_factory()
        _require(cache, ForkableCache, "fork", "fork=False")
        logits = prefill(self.model, cache, self.input_ids, self.pos, self.chunk)
        cache.fork(2)
        rows_ids = self.input_ids.repeat_interleave(2, dim=0)
        rows_pos = self.pos.repeat_interleave(2, dim=0)
        logits = logits.repeat_interleave(2, dim=0)
        nxt = rows_pos.max(1).values + 1
        got, toks = [], []
        for _ in range(self.max_new):
            top2 = logits.topk(2, dim=-1).indices  # copy 0 greedy, copy 1 runner-up: the copies diverge
            tok = torch.where(torch.arange(2 * B, device=top2.device) % 2 == 0, top2[:, 0], top2[:, 1])
            got.append(logits)
            toks.append(tok)
            logits = forward_step(self.model, cache, tok.view(-1, 1), nxt.view(-1, 1))[:, -1]
            nxt = nxt + 1
        seq = torch.cat([rows_ids, torch.stack(toks, 1)], dim=1)
        ref, base = self.reference.logits(seq, _positions_of(seq, rows_pos))
        return _compare("fork", torch.stack(got, 1), ref[:, self.cols], base[:, self.cols], **self.budget,
                        detail="fork(2), copies take different tokens")

    def prefix(self) -> CheckResult:
        """Run every prompt twice in one batch (the copies share blocks), ``reset()``, then prompts sharing every
        full block: they must hit the prefix cache."""
        cache = self.cache_factory()
        _require(cache, ResettableCache, "reset", "prefix=False")
        twice_pos = self.pos.repeat_interleave(2, dim=0)
        first = generate(self.model, self.input_ids.repeat_interleave(2, dim=0), max_new_tokens=self.max_new,
                         attention_mask=self.attention_mask.repeat_interleave(2, dim=0), cache=cache,
                         prefill_chunk_size=self.chunk, return_logits=True)
        ref, base = self.reference.logits(first.sequences, _positions_of(first.sequences, twice_pos))
        shared = _compare("prefix", first.logits, ref[:, self.cols], base[:, self.cols], tokens=first.new_tokens,
                          **self.budget, detail=f"every prompt twice in one batch, reused {first.prefix_hits.tolist()}")
        if not shared.ok:
            return shared
        cache.reset()
        ids2 = self.input_ids.clone()  # a different last token: every full block before it can be reused
        if self.decoded is not None:
            ids2[:, -1] = (ids2[:, -1] + 1) % int(self.decoded.ref.shape[-1])
        out = generate(self.model, ids2, attention_mask=self.attention_mask, max_new_tokens=self.max_new,
                       cache=cache, prefill_chunk_size=self.chunk, return_logits=True)
        ref, base = self.reference.logits(out.sequences, _positions_of(out.sequences, self.pos))
        res = _compare("prefix", out.logits, ref[:, self.cols], base[:, self.cols], tokens=out.new_tokens,
                       **self.budget, detail=f"reused {out.prefix_hits.tolist()} prompt tokens")
        if not bool(out.prefix_hits.any()):
            res = res._replace(ok=False, detail=res.detail + "; expected a prefix-cache hit")
        elif first.prefix_hits[0::2].any() or not torch.equal(first.prefix_hits[1::2], out.prefix_hits):
            res = res._replace(ok=False, detail=res.detail + f"; within one batch the second copies of the prompts "
                               f"should reuse as much, and the first copies nothing: {first.prefix_hits.tolist()}")
        return res
