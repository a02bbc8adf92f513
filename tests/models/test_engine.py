"""``qkv.models.Engine``: continuous batching over the paged cache. Every request's greedy tokens equal those of
running it alone through ``generate`` (GQA, sliding-window, hybrid and MLA models; mixed prompt lengths and
budgets; pools tight enough that requests wait), rows join and leave between steps, blocks return at once,
prefills are chunked, prefixes are shared, and refused requests change nothing."""

from __future__ import annotations

import random

import pytest
import torch

from _toy_lm import ToyLM, peaked_decoder, single_thread  # noqa: F401 (single_thread: autouse fixture)
from qkv.models import Engine, EngineResult, generate
from qkv.nn import DecoderLM

VOCAB = 97


def _lm(seed: int, **fields) -> DecoderLM:
    return peaked_decoder(seed, fields.pop("vocab_size", VOCAB), **fields)


MODELS = {
    "gqa": lambda: _lm(0),
    "mistral_window": lambda: _lm(1, sliding_window=7, layer_types=("sliding_attention",) * 2),
    "hybrid_mqa": lambda: _lm(2, num_key_value_heads=1, num_hidden_layers=3, sliding_window=5,
                              layer_types=("sliding_attention", "full_attention", "sliding_attention")),
}


def _requests(n: int, seed: int, lo: int = 3, hi: int = 40, blo: int = 1, bhi: int = 20):
    rng = random.Random(seed)
    return [([rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))], rng.randint(blo, bhi)) for _ in range(n)]


def _alone(model, prompt, budget, stop=None, vocab=None):
    out = generate(model, torch.tensor([prompt]), max_new_tokens=budget, eos_token_id=stop)
    tokens = out.new_tokens[0].tolist()
    if stop is not None and bool(out.finished[0]):
        tokens = tokens[:tokens.index(stop) + 1]
    return tokens


def _drive(engine):
    """Run to completion; the results by id and whether some request waited for blocks while a row was free."""
    results, waited_for_blocks = {}, False
    while engine.busy:
        updates = engine.step()
        waited_for_blocks |= bool(engine.waiting) and len(engine.running) < engine.max_batch
        results.update({u.request_id: u.finished for u in updates if u.finished is not None})
    return results, waited_for_blocks


def _force_block_path(monkeypatch) -> list:
    """Every paged decode step through the block path of the paged backend (qkv.backends.paged: the compiled kernel,
    or the torch block path also below its size threshold); the list it returns grows by one per call of the path."""
    import qkv.backends.paged as blocks

    monkeypatch.setattr(blocks, "BLOCKS_MIN_SLOTS", 0)
    monkeypatch.setattr(blocks, "BLOCKS_BELOW_FILL", 1.0)
    served: list = []
    for name in ("_compiled", "_blocks"):
        real = getattr(blocks, name)
        monkeypatch.setattr(blocks, name, lambda *a, _real=real, **k: served.append(1) or _real(*a, **k))
    return served


