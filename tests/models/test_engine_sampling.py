"""``SamplingParams`` and sampled requests: each filter's draws follow the exact distribution (chi-square on a small
vocabulary against a numpy float64 reference written here, independent of ``qkv.models.sampling``), a seeded request
gives the same tokens alone, in other batches and through ``generate``, greedy requests keep ``generate``'s tokens,
logprobs equal a full recompute's, and bad parameters are refused naming the field."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from _toy_lm import peaked_decoder, single_thread  # noqa: F401 (autouse fixture)
from qkv.models import Engine, SamplingParams, TokenLogprobs, generate
from qkv.models.sampling import RequestSampler, draw, process_logits
from qkv.nn import DecoderLM

VOCAB = 97
ALPHA = 1e-4  # a correct sampler fails one case in 10,000
DRAWS = 20_000


def _lm(seed: int = 0, **fields) -> DecoderLM:
    return peaked_decoder(seed, fields.pop("vocab_size", VOCAB), **fields)


def _reference_probs(logits: np.ndarray, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition=1.0,
                     seen=None, frequency=0.0, presence=0.0, counts=None) -> np.ndarray:
    """vLLM's order, spelled out in float64 numpy: penalties, temperature, min-p, top-k, top-p, softmax."""
    x = logits.astype(np.float64).copy()
    if seen is not None:
        x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    if counts is not None:
        x -= frequency * counts + presence * (counts > 0)
    x = x / temperature
    keep = np.ones_like(x, dtype=bool)
    p = np.exp(x - x.max())
    p /= p.sum()
    keep &= p >= min_p * p.max()
    if top_k > 0:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        mass_before = np.cumsum(q[order]) - q[order]
        nucleus = np.zeros_like(keep)
        nucleus[order[mass_before < top_p]] = True
        keep &= nucleus
    out = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return out / out.sum()


# softmax of these: 0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02 (then a long tail-free vocabulary of 7 tokens)
_PROBS = np.array([0.25, 0.40, 0.02, 0.15, 0.05, 0.10, 0.03])
_LOGITS = np.log(_PROBS) + 0.5
_SEEN = np.array([False, True, False, True, False, False, True])
_COUNTS = np.array([0, 2, 0, 1, 0, 0, 3])

