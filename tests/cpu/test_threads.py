"""qkv.cpu.threads: a step of an optimized model takes no more intra-op threads than cores other processes leave
free, puts torch's setting back after, and ``threads="fixed"`` keeps torch's setting (#49, item 4)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
from torch import nn

import qkv.cpu
from qkv.cpu import threads

CORES = os.cpu_count() or 1


@pytest.fixture
def crowded(monkeypatch):
    """Every core taken by another process's runnable task."""
    monkeypatch.setattr(threads, "others_running", lambda fresh=False: CORES)


class Recorder(nn.Module):
    """Records the intra-op threads its forward runs on; raises when asked to."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: list[int] = []

    def forward(self, x, fail: bool = False):
        self.seen.append(torch.get_num_threads())
        if fail:
            raise RuntimeError("boom")
        return self.proj(x)


@pytest.mark.parametrize("requested,others,expected", [
    (2, 0, 2), (2, CORES - 1, 1), (2, CORES, 1), (2, 10 * CORES, 1), (1, 0, 1), (64, 0, min(64, CORES)),
    (CORES, 1, max(1, CORES - 1))])
def test_step_threads_is_free_cores_capped_by_the_setting(requested, others, expected):
    assert threads.step_threads(requested, others=others) == expected


@pytest.mark.parametrize("kw,match", [
    ({"threads": 0}, "threads must be an int >= 1"), ({"threads": True}, "threads must be"),
    ({"threads": "2"}, "threads must be"), ({"threads": 2, "others": -1}, "others must be None"),
    ({"threads": 2, "others": 1.5}, "others must be"), ({"threads": 2, "others": False}, "others must be")])
def test_step_threads_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        threads.step_threads(**kw)


def test_optimize_threads_bad_input():
    with pytest.raises(ValueError, match=r"optimize: threads must be one of \('adapt', 'fixed'\).*got 'auto'"):
        qkv.cpu.optimize(nn.Linear(4, 4), threads="auto")
    with pytest.raises(ValueError, match="threads must be one of"):
        qkv.cpu.optimize(nn.Linear(4, 4), threads=None)


def test_others_running_reads_this_machine():
    n = threads.others_running(fresh=True)
    if not os.path.exists("/proc/loadavg"):
        assert n is None
    else:
        assert isinstance(n, int) and n >= 0


def test_step_restores_the_setting_and_nests(two_threads, crowded):
    with threads.step() as n:
        assert n == torch.get_num_threads() == 1
        assert threads.requested() == 2
        with threads.step() as inner:  # a nested step keeps the outer choice
            assert inner == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="boom"):
        with threads.step():
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_unreadable_proc_changes_nothing(two_threads, monkeypatch):
    def missing():
        raise FileNotFoundError("/proc/loadavg")

    monkeypatch.setattr(threads, "_running_tasks", missing)
    assert threads.others_running(fresh=True) is None
    with threads.step() as n:
        assert n == 2
    threads.others_running(fresh=True)  # a good reading for the tests after


def test_optimized_model_calls_run_on_free_cores(two_threads, crowded):
    model = qkv.cpu.optimize(Recorder())
    assert qkv.cpu.optimized(model).threads == "adapt"
    model(torch.randn(2, 8))
    assert model.seen == [1] and torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="boom"):  # restored on error too
        model(torch.randn(2, 8), fail=True)
    assert torch.get_num_threads() == 2
    qkv.cpu.optimize(model, threads="fixed")  # the hooks come off
    model(torch.randn(2, 8))
    assert model.seen[-1] == 2 and qkv.cpu.optimized(model).threads == "fixed"
    qkv.cpu.optimize(model)  # and back on, once
    model(torch.randn(2, 8))
    assert model.seen[-1] == 1 and len(model._forward_pre_hooks) == 1


def test_plain_model_keeps_the_setting(two_threads, crowded):
    model = Recorder()
    with qkv.cpu.step(model):
        model(torch.randn(2, 8))
    assert model.seen == [2]


def test_generate_steps_run_on_free_cores(two_threads, crowded):
    """The greedy decode loop (``next_tokens``, outside ``model(...)``) and the sampled one both run each step
    under the step's threads; the tokens are those of the fixed setting."""
    from qkv.models import generate
    from qkv.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64)).eval()
    seen: list[int] = []
    model.layers[0].register_forward_hook(lambda m, a, o: seen.append(torch.get_num_threads()))
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        adapt = generate(model, ids, max_new_tokens=4).new_tokens
        assert seen and set(seen) == {1}
        seen.clear()
        generate(model, ids, max_new_tokens=3, do_sample=True, generator=torch.Generator().manual_seed(0))
        assert seen and set(seen) == {1}
        seen.clear()
        qkv.cpu.optimize(model, threads="fixed")
        fixed = generate(model, ids, max_new_tokens=4).new_tokens
    assert set(seen) == {2} and torch.equal(adapt, fixed)


def _spin() -> None:
    while True:
        pass


@pytest.mark.timeout(60)
def test_busy_processes_take_the_step_to_one_thread(two_threads):
    """Real load: with a spinning process on every core, :func:`threads.others_running` sees them and a step
    takes one thread."""
    if threads.others_running(fresh=True) is None:
        pytest.skip("no /proc/loadavg here")
    procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(CORES)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 30
        while threads.others_running(fresh=True) < CORES and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threads.others_running(fresh=True) >= CORES
        time.sleep(threads.PERIOD)
        with threads.step() as n:
            assert n == 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()


def test_a_burst_shorter_than_a_period_is_not_load(monkeypatch):
    """One reading of a burst (a process starting) leaves the count where the reading before had it; a second
    reading of the same load counts."""
    counts = iter([0, 9, 9, 0])
    monkeypatch.setattr(threads, "_running_tasks", lambda: next(counts))
    monkeypatch.setattr(threads, "_own_running", lambda: 0)
    monkeypatch.setattr(threads, "PERIOD", 0.0)
    assert threads.others_running(fresh=True) == 0
    assert threads.others_running() == 0  # the burst's first reading
    assert threads.others_running() == 9  # it lasted: load
    assert threads.others_running() == 0  # gone: the smaller reading
    monkeypatch.undo()
    threads.others_running(fresh=True)
