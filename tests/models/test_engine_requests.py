"""``Engine`` requests over their life: abort in every phase gives the blocks back at once, results stay after
streaming, finish reasons say stop / length / abort, text prompts and stop strings go through a tokenizer, and
requests admitted in the same step share their common prompt blocks."""

from __future__ import annotations

import random

import pytest
import torch

from _toy_lm import peaked_decoder, single_thread  # noqa: F401 (autouse fixture)
from qkv.models import Engine, SamplingParams, generate
from qkv.nn import DecoderLM

VOCAB = 97


def _lm(seed: int = 0, **fields) -> DecoderLM:
    return peaked_decoder(seed, fields.pop("vocab_size", VOCAB), **fields)


def _alone(model, prompt, budget):
    return generate(model, torch.tensor([prompt]), max_new_tokens=budget).new_tokens[0].tolist()


def _free(engine) -> dict[str, int]:
    return {k: s.blocks_free + s.blocks_cached_reusable for k, s in engine.cache.pool_stats().items()}


MODELS = {
    "gqa": lambda: _lm(0),
    "window": lambda: _lm(1, sliding_window=7, layer_types=("sliding_attention", "full_attention")),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("phase", ["waiting", "prefill", "decode"])
def test_abort_in_every_phase_frees_blocks_at_once(phase, name):
    model = MODELS[name]()
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=4)
    total = _free(engine)
    rng = random.Random(3)
    reqs = [([rng.randrange(1, VOCAB) for _ in range(n)], b) for n, b in ((6, 9), (23, 8), (5, 7), (9, 6))]
    ids = [engine.add(p, b) for p, b in reqs]
    victim = {"waiting": ids[3], "prefill": ids[1], "decode": ids[0]}[phase]
    engine.step()
    engine.step()
    assert (victim in engine.waiting) == (phase == "waiting")
    held = _free(engine)
    assert engine.abort(victim) is True
    after = _free(engine)
    if phase == "waiting":
        assert after == held
    else:
        assert all(after[k] > held[k] for k in held), f"abort freed nothing: {held} -> {after}"
        assert victim not in engine.running
    assert engine.abort(victim) is False  # already finished: a no-op
    results = engine.run()
    assert _free(engine) == total, "every block back in the pool"
    assert sorted(results) == ids
    assert results[victim].finish_reason == "abort"
    if phase == "decode":
        assert results[victim].tokens == _alone(model, *reqs[0])[:len(results[victim].tokens)]
        assert 1 <= len(results[victim].tokens) < reqs[0][1]
    else:
        assert results[victim].tokens == []
    for rid, (p, b) in zip(ids, reqs):
        if rid != victim:
            assert results[rid].tokens == _alone(model, p, b) and results[rid].finish_reason == "length"
    with pytest.raises(ValueError, match=r"Engine.abort: 7 is not a request id of this Engine \(ids 0 .. 3"):
        engine.abort(7)


def test_results_stay_after_streaming_and_finish_reasons():
    model = _lm(2)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=3)
    first = _alone(model, [4, 5, 6], 8)
    stop = first[2]
    a = engine.add([4, 5, 6], 8, stop=stop)
    b = engine.add([7, 8], 3)
    c = engine.add([9, 10, 11], 5)
    streamed = {}
    for u in engine.stream():
        streamed.setdefault(u.request_id, []).extend(u.tokens)
        if u.request_id == b and u.finished is None:
            engine.abort(c)
    results = engine.results()
    assert sorted(results) == [a, b, c]
    assert results[a].finish_reason == "stop" and results[a].tokens == first[:first.index(stop) + 1]
    assert results[b].finish_reason == "length" and len(results[b].tokens) == 3
    assert results[c].finish_reason == "abort" and results[c].tokens == streamed.get(c, [])
    assert engine.run() == results  # nothing left to run: the same record
    d = engine.add([1, 2], 2)
    assert sorted(engine.run()) == [a, b, c, d]
    assert sorted(engine.results(clear=True)) == [a, b, c, d] and engine.results() == {}
    e = engine.add([3, 4], 2)
    assert list(engine.run()) == [e] and engine.abort(a) is False
    with pytest.raises(TypeError, match="clear must be True or False"):
        engine.results(clear=1)


