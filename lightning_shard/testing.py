"""Run a function on N gloo CPU ranks from inside pytest, for multi-rank unit tests.

    from lightning_shard.testing import run_on_ranks

    def check_sum(rank: int, world_size: int) -> float:   # module-level, so workers can import it
        t = torch.tensor([float(rank)])
        torch.distributed.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_on_ranks(check_sum, world_size=2) == [1.0, 1.0]

The ranks are worker processes started once per world size and kept for the whole test session,
with the default process group already initialised (gloo, one thread each) and Lightning's
environment variables set, so a ``Trainer`` inside them runs in-process as that rank.

Every rank is accounted for. If a rank raises or its process dies, the others get ``grace`` seconds
more to report; a rank still silent then (typically one blocked in a collective its failed peer never
joined: gloo would only give up after the process group's own timeout, 30 minutes by default) is
named as not reporting, as is every silent rank when the whole call exceeds ``timeout``. Then every
worker of that world size is killed (a rank left inside a collective cannot be recovered) and
``RankFailure`` is raised with one ``RankOutcome`` per rank; the next call starts fresh workers.
"""

from __future__ import annotations

import atexit
import enum
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

_POOLS: dict[int, _RankPool] = {}
_POLL_S = 0.2  # how often a waiting parent looks for dead workers


class RankStatus(enum.Enum):
    """How one rank's call ended."""

    RETURNED = "returned"  # fn returned; the result crossed back
    RAISED = "raised"  # fn raised (or its result could not be pickled); the traceback crossed back
    DID_NOT_REPORT = "did not report"  # still running when the parent stopped waiting
    DIED = "died"  # the worker process exited without reporting


@dataclass(frozen=True)
class RankOutcome:
    """One rank's part of a ``run_on_ranks`` call.

    ``error`` is one line: the exception (``"ValueError: ..."``) when RAISED, ``"did not report within 30 s after
    rank 0 failed"`` when DID_NOT_REPORT, ``"died with exit code 3"`` when DIED; empty when RETURNED.
    """

    rank: int
    status: RankStatus
    result: Any = None  # fn's return value, when RETURNED
    error: str = ""
    traceback: str = ""  # the rank's full traceback, when RAISED

    @property
    def failed(self) -> bool:
        return self.status is not RankStatus.RETURNED

    def section(self) -> str:
        """This rank's part of the failure message: its traceback, or why it is missing (nothing if it returned)."""
        body = (self.traceback or self.error).rstrip()
        return f"--- rank {self.rank}: {self.status.value} ---" + (f"\n{body}" if body else "")


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not report. ``outcomes`` maps every rank to its ``RankOutcome``;
    the message holds each rank's section (its traceback, or why it is missing)."""

    def __init__(self, message: str, outcomes: dict[int, RankOutcome] | None = None) -> None:
        super().__init__(message)
        self.outcomes = outcomes or {}

    @property
    def failed_ranks(self) -> list[int]:
        return [r for r, o in sorted(self.outcomes.items()) if o.failed]


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    grace: float = 30.0,
    **kwargs: Any,
) -> list:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank and return the results in rank order.

    ``fn``, its arguments and its results cross process boundaries: ``fn`` must be importable
    (defined at module level) and everything must be picklable. ``timeout`` bounds the whole call;
    ``grace`` is how long the other ranks may still take to report once one rank has raised or died.
    Raises ``RankFailure`` unless every rank returned.
    """
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = _RankPool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout, grace)
    except RankFailure:
        pool.kill()
        _POOLS.pop(world_size, None)
        raise


def shutdown_ranks() -> None:
    """Stop every worker (each destroys its process group first). Registered at interpreter exit."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_ranks)


class _RankPool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results: Any = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(rank, world_size, port, self.inboxes[rank], self.results), daemon=True)
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float, grace: float) -> list:
        for inbox in self.inboxes:
            inbox.put((fn, args, kwargs))
        outcomes = self._collect(time.monotonic() + timeout, timeout, grace)
        if any(o.failed for o in outcomes.values()):
            name = getattr(fn, "__name__", repr(fn))
            failed = [r for r, o in sorted(outcomes.items()) if o.failed]
            text = "\n".join(outcomes[r].section() for r in range(self.world_size))
            raise RankFailure(f"{name} failed on ranks {failed} of {self.world_size}:\n{text}", outcomes)
        return [outcomes[r].result for r in range(self.world_size)]

    def _collect(self, deadline: float, timeout: float, grace: float) -> dict[int, RankOutcome]:
        """Wait for every rank's report until ``deadline``, or until ``grace`` seconds after the first failure."""
        outcomes: dict[int, RankOutcome] = {}
        failed_at: float | None = None
        while len(outcomes) < self.world_size:
            limit = deadline if failed_at is None else min(deadline, failed_at + grace)
            now = time.monotonic()
            if now >= limit:
                break
            try:
                outcome = self._receive(block=True, timeout=min(_POLL_S, limit - now))
            except queue.Empty:
                self._note_deaths(outcomes)
            else:
                outcomes[outcome.rank] = outcome
            if failed_at is None and any(o.failed for o in outcomes.values()):
                failed_at = time.monotonic()
        self._note_deaths(outcomes)
        if failed_at is None or failed_at + grace > deadline:
            waited = f"within {timeout:g} s"
        else:
            waited = f"within {grace:g} s after rank {min(r for r, o in outcomes.items() if o.failed)} failed"
        for rank in range(self.world_size):
            outcomes.setdefault(rank, RankOutcome(rank, RankStatus.DID_NOT_REPORT, error=f"did not report {waited}"))
        return outcomes

    def _note_deaths(self, outcomes: dict[int, RankOutcome]) -> None:
        """Record the reports already sent, then every worker that exited without one."""
        while len(outcomes) < self.world_size:  # a worker's last report is in the pipe before its process exits
            try:
                outcome = self._receive(block=False)
            except queue.Empty:
                break
            outcomes[outcome.rank] = outcome
        for rank, p in enumerate(self.procs):
            if rank not in outcomes and not p.is_alive():
                outcomes[rank] = RankOutcome(rank, RankStatus.DIED, error=_death(p.exitcode))

    def _receive(self, block: bool, timeout: float | None = None) -> RankOutcome:
        rank, ok, payload = self.results.get(block, timeout)
        if ok:
            return RankOutcome(rank, RankStatus.RETURNED, result=pickle.loads(payload))
        error, text = payload
        return RankOutcome(rank, RankStatus.RAISED, error=error, traceback=text)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=20)
        self.kill()


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"died with exit code {exitcode} ({signal.Signals(-exitcode).name})"
    return f"died with exit code {exitcode}"


def _worker(rank: int, world_size: int, port: int, inbox: Any, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        while (task := inbox.get()) is not None:
            fn, args, kwargs = task
            try:
                # Pickled here, not in the queue's feeder thread, so an unpicklable result is reported, not lost.
                results.put((rank, True, bytes(ForkingPickler.dumps(fn(rank, world_size, *args, **kwargs)))))
            except BaseException as err:  # noqa: BLE001 - reported to the parent with its traceback
                results.put((rank, False, (f"{type(err).__name__}: {err}", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