@pytest.mark.parametrize("decode", ["default", "block_path"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tokens_equal_each_request_alone(name, decode, monkeypatch):
    """GQA, sliding-window and MQA layers, with the cache's own choice of decode path and with every decode step
    through the block path."""
    served = _force_block_path(monkeypatch) if decode == "block_path" else None
    model = MODELS[name]()
    requests = _requests(10, seed=len(name))
    engine = Engine(model, num_blocks=20, block_size=4, max_batch=4, prefill_chunk=8)
    ids = [engine.add(p, n) for p, n in requests]
    results, waited = _drive(engine)
    assert waited, "the pool should be tight enough that requests wait for blocks"
    for rid, (prompt, budget) in zip(ids, requests, strict=True):
        assert results[rid].tokens == _alone(model, prompt, budget), rid
        assert results[rid].finish_reason == "length"
        assert results[rid].prompt_tokens == len(prompt)
    stats = engine.cache.pool_stats()
    assert all(s.blocks_in_use == 0 for s in stats.values())  # every finished row returned its blocks
    assert served is None or served, "the block path should have served the decode steps"


def test_mixed_steps_give_the_same_tokens():
    """One forward pass per step over every running row (decode rows padded to the chunk width)."""
    model = MODELS["mistral_window"]()
    requests = _requests(6, seed=11)
    engine = Engine(model, num_blocks=16, block_size=4, max_batch=3, prefill_chunk=6, mixed_steps=True)
    ids = [engine.add(p, n) for p, n in requests]
    results = engine.run()
    for rid, (prompt, budget) in zip(ids, requests, strict=True):
        assert results[rid].tokens == _alone(model, prompt, budget), rid


def test_mla_model_and_stop_tokens():
    model = ToyLM(layers=("full", ("window", 5), "latent"), seed=3).double().eval()
    requests = [([t % 61 for t in p], n) for p, n in _requests(6, seed=7, hi=20, blo=4, bhi=12)]
    # stop on the third token each request would emit alone: it must end there, stop token included
    stops = [_alone(model, p, n)[min(2, n - 1)] for p, n in requests]
    engine = Engine(model, num_blocks=16, block_size=4, max_batch=3, prefill_chunk=5, vocab_size=61)
    with pytest.raises(ValueError, match="prompt_ids hold token ids"):  # ToyLM's vocabulary is 61
        engine.add([70], 3)
    ids = [engine.add(p, n, stop=s) for (p, n), s in zip(requests, stops, strict=True)]
    results = engine.run()
    for rid, (p, n), s in zip(ids, requests, stops, strict=True):
        expect = _alone(model, p, n, stop=s)
        assert results[rid].tokens == expect and expect[-1] == s and len(expect) <= 3
        assert results[rid].finish_reason == "stop"


def test_stream_interleaves_and_rows_join_as_others_finish():
    model = MODELS["gqa"]()
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=4)
    long = engine.add(list(range(1, 31)), 12)
    short = engine.add([5, 6, 7], 2)
    late = engine.add([8, 9, 10, 11], 3)
    seen: dict[int, list[int]] = {long: [], short: [], late: []}
    order, finished = [], {}
    for u in engine:
        seen[u.request_id] += u.tokens
        order.append(u.request_id)
        if u.finished is not None:
            finished[u.request_id] = u.finished
            assert u.finished.tokens == seen[u.request_id]
    assert set(finished) == {long, short, late}
    # the short request finishes (and the late one takes its row) while the long one still decodes
    assert order.index(late) < len(order) - 1 - order[::-1].index(long)
    assert max(i for i, r in enumerate(order) if r == short) < order.index(late)
    for rid, (p, n) in ((long, (list(range(1, 31)), 12)), (short, ([5, 6, 7], 2)), (late, ([8, 9, 10, 11], 3))):
        assert seen[rid] == _alone(model, p, n)


def test_long_prompt_does_not_stall_decoding_rows():
    model = MODELS["gqa"]()
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=4)
    a = engine.add([1, 2, 3], 20)
    engine.step()  # a's prompt fits one chunk: it decodes from the next step on
    b = engine.add(list(range(1, 41)), 2)  # 40 prompt tokens: 10 chunks
    for _ in range(10):
        got = {u.request_id for u in engine.step()}
        assert a in got  # every step, while b reads its prompt chunk by chunk
    assert b in {u.request_id for u in engine.step()}


def test_finished_rows_release_blocks_at_once():
    model = MODELS["gqa"]()
    engine = Engine(model, num_blocks=32, block_size=4, max_batch=2, prefill_chunk=16)
    engine.add(list(range(1, 13)), 1)  # 12 prompt tokens: 3 blocks, done after its prefill
    engine.add([1, 2], 6)
    engine.step()
    in_use = engine.cache.pool_stats()["full_attention"].blocks_in_use
    assert in_use == 1  # the first request's 3 blocks are back; the second holds its one block
    assert engine.running == [1]


def test_prefix_caching_shares_blocks_and_keeps_tokens():
    model = MODELS["hybrid_mqa"]()
    rng = random.Random(3)
    system = [rng.randrange(1, VOCAB) for _ in range(16)]
    requests = [(system + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))], rng.randint(2, 8))
                for _ in range(5)]
    engine = Engine(model, num_blocks=40, block_size=4, max_batch=2, prefill_chunk=6, prefix_caching=True)
    ids = [engine.add(p, n) for p, n in requests]
    results = engine.run()
    assert sum(results[r].prefix_hits for r in ids) >= 3 * 16  # later requests reuse the shared prompt blocks
    for rid, (p, n) in zip(ids, requests, strict=True):
        assert results[rid].tokens == _alone(model, p, n)
    salted = engine.add(system + [1], 2, salt="tenant-b")  # another tenant shares nothing
    assert engine.run()[salted].prefix_hits == 0