CASES = {
    "plain": dict(),
    "temperature0.6": dict(temperature=0.6),
    "temperature1.7": dict(temperature=1.7),
    "top_k3": dict(top_k=3),
    "top_k1": dict(top_k=1),
    "top_p0.7": dict(top_p=0.7),  # keeps 0.40, 0.25, 0.15 (mass before the 0.10 token: 0.80)
    "top_p0.66": dict(top_p=0.66),  # keeps 0.40, 0.25, 0.15 (mass before 0.15: 0.65 < 0.66)
    "top_p0.65": dict(top_p=0.65),  # keeps 0.40, 0.25 only (mass before 0.15: 0.65, reached)
    "min_p0.3": dict(min_p=0.3),  # keeps tokens >= 0.12: 0.40, 0.25, 0.15
    "repetition1.5": dict(repetition_penalty=1.5),
    "frequency0.4-presence0.3": dict(frequency_penalty=0.4, presence_penalty=0.3),
    "all-T0.8-k4-p0.9-minp0.1-rep1.2-freq0.2": dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.1,
                                                    repetition_penalty=1.2, frequency_penalty=0.2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_exact_distribution_after_each_filter(case):
    from scipy.stats import chisquare

    kw = CASES[case]
    params = SamplingParams(**kw)
    want = _reference_probs(_LOGITS, temperature=kw.get("temperature", 1.0), top_k=kw.get("top_k", 0),
                            top_p=kw.get("top_p", 1.0), min_p=kw.get("min_p", 0.0),
                            repetition=kw.get("repetition_penalty", 1.0), seen=_SEEN,
                            frequency=kw.get("frequency_penalty", 0.0), presence=kw.get("presence_penalty", 0.0),
                            counts=_COUNTS)
    x = process_logits(torch.tensor(_LOGITS), params, seen=torch.tensor(_SEEN), counts=torch.tensor(_COUNTS))
    gen = torch.Generator().manual_seed(1234)
    seen = np.bincount([draw(x, gen) for _ in range(DRAWS)], minlength=len(_LOGITS))
    kept = want > 0
    assert (seen[~kept] == 0).all(), f"{case}: drew filtered tokens {np.nonzero(seen * ~kept)[0]} (want {want})"
    if kept.sum() > 1:
        p = chisquare(seen[kept], DRAWS * want[kept]).pvalue
        assert p > ALPHA, f"{case}: draws {seen} against expected {np.round(DRAWS * want, 1)}, p = {p:.2e}"
    assert torch.allclose(torch.softmax(x, -1), torch.tensor(want), atol=1e-12)


def test_a_planted_off_by_one_in_top_p_or_top_k_fails(monkeypatch):
    """The checks above catch a nucleus that keeps one token too many and a top-k that keeps k + 1."""
    from qkv.models import sampling

    real = sampling.process_logits

    def top_p_one_more(logits, params, **kw):
        if params.top_p < 1:  # keeps the token whose mass before it reaches top_p
            x = real(logits, SamplingParams(temperature=params.temperature), **kw)
            p = torch.softmax(x, -1)
            order = p.argsort(descending=True)
            before = p[order].cumsum(0) - p[order]
            n = int((before < params.top_p).sum()) + 1
            return x.scatter(0, order[n:], -math.inf)
        return real(logits, params, **kw)

    def top_k_one_more(logits, params, **kw):
        return real(logits, SamplingParams(top_k=params.top_k + 1) if params.top_k > 0 else params, **kw)

    for plant, case in ((top_p_one_more, "top_p0.7"), (top_k_one_more, "top_k3")):
        monkeypatch.setattr(sampling, "process_logits", plant)
        monkeypatch.setitem(globals(), "process_logits", plant)
        with pytest.raises(AssertionError, match="drew filtered tokens"):
            test_draws_follow_the_exact_distribution_after_each_filter(case)
        monkeypatch.undo()


def test_greedy_and_one_draw_per_token():
    logits = torch.tensor(_LOGITS)
    sampler = RequestSampler(SamplingParams(temperature=0), prompt_ids=[1], vocab_size=7)
    assert sampler.choose(logits)[0] == 1
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    draw(process_logits(logits, SamplingParams(top_k=3)), gen)
    twin = torch.Generator()
    twin.set_state(state)
    torch.rand((), generator=twin, dtype=torch.float64)
    assert torch.equal(gen.get_state(), twin.get_state()), "a draw must take exactly one uniform number"


@pytest.mark.parametrize("kw, error, match", [
    (dict(temperature=-0.5), ValueError, r"temperature must lie in \[0, inf\), got -0.5; use temperature=0"),
    (dict(temperature=float("nan")), ValueError, "temperature must lie in"),
    (dict(top_p=0), ValueError, r"top_p must lie in \(0, 1\], got 0"),
    (dict(top_p=1.5), ValueError, r"top_p must lie in \(0, 1\], got 1.5"),
    (dict(top_k=-2), ValueError, "top_k must be 0 or -1 .* or >= 1, got -2"),
    (dict(top_k=2.5), TypeError, "top_k must be an int, got float 2.5"),
    (dict(min_p=1.2), ValueError, r"min_p must lie in \[0, 1\], got 1.2"),
    (dict(repetition_penalty=0), ValueError, r"repetition_penalty must lie in \(0, inf\)"),
    (dict(presence_penalty=2.5), ValueError, r"presence_penalty must lie in \[-2, 2\]"),
    (dict(frequency_penalty=-3), ValueError, r"frequency_penalty must lie in \[-2, 2\]"),
    (dict(max_tokens=0), ValueError, "max_tokens must be an int >= 1, got 0"),
    (dict(seed=-1), ValueError, "seed must be an int >= 0 or None, got -1"),
    (dict(logprobs=-1), ValueError, "logprobs must be None or an int >= 0"),
    (dict(stop=[3]), TypeError, "stop must be a non-empty str or a sequence of them"),
    (dict(stop_token_ids=["a"]), TypeError, "stop_token_ids must be a sequence of token ids"),
])
def test_bad_sampling_params_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kw)


def test_stop_strings_without_a_tokenizer_and_mixed_arguments_are_refused():
    model = _lm()
    engine = Engine(model, num_blocks=16, block_size=4, max_batch=2)
    with pytest.raises(ValueError, match=r"stop strings \['</s>'\] need text, but this Engine has no tokenizer"):
        engine.add([1, 2], params=SamplingParams(stop="</s>"))
    with pytest.raises(ValueError, match="got params and also max_new_tokens=3"):
        engine.add([1, 2], 3, params=SamplingParams())
    with pytest.raises(TypeError, match="params must be a qkv.models.SamplingParams, got dict"):
        engine.add([1, 2], params={"temperature": 0.5})
    with pytest.raises(TypeError, match="give max_new_tokens"):
        engine.add([1, 2])
    with pytest.raises(ValueError, match=r"stop tokens must lie in the vocabulary"):
        engine.add([1, 2], params=SamplingParams(stop_token_ids=[VOCAB]))
    assert not engine.busy and engine.add([1, 2], 2) == 0  # nothing queued, no id taken
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="stop strings .* need text"):
        generate(model, ids, params=SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="logprobs are per-token records of qkv.models.Engine"):
        generate(model, ids, params=SamplingParams(logprobs=2))
    with pytest.raises(ValueError, match="replaces max_new_tokens, temperature; pass them inside params"):
        generate(model, ids, max_new_tokens=3, temperature=0.5, params=SamplingParams())
    with pytest.raises(TypeError, match="give max_new_tokens, or params"):
        generate(model, ids)


def _others(n: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 30))],
             SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0, 0.5, 1.0]), top_p=0.9,
                            seed=rng.choice([None, rng.randrange(100)]))) for _ in range(n)]


