"""Every byte qkv's context parallelism moves goes through one ``Exchange``: bounded waits, a pre-flight
agreement on shapes and dtypes, and a log of collectives, bytes and block work per rank.

A wait that does not finish within ``timeout`` seconds (a peer died, stalled, or never called the same
function) raises :class:`CollectiveTimeout` naming the scheme and the step, instead of blocking for the
process group's default (30 minutes on gloo). Transport errors (a peer's socket closed) raise the same error.
"""

from __future__ import annotations

import datetime
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CollectiveTimeout", "CommLog", "Exchange", "DEFAULT_TIMEOUT", "ALL_TO_ALL", "dtype_code"]

#: Seconds a collective may wait for its peers when ``timeout=None``: long enough for any one exchange of a
#: block on a loaded machine, short enough that an absent peer is reported within a minute.
DEFAULT_TIMEOUT = 60.0

#: The longest ``timeout`` accepted (a week); ``float("inf")`` is refused (the transport takes a finite wait).
MAX_TIMEOUT = 7 * 24 * 3600.0

#: How all-to-all runs: the backend's collective, or pairwise sends/receives (exact, any backend).
ALL_TO_ALL = ("auto", "native", "p2p")

_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4, torch.int64: 5}


class CollectiveTimeout(TimeoutError):
    """A collective of qkv.distributed did not complete in time (a rank died, stalled or diverged).

    The process group is left mid-collective: destroy it (``torch.distributed.destroy_process_group``) and
    restart the job (torchrun's elastic restarts do this) rather than calling it again."""


@dataclass
class CommLog:
    """What one rank's calls moved and computed. Pass one as ``log=`` to record.

    ``counts``: collectives by kind (``sendrecv`` = one ring shift, a batch of sends and receives);
    ``bytes_sent``: payload bytes this rank sent (``bytes_by_phase``: split by phase); ``work``: score
    elements computed (B * H * nq * nk per block); ``allowed``: of those, pairs the mask allows; ``events``:
    (phase, op, step) in order.
    """

    counts: Counter = field(default_factory=Counter)
    bytes_sent: int = 0
    bytes_by_phase: Counter = field(default_factory=Counter)
    work: int = 0
    allowed: int = 0
    events: list = field(default_factory=list)

    def record(self, phase: str, op: str, step: str, nbytes: int) -> None:
        self.counts[f"{phase}:{op}"] += 1
        self.bytes_sent += nbytes
        self.bytes_by_phase[phase] += nbytes
        self.events.append((phase, op, step))

    def total(self, op: str) -> int:
        """Count of ``op`` over every phase (forward, backward, check)."""
        return sum(c for k, c in self.counts.items() if k.endswith(":" + op))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Pending:
    """Sends and receives in flight; ``wait()`` returns the received tensors."""

    def __init__(self, exchange: Exchange, works, received, what: str) -> None:
        self.exchange, self.works, self.received, self.what = exchange, works, received, what

    def wait(self) -> list[torch.Tensor]:
        self.exchange.wait(self.works, self.what)
        return self.received