def _state(engine):
    stats = engine.cache.pool_stats()
    return (engine.waiting, engine.running, engine._next_id, list(engine.cache._manager.reserved),
            engine.cache.seq_length, {k: tuple(v) for k, v in stats.items()},
            [(r.rid, r.fed, list(r.tokens)) for r in engine._rows if r])


@pytest.mark.parametrize("call, error, match", [
    (lambda e: e.add([1, 2], 0), ValueError, "max_new_tokens must be an int >= 1"),
    (lambda e: e.add([1, 2], -3), ValueError, "max_new_tokens"),
    (lambda e: e.add([1, 2], 2.0), TypeError, "max_new_tokens must be an int"),
    (lambda e: e.add([1, 2], True), TypeError, "max_new_tokens"),
    (lambda e: e.add([], 2), ValueError, "prompt_ids is empty"),
    (lambda e: e.add([1, VOCAB], 2), ValueError, "vocabulary is 0 .. 96"),
    (lambda e: e.add([-1, 2], 2), ValueError, "vocabulary"),
    (lambda e: e.add([1.0, 2.0], 2), TypeError, "prompt_ids must hold ints"),
    (lambda e: e.add(torch.tensor([1.0, 2.0]), 2), TypeError, "1-D integer tensor"),
    (lambda e: e.add(torch.tensor([[1, 2]]), 2), TypeError, "1-D integer tensor"),
    (lambda e: e.add("hello", 2), TypeError, "list of ints"),
    (lambda e: e.add([1, 2], 2, stop="x"), TypeError, "stop must be a token id"),
    (lambda e: e.add([1, 2], 2, stop=[1.5]), TypeError, "stop must be a token id"),
    (lambda e: e.add([1, 2], 2, stop=[VOCAB]), ValueError, "stop tokens must lie in the vocabulary"),
    (lambda e: e.add([1, 2], 2, salt=3), TypeError, "salt"),
    (lambda e: e.add(list(range(1, 30)), 12), ValueError, "needs up to 10 blocks .* the pool has 8"),
])
def test_refused_requests_change_nothing(call, error, match):
    model = MODELS["gqa"]()
    engine, twin = (Engine(model, num_blocks=8, block_size=4, max_batch=2, prefill_chunk=4) for _ in range(2))
    for e in (engine, twin):
        e.add([1, 2, 3], 4)
        e.add([4, 5, 6, 7, 8], 3)
        e.add([9], 2)
        e.step()
    before = _state(engine)
    with pytest.raises(error, match=match):
        call(engine)
    assert _state(engine) == before
    assert engine.add([3, 1], 2) == twin.add([3, 1], 2) == 3  # the refused call took no id
    assert engine.run() == twin.run()


def test_a_request_filling_the_pool_runs_alone():
    model = MODELS["mistral_window"]()
    engine = Engine(model, num_blocks=4, block_size=4, max_batch=3, prefill_chunk=3)
    a = engine.add(list(range(1, 12)), 6)  # window 7: at most (7 + 3 + 6) // 4 = 4 blocks at once
    b = engine.add([2, 3], 2)
    engine.step()
    assert engine.running == [a] and engine.waiting == [b]
    results = engine.run()
    assert results[a].tokens == _alone(model, list(range(1, 12)), 6)
    assert results[b].tokens == _alone(model, [2, 3], 2)


