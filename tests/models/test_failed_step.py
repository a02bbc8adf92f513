"""``Engine.step`` after an exception: a failure injected in each phase of a step (a prefill pass, a decode pass,
token selection; an ordinary exception or ``KeyboardInterrupt``) propagates, the pass's writes are undone (the pool's
free blocks as before the pass), and the engine keeps serving: every request, those of the failed pass included,
ends with the tokens of running it alone, and requests added afterwards run too. Where a sliding-window layer has
released blocks the undo would need, the pass's requests end with ``finish_reason="error (...)"`` and their
blocks return to the pool."""

from __future__ import annotations

import random

import pytest
import torch

import qkv.models.engine as engine_module
from _toy_lm import peaked_decoder, single_thread  # noqa: F401 (autouse fixture)
from qkv.models import Engine, generate
from qkv.nn import DecoderLM

VOCAB = 89


def _lm(seed: int, dtype=torch.float64, **fields) -> DecoderLM:
    return peaked_decoder(seed, fields.pop("vocab_size", VOCAB), dtype=dtype, num_hidden_layers=3, **fields)


def _alone(model, prompt, budget):
    return generate(model, torch.tensor([prompt]), max_new_tokens=budget).new_tokens[0].tolist()


def _requests(seed: int, n: int = 4):
    rng = random.Random(seed)
    return [([rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 17))], rng.randint(3, 9)) for _ in range(n)]


def _free(engine) -> int:
    return sum(s.blocks_free for s in engine.cache.pool_stats().values())


class _Boom(RuntimeError):
    pass


class _Arm:
    """Raises ``error`` once, at the next forward of the model's middle layer whose input is ``width``-wide
    (``"prefill"``: more than one column, ``"decode"``: one), after the layers before it wrote the step."""

    def __init__(self, model, phase: str, error: BaseException):
        self.phase, self.error, self.armed, self.fired = phase, error, False, 0
        model.layers[1].register_forward_pre_hook(self)

    def __call__(self, module, args):
        x = args[0]
        wide = x.shape[1] > 1
        if self.armed and wide == (self.phase == "prefill"):
            self.armed = False
            self.fired += 1
            raise self.error


def _serve(engine, arm, *, fail_at: int) -> tuple[dict, list[int]]:
    """Step to the end, arming ``arm`` before step ``fail_at``; results by id and the free blocks before and after
    the failed step."""
    results, seen, i = {}, [], 0
    while engine.busy:
        if i == fail_at:
            arm()
            free_before = _free(engine)
            with pytest.raises((_Boom, KeyboardInterrupt)):
                engine.step()
            seen = [free_before, _free(engine)]
        for u in engine.step():
            if u.finished is not None:
                results[u.request_id] = u.finished
        i += 1
    return results, seen


@pytest.mark.parametrize("error", [_Boom("injected"), KeyboardInterrupt()], ids=["exception", "interrupt"])
@pytest.mark.parametrize("phase", ["prefill", "decode", "selection"])
def test_a_failed_pass_is_undone_and_the_engine_serves_on(phase, error, monkeypatch):
    model = _lm(0)
    reqs = _requests(1)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=4, optimize=False)
    ids = [engine.add(p, b) for p, b in reqs]
    if phase == "selection":
        real, state = engine_module.last_tokens, {"armed": False}

        def picks(*args):
            out = real(*args)  # every layer wrote the step; the tokens are lost
            if state["armed"]:
                state["armed"] = False
                raise error
            return out

        monkeypatch.setattr(engine_module, "last_tokens", picks)

        def arm():
            state["armed"] = True
    else:
        hook = _Arm(model, phase, error)

        def arm():
            hook.armed = True
    # the first step is prefill passes only; by step 6 the first two requests decode (chunks of 4, prompts <= 17)
    fail_at = {"prefill": 0, "decode": 6, "selection": 3}[phase]
    if phase == "decode":
        for _ in range(fail_at):
            engine.step()
        assert all(engine._rows[b].fed == len(engine._rows[b].prompt) for b in range(2)), "both rows must decode"
        fail_at = 0
    results, (free_before, free_after) = _serve(engine, arm, fail_at=fail_at)
    assert free_after == free_before, f"the failed pass kept {free_before - free_after} blocks"
    for rid, (prompt, budget) in zip(ids, reqs, strict=True):
        assert results[rid].finish_reason == "length"
        assert results[rid].tokens == _alone(model, prompt, budget), f"request {rid} after the failed {phase} pass"
    late = engine.add([5, 6, 7], 4)  # the engine still takes and serves new work
    assert engine.run()[late].tokens == _alone(model, [5, 6, 7], 4)
    assert _free(engine) == sum(s.blocks_total for s in engine.cache.pool_stats().values())


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_failed_window_pass_is_undone(phase):
    """Sliding-window layers release a row's oldest blocks as the window moves on; those a failed pass released
    are the ones its own queries did not need, so it is undone all the same (a later prefill chunk, a decode
    step)."""
    model = _lm(3, sliding_window=4, layer_types=("sliding_attention",) * 3)
    engine = Engine(model, num_blocks=64, block_size=2, max_batch=2, prefill_chunk=4, optimize=False)
    prompt = list(range(1, 15))
    rid = engine.add(prompt, 12)
    for _ in range(2 if phase == "prefill" else 5):  # two chunks of the prompt; or all four and a decode step
        engine.step()
    hook = _Arm(model, phase, _Boom("injected at layer 1"))
    hook.armed = True
    free_before = _free(engine)
    with pytest.raises(_Boom):
        engine.step()
    assert hook.fired == 1 and _free(engine) >= free_before  # more: the blocks the step released stay free
    assert engine.run()[rid].tokens == _alone(model, prompt, 12)


