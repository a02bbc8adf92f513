"""Threads for one model step on a shared CPU: as many of torch's intra-op threads as there are cores free.

A parallel region of torch's intra-op pool ends when its slowest thread does. Beside other busy processes a worker
is often descheduled, and a decode step is hundreds of small regions (one per product, norm and attention call),
each of which then waits a scheduler slice (milliseconds) for it. One thread on a shared core never waits for
another: beside busy processes a step made of small regions runs faster on fewer threads than on the pool.

So a model that :func:`qkv.cpu.optimize` rewrote runs each step (``model(...)``, and the steps of
``qkv.models.generate`` and the Engine) under :func:`step`: it sets torch's intra-op threads for the step to

    min(threads, max(1, cores - others))

where ``threads`` is torch's setting, ``cores`` the CPUs the kernel schedules (``os.cpu_count()``) and ``others``
the runnable tasks that are not this process's (``/proc/loadavg``'s running count less this process's threads
in state R; the smaller of the last two readings, so a burst shorter than a period is not load), and puts torch's
setting back after. The count is read at most every :data:`PERIOD` seconds (reading it costs tens of
microseconds). It never raises the thread count, and where ``/proc`` is unreadable
(not Linux) it changes nothing.

The count is the whole machine's (a container sees its host's load), so on a host where other tasks run on
cores this process may not use, the step keeps more threads than it could use; never fewer than one.
``optimize(model, threads="fixed")`` keeps torch's setting for every step.

Example:
    >>> import torch
    >>> from qkv.cpu import threads
    >>> with threads.step():
    ...     1 <= torch.get_num_threads() <= max(1, threads.requested())
    True
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import torch

__all__ = ["THREAD_MODES", "PERIOD", "others_running", "step_threads", "step", "requested", "open_step", "close_step"]

#: ``optimize(model, threads=...)``: ``"adapt"`` (default; :func:`step` per model step) or ``"fixed"``.
THREAD_MODES = ("adapt", "fixed")
#: Seconds a reading of the machine's load is reused for.
PERIOD = 0.05

_lock = threading.Lock()
_reading: tuple[float, int | None, int | None] = (-float("inf"), None, None)  # (time, others, the reading before)
_local = threading.local()  # .depth: steps open on this thread; .requested: torch's setting outside them


def _running_tasks() -> int:
    """The machine's runnable tasks now (``/proc/loadavg``'s fourth field, ``running/total``)."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def _own_running() -> int:
    """This process's threads in state R (running or runnable), those included in :func:`_running_tasks`."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        n += stat[stat.rindex(")") + 2] == "R"  # the state follows the parenthesised name
    return n


def others_running(*, fresh: bool = False) -> int | None:
    """Runnable tasks on this machine that are not this process's threads (None where ``/proc`` cannot be read):
    the smaller of the last two readings, so a burst shorter than a period (a process starting, a worker waking)
    is not taken for load, taken at most :data:`PERIOD` seconds ago (``fresh=True``: one reading now, alone)."""
    global _reading
    now = time.monotonic()
    with _lock:
        at, value, before = _reading
        if not fresh and now - at < PERIOD:
            return value if before is None or value is None else min(value, before)
        try:
            new = max(0, _running_tasks() - _own_running())
        except (OSError, ValueError, IndexError):
            new = None
        _reading = (now, new, None if fresh else value)
        return new if fresh or value is None or new is None else min(new, value)


def requested() -> int:
    """Torch's intra-op thread setting, as the user left it (inside :func:`step`: the setting outside it)."""
    return getattr(_local, "requested", None) or torch.get_num_threads()


def step_threads(threads: int | None = None, *, others: int | None = None) -> int:
    """The intra-op threads a step should use: ``min(threads, max(1, cores - others))`` (see the module).

    Args:
        threads: the most to use (default: :func:`requested`), an int >= 1.
        others: the runnable tasks of other processes (default: :func:`others_running`); None where unknown
            gives ``threads``.
    """
    if threads is None:
        threads = requested()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"step_threads: threads must be an int >= 1 (torch's intra-op threads), got {threads!r}")
    if others is None:
        others = others_running()
        if others is None:
            return threads
    elif isinstance(others, bool) or not isinstance(others, int) or others < 0:
        raise ValueError(f"step_threads: others must be None (read the machine's load) or an int >= 0 (runnable "
                         f"tasks of other processes), got {others!r}")
    return min(threads, max(1, (os.cpu_count() or 1) - others))


@contextlib.contextmanager
def step() -> Iterator[int]:
    """Run the body with :func:`step_threads` intra-op threads and put torch's setting back after (also on error).
    Nested steps on the same thread keep the outer one's choice. Yields the threads in use."""
    depth = getattr(_local, "depth", 0)
    if depth:
        _local.depth = depth + 1
        try:
            yield torch.get_num_threads()
        finally:
            _local.depth -= 1
        return
    before = torch.get_num_threads()
    n = step_threads(before)
    _local.depth, _local.requested = 1, before
    if n != before:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        _local.depth, _local.requested = 0, None
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def open_step(module, args) -> None:
    """A forward pre-hook: opens a :func:`step` that :func:`close_step` closes (the two hooks
    :func:`qkv.cpu.optimize` registers on a model with ``threads="adapt"``)."""
    cm = step()
    cm.__enter__()
    _local.__dict__.setdefault("open", []).append(cm)


def close_step(module, args, output) -> None:
    """A forward hook (registered with ``always_call=True``, so it runs on error too): closes the innermost
    :func:`open_step`."""
    opened = _local.__dict__.get("open")
    if opened:
        opened.pop().__exit__(None, None, None)