def test_engine_arguments():
    model = MODELS["gqa"]()
    with pytest.raises(TypeError, match="DecoderModel"):
        Engine(torch.nn.Linear(2, 2))
    for bad in (dict(num_blocks=0), dict(block_size=-1), dict(max_batch=0), dict(prefill_chunk=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Engine(model, **bad)
    with pytest.raises(TypeError, match="max_batch"):
        Engine(model, max_batch=2.5)
    with pytest.raises(TypeError, match="prefix_caching"):
        Engine(model, prefix_caching=1)
    with pytest.raises(ValueError, match="pad_token_id"):
        Engine(model, pad_token_id=VOCAB)
    with pytest.raises(ValueError, match="vocab_size="):
        Engine(ToyLM(layers=("full",), seed=0))
    engine = Engine(model, num_blocks=8, block_size=4, max_batch=2)
    assert engine.step() == [] and not engine.busy and engine.run() == {}
    assert "running=0" in repr(engine)
    rid = engine.add(torch.tensor([1, 2, 3]), 1)
    result = engine.run()[rid]
    assert isinstance(result, EngineResult) and len(result.tokens) == 1


def test_prefill_passes_are_the_cheapest_split():
    """prefill_passes against every split of the rows sorted by width into runs (brute force, small cases): the
    least padded positions plus pass costs; every row in exactly one pass."""
    import itertools
    import random

    from qkv.models.engine import prefill_passes

    def cost(passes, widths, c):
        return sum(c + len(p) * max(widths[b] for b in p) for p in passes)

    rng = random.Random(0)
    for _ in range(60):
        n, c = rng.randint(1, 7), rng.choice([0, 1, 8, 32, 1000])
        widths = {b: rng.randint(1, 64) for b in rng.sample(range(20), n)}
        got = prefill_passes(widths, c)
        assert sorted(b for p in got for b in p) == sorted(widths) and all(p == sorted(p) for p in got)
        order = sorted(widths, key=lambda b: (-widths[b], b))
        best = min(cost([order[i:j] for i, j in zip((0, *cuts), (*cuts, n))], widths, c)
                   for k in range(n) for cuts in itertools.combinations(range(1, n), k))
        assert cost(got, widths, c) == best
    assert prefill_passes({}) == []
    assert prefill_passes({5: 10, 2: 10}, 1000) == [[2, 5]]
    for bad, match in (([(0, 3)], "widths must be a dict"), ({0: 0}, "widths must map"), ({0: 2.5}, "widths must map"),
                       ({"a": 3}, "widths must map")):
        with pytest.raises(TypeError if "dict" in match else ValueError, match=match):
            prefill_passes(bad)
    with pytest.raises(ValueError, match="pass_cost"):
        prefill_passes({0: 3}, -1)


def test_an_engine_step_splits_chunks_of_very_different_widths(monkeypatch):
    """A long prompt chunk and a short final one go in separate passes (each as wide as its own chunk); the tokens
    are those of generating alone."""
    model = _lm(5)
    widths = []
    real = Engine._run

    def spy(self, rows):
        widths.append(sorted(self._feed_width(b) if self._rows[b].fed < len(self._rows[b].prompt) else 1
                             for b in rows))
        return real(self, rows)

    monkeypatch.setattr(Engine, "_run", spy)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=64)
    a, b = engine.add(list(range(1, 61)), 3), engine.add([7, 8], 3)
    results = engine.run()
    assert widths[:2] == [[60], [2]]
    for rid, prompt in ((a, list(range(1, 61))), (b, [7, 8])):
        assert results[rid].tokens == _alone(model, prompt, 3)


@pytest.mark.parametrize("extra, admitted", [(0, True), (1, False)], ids=["fits-exactly", "one-token-short"])
def test_admission_asks_the_block_manager(extra, admitted):
    """The engine keeps no ledger: it asks cache.can_admit. A second request that needs exactly the blocks the first
    leaves (2 + 6 of 8) runs beside it and finishes (the promise was enough); one token more (7 blocks) waits until
    the first finishes."""
    model = MODELS["gqa"]()
    engine = Engine(model, num_blocks=8, block_size=4, max_batch=2, prefill_chunk=32)
    a = engine.add([1, 2, 3, 4, 5], 4)  # 5 + 4 - 1 = 8 tokens stored: 2 blocks
    prompt = list(range(3, 23))
    b = engine.add(prompt, 5 + extra)  # 20 + 5 - 1 = 24 tokens: 6 blocks (25: 7)
    assert engine.cache.can_admit(20, 5 + extra, chunk=32)  # alone it fits either way
    engine.step()
    assert engine.running == ([a, b] if admitted else [a])
    assert engine.cache._manager.reserved == [8 if admitted else 2]
    results = engine.run()
    assert results[b].tokens == _alone(model, prompt, 5 + extra)
    assert results[a].tokens == _alone(model, [1, 2, 3, 4, 5], 4)
    assert engine.cache._manager.reserved == [0]