def test_a_pass_that_cannot_be_undone_ends_its_requests_with_the_reason(monkeypatch):
    """Where the cache cannot drop the failed step (here made to refuse), the pass's requests end with the
    exception named, their blocks return to the pool, the other requests and later ones run on."""
    model = _lm(4)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=32, optimize=False)
    a, b = engine.add([1, 2, 3, 4, 5], 6), engine.add([9, 8, 7], 5)
    engine.step()  # both prompts in one pass
    engine.step()  # one decode pass over both
    waiting = engine.add([4, 4, 4], 3)  # no free row: waits
    monkeypatch.setattr(engine.cache._manager, "cannot_drop", lambda n: "a window layer released a block (test)")
    hook = _Arm(model, "decode", _Boom("injected"))
    hook.armed = True
    with pytest.raises(_Boom):
        engine.step()
    monkeypatch.undo()
    assert engine.running == [] and all(s.blocks_in_use == 0 for s in engine.cache.pool_stats().values())
    results = engine.run()
    for rid in (a, b):
        reason = results[rid].finish_reason
        assert reason.startswith("error (_Boom: injected; the step could not be undone: a window layer"), reason
        assert len(results[rid].tokens) == 2  # the prefill's token and the first decode step's
    assert results[waiting].tokens == _alone(model, [4, 4, 4], 3)


def test_float32_engine_runs_the_int8_screen_and_matches_generate(monkeypatch):
    """The other Engine tests use float64 models, which the int8 greedy screen (qkv.cpu.greedy) never serves; a
    float32 model on the CPU takes it after qkv.cpu.optimize where this CPU has an int8 GEMM, and its tokens must
    still be those of generate. A screen that cannot run for any other reason (a wrong token on its probe, the
    kernels missing) fails here instead of passing unseen."""
    from qkv.cpu import greedy

    reason = greedy.screen_unavailable_reason()
    if reason is not None:
        pytest.fail(f"the int8 screen must run wherever qkv's kernels run: {reason}")
    calls = []
    real = greedy.HeadScreen.tokens

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(greedy.HeadScreen, "tokens", counted)
    model = _lm(5, dtype=torch.float32, vocab_size=257, hidden_size=64)
    engine = Engine(model, num_blocks=64, block_size=4, max_batch=3)  # optimize=True: qkv.cpu.optimize(model)
    reqs = [([7, 8, 9, 10], 6), ([11, 3], 5), ([40, 41, 42, 43, 44, 45], 4)]
    ids = [engine.add(p, b) for p, b in reqs]
    results = engine.run()
    assert bool(calls) == (reason is None), f"screened steps: {len(calls)}; screen unavailable because: {reason}"
    monkeypatch.undo()
    for rid, (prompt, budget) in zip(ids, reqs, strict=True):
        assert results[rid].tokens == _alone(model, prompt, budget)


def test_a_pass_failing_between_two_rows_choices_restores_both(monkeypatch):
    """Token selection fails for the second row of a pass after the first row drew its token: the undo restores the
    first row's tokens and sampler too, so every seeded request still gives the tokens of a run without failure."""
    from qkv.models import SamplingParams
    from qkv.models.sampling import RequestSampler

    model = _lm(6)
    reqs = [([3, 4, 5, 6], 11), ([7, 8, 9], 12), ([10, 11, 12, 13, 14], 9)]

    def serve(fail_on_call: int | None):
        engine = Engine(model, num_blocks=64, block_size=4, max_batch=2, prefill_chunk=4, optimize=False)
        ids = [engine.add(p, params=SamplingParams(max_tokens=n, temperature=0.9, top_k=20, seed=10 + i,
                                                   repetition_penalty=1.3, logprobs=2))
               for i, (p, n) in enumerate(reqs)]
        real, calls = RequestSampler.choose, [0]

        def choose(self, logits):
            calls[0] += 1
            if calls[0] == fail_on_call:
                raise _Boom("injected between two rows")
            return real(self, logits)

        monkeypatch.setattr(RequestSampler, "choose", choose)
        failures = 0
        while engine.busy:
            try:
                engine.step()
            except _Boom:
                failures += 1
        monkeypatch.undo()
        return [engine.results()[i] for i in ids], failures

    clean, _ = serve(None)
    for fail_on in (6, 8):  # the second row of a two-row decode pass (both rows decode by then)
        got, failures = serve(fail_on)
        assert failures == 1
        for a, b in zip(got, clean, strict=True):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason == "length"
            assert [lp.token for lp in a.logprobs] == a.tokens