class Exchange:
    """Collectives over ``group`` for one call of a scheme, with timeouts and a log."""

    def __init__(self, group, scheme: str, timeout: float | None = None, log: CommLog | None = None,
                 phase: str = "forward", all_to_all: str = "auto") -> None:
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= MAX_TIMEOUT:
            raise ValueError(f"qkv.distributed: timeout must be a positive number of seconds, at most {MAX_TIMEOUT:g} "
                             f"(a week; the transport needs a finite wait), got {timeout!r}")
        if all_to_all not in ALL_TO_ALL:
            raise ValueError(f"qkv.distributed: all_to_all must be one of {ALL_TO_ALL}, got {all_to_all!r}")
        self.group, self.scheme, self.timeout, self.log, self.phase = group, scheme, float(timeout), log, phase
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.all_to_all_impl = all_to_all

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _record(self, op: str, step: str, nbytes: int) -> None:
        if self.log is not None:
            self.log.record(self.phase, op, step, nbytes)

    def wait(self, works, what: str) -> None:
        deadline = time.monotonic() + self.timeout  # one budget for the whole batch of sends and receives
        for w in works:
            try:
                w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError as e:
                raise CollectiveTimeout(
                    f"qkv.distributed {self.scheme}: {self.phase} {what} did not complete within {self.timeout:g} s "
                    f"on rank {self.rank} of {self.world}: a peer died, stalled or did not make the same call "
                    f"({str(e).splitlines()[0][:200]})") from e

    def agree(self, fields: dict[str, tuple[int, ...]], device=None) -> None:
        """All-gather a small integer description of this rank's call and raise ``ValueError`` naming the
        first rank whose description differs (every rank raises the same error). ``device``: where the
        backend takes tensors (the inputs' device; NCCL needs CUDA)."""
        flat = [v for vals in fields.values() for v in (len(vals), *vals)]
        mine = torch.tensor(flat, dtype=torch.int64, device=device)
        size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
        sizes = self.all_gather(size, "description sizes", phase="check")
        sizes = [int(s) for s in sizes]
        if len(set(sizes)) > 1:
            bad = next(r for r, s in enumerate(sizes) if s != sizes[0])
            raise ValueError(f"qkv.distributed {self.scheme}: rank {bad} describes its call differently from rank "
                             f"0 (a different mask, score modifier or tensor rank); every rank must make the same call")
        every = self.all_gather(mine, "shapes and dtypes", phase="check")
        for r, theirs in enumerate(every):
            if torch.equal(theirs, every[0]):
                continue
            ref, got, at = every[0].tolist(), theirs.tolist(), 0
            for name, vals in fields.items():
                n = len(vals) + 1
                if ref[at:at + n] != got[at:at + n]:
                    raise ValueError(
                        f"qkv.distributed {self.scheme}: rank {r} has {name} {_show(name, got[at + 1:at + n])} but "
                        f"rank 0 has {_show(name, ref[at + 1:at + n])}; every rank must pass the same shapes and "
                        "dtypes (shard the sequence evenly; pad it to a multiple the scheme needs)")
                at += n

    def start_shift(self, tensors: list[torch.Tensor], step: str) -> _Pending:
        """Send each tensor to the next rank and receive the previous rank's (one ring step), asynchronously."""
        nxt, prv = self._global((self.rank + 1) % self.world), self._global((self.rank - 1) % self.world)
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = []
        for s, r in zip(sent, received):
            ops.append(dist.P2POp(dist.isend, s, nxt, self.group))
            ops.append(dist.P2POp(dist.irecv, r, prv, self.group))
        self._record("sendrecv", step, sum(_nbytes(s) for s in sent))
        return _Pending(self, dist.batch_isend_irecv(ops), received, f"ring shift {step}")

    def all_gather(self, t: torch.Tensor, step: str, *, phase: str | None = None) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world)]
        saved, self.phase = self.phase, phase or self.phase
        try:
            self._record("all_gather", step, (self.world - 1) * _nbytes(t))  # each peer needs this rank's part
            self.wait([dist.all_gather(out, t, group=self.group, async_op=True)], f"all-gather ({step})")
        finally:
            self.phase = saved
        return out

    def reduce_scatter(self, chunks: list[torch.Tensor], step: str) -> torch.Tensor:
        """Sum over ranks of every rank's ``chunks[self.rank]``."""
        chunks = [c.contiguous() for c in chunks]
        out = torch.empty_like(chunks[self.rank])
        self._record("reduce_scatter", step, sum(_nbytes(c) for i, c in enumerate(chunks) if i != self.rank))
        self.wait([dist.reduce_scatter(out, chunks, group=self.group, async_op=True)], f"reduce-scatter {step}")
        return out

    def all_to_all(self, chunks: list[torch.Tensor], step: str) -> list[torch.Tensor]:
        """Send ``chunks[j]`` to rank ``j``; return what every rank sent to this one (index = sender)."""
        chunks = [c.contiguous() for c in chunks]
        out = [torch.empty_like(c) for c in chunks]
        self._record("all_to_all", step, sum(_nbytes(c) for i, c in enumerate(chunks) if i != self.rank))
        if self.all_to_all_impl != "p2p":
            self.wait([dist.all_to_all(out, chunks, group=self.group, async_op=True)], f"all-to-all {step}")
            return out
        # Pairwise exchange with isend/irecv, which every backend has (gloo builds before 2.x lack all_to_all).
        ops = []
        for j in range(self.world):
            if j == self.rank:
                out[j].copy_(chunks[j])
                continue
            ops.append(dist.P2POp(dist.isend, chunks[j], self._global(j), self.group))
            ops.append(dist.P2POp(dist.irecv, out[j], self._global(j), self.group))
        if ops:
            self.wait(dist.batch_isend_irecv(ops), f"all-to-all (pairwise) {step}")
        return out

    def all_reduce(self, t: torch.Tensor, step: str) -> torch.Tensor:
        self._record("all_reduce", step, _nbytes(t))
        self.wait([dist.all_reduce(t, group=self.group, async_op=True)], f"all-reduce {step}")
        return t


def _show(name: str, vals: list[int]):
    if name == "dtype" and len(vals) == 1:
        return next((str(d).replace("torch.", "") for d, c in _DTYPE_CODE.items() if c == vals[0]), vals[0])
    return tuple(vals)


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODE.get(dtype, 0)