class _CharTokenizer:
    """Token id ``i`` is the character ``chr(ord('a') + i % 26)``; ids 0 and 1 are special (skipped in text)."""

    all_special_ids = [0, 1]

    def encode(self, text: str) -> list[int]:
        return [2 + (ord(ch) - ord("a")) for ch in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i in (0, 1)))


def test_text_prompts_and_stop_strings_with_a_tokenizer():
    model = _lm(5)
    tok = _CharTokenizer()
    prompt = "hello"
    ids = tok.encode(prompt)
    full = _alone(model, ids, 12)
    text = tok.decode(full, skip_special_tokens=True)
    stop = text[4:6]  # ends inside the output: the request ends at the token completing it
    cut = text.find(stop)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, tokenizer=tok)
    rid = engine.add(prompt, params=SamplingParams(max_tokens=12, temperature=0, stop=[stop, "zzzzzz"]))
    plain = engine.add(ids, 3)
    results = engine.run()
    res = results[rid]
    for n in range(1, len(full) + 1):  # the first token count whose text holds the stop string
        if stop in tok.decode(full[:n], skip_special_tokens=True):
            break
    assert res.finish_reason == "stop" and res.tokens == full[:n] and res.text == text[:cut]
    assert results[plain].text == tok.decode(full[:3], skip_special_tokens=True)
    assert results[plain].finish_reason == "length"
    with pytest.raises(TypeError, match="a text prompt needs a tokenizer"):
        Engine(model, num_blocks=8, block_size=4, max_batch=1).add("hello", 2)
    with pytest.raises(TypeError, match="tokenizer must have encode"):
        Engine(model, num_blocks=8, block_size=4, max_batch=1, tokenizer=object())


@pytest.mark.parametrize("prefill_chunk", [512, 16])
def test_requests_admitted_together_share_prompt_blocks(prefill_chunk):
    """Two requests with a 50-token common prefix added in the same step: the second attaches the first's three full
    blocks of 16 instead of computing them (48 hits), copy-on-write keeps both right."""
    model = _lm(7)
    rng = random.Random(9)
    shared = [rng.randrange(1, VOCAB) for _ in range(50)]
    prompts = [shared + [rng.randrange(1, VOCAB) for _ in range(n)] for n in (7, 3, 12)]
    prompts.append([rng.randrange(1, VOCAB) for _ in range(20)])  # no common prefix
    engine = Engine(model, num_blocks=96, block_size=16, max_batch=4, prefix_caching=True,
                    prefill_chunk=prefill_chunk)
    ids = [engine.add(p, 6) for p in prompts]
    results = engine.run()
    assert [results[r].prefix_hits for r in ids] == [0, 48, 48, 0]
    stats = engine.cache.pool_stats()["full_attention"]
    assert stats.prefix_hit_tokens == 96
    for rid, p in zip(ids, prompts):
        assert results[rid].tokens == _alone(model, p, 6), f"request {rid}"
    salted = Engine(model, num_blocks=96, block_size=16, max_batch=4, prefix_caching=True)
    a, b = salted.add(prompts[0], 2, salt="x"), salted.add(prompts[1], 2, salt="y")
    assert [salted.run()[r].prefix_hits for r in (a, b)] == [0, 0], "different salts share nothing"


def test_abort_of_a_writer_lets_its_readers_compute():
    model = _lm(8)
    shared = list(range(1, 41))
    engine = Engine(model, num_blocks=96, block_size=8, max_batch=3, prefix_caching=True, prefill_chunk=16)
    w = engine.add(shared + [50], 4)
    r = engine.add(shared + [60, 61], 4)
    engine.step()  # the writer reads 16 prompt tokens; the reader waits for 40
    assert engine.abort(w)
    results = engine.run()
    assert results[r].tokens == _alone(model, shared + [60, 61], 4)
    assert results[r].prefix_hits == 16, "the two blocks the writer had written"