SEEDED = SamplingParams(max_tokens=14, temperature=1.3, top_k=40, top_p=0.95, min_p=0.01, seed=7,
                        repetition_penalty=1.1, frequency_penalty=0.2)
PROMPT = [5, 17, 3, 60, 22, 9, 41]


def test_a_seeded_request_gives_the_same_tokens_alone_in_any_batch_and_through_generate():
    model = _lm(3)
    alone = generate(model, torch.tensor([PROMPT]), params=SEEDED).new_tokens[0].tolist()
    assert len(set(alone)) > 3, f"the case should sample varied tokens, got {alone}"
    runs = {}
    for name, (others_before, others_after, max_batch, chunk, abort_one) in {
        "alone": (0, 0, 1, 512, False),
        "after-3": (3, 0, 2, 4, False),
        "among-6": (2, 4, 3, 5, True),
        "batch-8": (5, 2, 8, 512, True),
    }.items():
        engine = Engine(model, num_blocks=128, block_size=4, max_batch=max_batch, prefill_chunk=chunk)
        pre = [engine.add(p, params=s) for p, s in _others(others_before, 1)]
        rid = engine.add(PROMPT, params=SEEDED)
        for p, s in _others(others_after, 2):
            engine.add(p, params=s)
        if abort_one:
            engine.step()
            engine.step()
            engine.abort(pre[0])
        runs[name] = engine.run()[rid].tokens
    assert all(t == alone for t in runs.values()), f"generate alone {alone}, engine {runs}"
    other_seed = generate(model, torch.tensor([PROMPT]), params=dataclasses.replace(SEEDED, seed=8))
    assert other_seed.new_tokens[0].tolist() != alone


def test_greedy_requests_keep_generates_tokens_beside_sampled_ones():
    model = _lm(4)
    engine = Engine(model, num_blocks=128, block_size=4, max_batch=4, prefill_chunk=6)
    reqs = _others(8, 5)
    ids = [engine.add(p, params=s) for p, s in reqs]
    results = engine.run()
    greedy_seen = 0
    for (p, s), rid in zip(reqs, ids):
        if s.temperature == 0:
            greedy_seen += 1
            want = generate(model, torch.tensor([p]), max_new_tokens=s.max_tokens).new_tokens[0].tolist()
            assert results[rid].tokens == want, f"greedy request {rid}"
        elif s.seed is not None:
            want = generate(model, torch.tensor([p]), params=s).new_tokens[0].tolist()
            assert results[rid].tokens == want, f"seeded request {rid}"
    assert greedy_seen >= 2


def test_logprobs_equal_a_full_recompute():
    """The chosen token's logprob and the top-n of every step, against log_softmax of a cache-free forward over the
    prompt and the tokens so far."""
    model = _lm(6)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=4)
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3, logprobs=3)
    rid = engine.add(PROMPT, params=params)
    greedy_id = engine.add([9, 8, 7], params=SamplingParams(max_tokens=4, temperature=0, logprobs=0))
    streamed = {rid: [], greedy_id: []}
    for u in engine.stream():
        assert u.logprobs is not None and len(u.logprobs) == len(u.tokens)
        streamed[u.request_id] += u.logprobs
    results = engine.results()
    for r, prompt, n in ((rid, PROMPT, 3), (greedy_id, [9, 8, 7], 0)):
        res = results[r]
        assert res.logprobs == streamed[r] and len(res.logprobs) == len(res.tokens)
        for t, lp in enumerate(res.logprobs):
            assert isinstance(lp, TokenLogprobs) and lp.token == res.tokens[t]
            with torch.no_grad():
                full = model(torch.tensor([prompt + res.tokens[:t]])).logits[0, -1]
            ref = torch.log_softmax(full.double(), -1)
            assert abs(lp.logprob - float(ref[lp.token])) < 1e-9
            vals, idx = ref.topk(n)
            assert [i for i, _ in lp.top] == idx.tolist()
            assert np.allclose([v for _, v in lp.top], vals.tolist(), atol=1e-9, rtol=0)
        if n == 0:
            assert all(lp.top == () for lp in res.logprobs)
            assert res.tokens == generate(model, torch.tensor([prompt]), max_new_tokens=4).new_tokens[0].tolist()


def test_request_sampler_refuses_bad_input():
    with pytest.raises(TypeError, match="params must be a qkv.models.SamplingParams, got dict"):
        RequestSampler({"temperature": 1.0}, prompt_ids=[1], vocab_size=7)
    sampler = RequestSampler(SamplingParams(), prompt_ids=[1], vocab_size=7)
    with pytest.raises(ValueError, match=r"logits must be \(V,\) with V >= 7, got \(1, 7\)"):
        sampler.choose(torch.zeros(1, 7))
    with pytest.raises(ValueError, match=r"logits must be \(V,\) with V >= 7, got \(5,\)"):
        sampler.choose(torch.zeros(5))
    engine = Engine(_lm(), num_blocks=16, block_size=4, max_batch=2)
    for bad in (-1, "0", True, 0):
        with pytest.raises(ValueError, match=r"is not a request id of this Engine \(no request was added yet\)"):
            engine.abort(bad)
