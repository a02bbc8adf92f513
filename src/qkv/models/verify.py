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
- ``prefix``: for paged caches with prefix caching, run the batch, ``reset()``, then run prompts that
  share the prefix: the second run must hit the prefix cache and still match.

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
        err = float((cand.double() - ref).abs().max()) if cand.numel() else 0.0
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
        device = _device_of(model)
        zero = torch.zeros(1, 1, dtype=torch.int64, device=device)
        vocab = logits_of(model(zero, positions=zero, cache=None)).shape[-1]
        g = torch.Generator().manual_seed(seed)
        N = max(prompt_lengths)
        input_ids = torch.randint(0, vocab, (len(prompt_lengths), N), generator=g).to(device)
        attention_mask = torch.zeros_like(input_ids)
        for b, n in enumerate(prompt_lengths):
            attention_mask[b, N - n:] = 1
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    pos = prompt_positions(attention_mask)
    B, N = input_ids.shape
    reference = _Reference(model)
    checks: list[CheckResult] = []
    kw = dict(tolerance=tolerance, k=k, floor=floor)

    def run(check: str, fn) -> None:
        try:
            checks.append(fn())
        except Exception as e:  # a check that raises fails with the reason, the others still run
            checks.append(CheckResult(check, False, float("inf"), 0.0, None, f"{type(e).__name__}: {e}"))

    # decode: (chunked) prefill + greedy decoding against recomputation of the same sequence.
    state = {}

    def decode() -> CheckResult:
        cache = cache_factory()
        out = generate(model, input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, cache=cache,
                       prefill_chunk_size=prefill_chunk_size, return_logits=True)
        seq_pos = _positions_of(out.sequences, pos)
        ref, base = reference.logits(out.sequences, seq_pos)
        cols = slice(N - 1, N - 1 + max_new_tokens)
        state.update(cache=cache, seq=out.sequences, seq_pos=seq_pos, ref=ref, base=base)
        return _compare("decode", out.logits, ref[:, cols], base[:, cols], tokens=out.new_tokens, **kw,
                        detail=f"B={B} prompts {attention_mask.sum(1).tolist()} chunk={prefill_chunk_size}")

    run("decode", decode)

    def crop_check() -> CheckResult:
        cache, seq, seq_pos = state["cache"], state["seq"], state["seq_pos"]
        L = seq.shape[1] - 1  # the last generated token was never fed
        cache.crop(-crop)
        logits = forward_step(model, cache, seq[:, L - crop:L], seq_pos[:, L - crop:L])
        cols = slice(L - crop, L)
        return _compare("crop", logits, state["ref"][:, cols], state["base"][:, cols], **kw,
                        detail=f"rolled back {crop}, re-fed them in one step")

    if crop and "cache" in state:
        run("crop", crop_check)

    def fork_check() -> CheckResult:
        cache = cache_factory()
        logits = prefill(model, cache, input_ids, pos, prefill_chunk_size)
        cache.fork(2)
        rows_ids = input_ids.repeat_interleave(2, dim=0)
        rows_pos = pos.repeat_interleave(2, dim=0)
        logits = logits.repeat_interleave(2, dim=0)
        nxt = rows_pos.max(1).values + 1
        got, toks = [], []
        for _ in range(max_new_tokens):
            top2 = logits.topk(2, dim=-1).indices  # copy 0 greedy, copy 1 runner-up: the copies diverge
            tok = torch.where(torch.arange(2 * B, device=top2.device) % 2 == 0, top2[:, 0], top2[:, 1])
            got.append(logits)
            toks.append(tok)
            logits = forward_step(model, cache, tok.view(-1, 1), nxt.view(-1, 1))[:, -1]
            nxt = nxt + 1
        seq = torch.cat([rows_ids, torch.stack(toks, 1)], dim=1)
        ref, base = reference.logits(seq, _positions_of(seq, rows_pos))
        cols = slice(N - 1, N - 1 + max_new_tokens)
        return _compare("fork", torch.stack(got, 1), ref[:, cols], base[:, cols], **kw,
                        detail="fork(2), copies take different tokens")

    if fork:
        run("fork", fork_check)

    def prefix_check() -> CheckResult:
        cache = cache_factory()
        generate(model, input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, cache=cache)
        cache.reset()
        # Same prompts with a different last token: every full block before it can be reused.
        ids2 = input_ids.clone()
        ids2[:, -1] = (ids2[:, -1] + 1) % int(state["ref"].shape[-1]) if "ref" in state else ids2[:, -1]
        out = generate(model, ids2, attention_mask=attention_mask, max_new_tokens=max_new_tokens, cache=cache,
                       prefill_chunk_size=prefill_chunk_size, return_logits=True)
        ref, base = reference.logits(out.sequences, _positions_of(out.sequences, pos))
        cols = slice(N - 1, N - 1 + max_new_tokens)
        res = _compare("prefix", out.logits, ref[:, cols], base[:, cols], tokens=out.new_tokens, **kw,
                       detail=f"reused {out.prefix_hits.tolist()} prompt tokens")
        if not bool(out.prefix_hits.any()):
            res = res._replace(ok=False, detail=res.detail + "; expected a prefix-cache hit")
        return res

    probe_cache = cache_factory()
    if prefix and getattr(getattr(probe_cache, "storage", None), "prefix_caching", False):
        run("prefix", prefix_check)

    report = VerifyReport(all(c.ok for c in checks), tuple(checks))
    if raise_on_failure and not report.ok:
        raise AssertionError(str(report))
    return report
