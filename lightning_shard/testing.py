"""Run a function on N gloo CPU ranks from inside pytest, for multi-rank unit tests.

    from lightning_shard.testing import run_on_ranks

    def check_sum(rank: int, world_size: int) -> float:   # module-level, so workers can import it
        t = torch.tensor([float(rank)])
        torch.distributed.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_on_ranks(check_sum, world_size=2) == [1.0, 1.0]

The ranks are worker processes started once per world size (from a fork server that has imported torch and
Lightning once, so that starting them costs no imports) and kept for the whole test session,
with the default process group already initialised (gloo, one thread each) and Lightning's
environment variables set, so a ``Trainer`` inside them runs in-process as that rank.

Every rank is accounted for. If a rank raises or its process dies, the others get ``grace`` seconds
more to report; a rank still silent then (typically one blocked in a collective its failed peer never
joined: gloo would only give up after the process group's own timeout, 30 minutes by default) is
named as not reporting, as is every silent rank when the whole call exceeds ``timeout``. Then every
worker of that world size is killed (a rank left inside a collective cannot be recovered) and
``RankFailure`` is raised with one ``RankOutcome`` per rank; the next call starts fresh workers.

``simulate_rank`` runs one process as one rank of a simulated world of any size (the process group
communicates nothing): to see what a rank holds and does at 1024 ranks without 1024 processes.
``count_python_calls`` counts the Python work of a step, to check that it does not grow with the world.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

_POOLS: dict[int, _RankPool] = {}
_POLL_S = 0.2  # how often a waiting parent looks for dead workers
# What every worker imports, imported once in the fork server the workers start from (a fresh worker, after a
# failure too, then starts in a fraction of a second instead of importing them anew).
_PRELOAD = ["torch", "torch.distributed", "lightning"]


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
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the fork server starts: with the first pool
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


# Simulated world sizes #

SimulatedBackend = Literal["gloo", "nccl"]
_SIMULATED_BACKENDS: dict[str, str] = {"gloo": "fake_gloo", "nccl": "fake"}  # what the fake group is registered as


@contextmanager
def simulate_rank(world_size: int, rank: int = 0, *, backend: SimulatedBackend = "gloo") -> Iterator[None]:
    """Run this process as rank ``rank`` of ``world_size`` ranks inside the block, with no other process.

        with simulate_rank(world_size=1024, rank=0):
            with torch.device("meta"):
                model = GPT()
            shard_model(model, auto_wrap_policy={Block}, device="cpu")
            ...  # forward, backward, optimizer.step(): this rank's shards, buffers and Python work at 1024 ranks

    The default process group is PyTorch's fake process group: it has the world size and rank given, and its
    collectives complete at once without communicating, leaving their outputs as they are. So everything this rank
    holds and does is as on a real rank of that world (the shard layout and padding, the buffers and their sizes,
    the memory, the Python work, the order of collectives), but values that would come from other ranks are not
    there: the gathered weights hold this rank's rows only, reduced gradients are this rank's own. Measure sizes
    and work with it, never numbers. ``backend`` says whose collective paths the engine takes: ``"gloo"`` (CPU
    tensors: point-to-point exchanges for small shard groups, see [Note: Python work per collective]) or
    ``"nccl"`` (the flat collectives, here on CPU tensors).

    Object collectives act as if every rank passed this rank's objects: ``broadcast_object_list`` leaves the list
    as it is on every rank (as on the source), ``all_gather_object`` and ``gather_object`` give copies of this
    rank's object for every rank. ``scatter_object_list`` on a rank other than the source raises: what the source
    would scatter exists nowhere. Raises ``RuntimeError`` if a process group exists already (the simulated one
    becomes the default group, and is destroyed when the block ends).
    """
    import torch.distributed as dist

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"simulate_rank(world_size=...) takes a positive int, got {world_size!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"simulate_rank(rank=...) takes an int in [0, {world_size}), got {rank!r}.")
    if backend not in _SIMULATED_BACKENDS:
        raise ValueError(f"simulate_rank(backend=...) takes one of {sorted(_SIMULATED_BACKENDS)}, got {backend!r}.")
    if dist.is_initialized():
        raise RuntimeError(
            "simulate_rank() makes the simulated process group the default one, but a process group already exists"
            " in this process (inside run_on_ranks, or after init_process_group). Simulate in a process of its own,"
            " or call torch.distributed.destroy_process_group() first."
        )
    store = _register_fake_backends()
    dist.init_process_group(_SIMULATED_BACKENDS[backend], store=store, rank=rank, world_size=world_size)
    originals = {name: getattr(dist, name) for name in _OBJECT_COLLECTIVES}
    for name, substitute in _OBJECT_COLLECTIVES.items():
        setattr(dist, name, substitute)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        if dist.is_initialized():
            dist.destroy_process_group()


def count_python_calls(fn: Callable[[], Any]) -> int:
    """How many Python functions and builtins ``fn()`` calls (``sys.setprofile``'s call events on this thread,
    which runs a CPU backward too): a measure of Python work that, unlike time, does not depend on the machine. The
    cyclic garbage collector is held off while ``fn`` runs (after a collection), so that finalizers of objects left by
    earlier code are not counted."""
    import gc
    import sys

    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
        if collecting:
            gc.enable()
    return calls


def _register_fake_backends() -> Any:
    """Register PyTorch's fake process group under the names ``_SIMULATED_BACKENDS`` uses (once a process); return
    a store for it. ``fake_gloo``'s name contains "gloo", so the engine takes gloo's collective paths on it."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg
    except ImportError as err:  # pragma: no cover - present in every supported torch
        raise RuntimeError(f"simulate_rank() needs PyTorch's fake process group, missing in this torch: {err}") from err
    if not hasattr(dist.Backend, "FAKE_GLOO"):
        dist.Backend.register_backend("fake_gloo", _create_fake_pg, extended_api=True, devices=["cpu"])
    return FakeStore()


def _broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None, **kwargs: Any) -> None:
    """Every rank holds what the source holds: this rank's objects, which stay as they are."""


def _all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    import copy

    object_list[:] = [copy.deepcopy(obj) for _ in object_list]


def _gather_object(obj: Any, object_gather_list: list[Any] | None = None, *args: Any, **kwargs: Any) -> None:
    import copy

    if object_gather_list is not None:
        object_gather_list[:] = [copy.deepcopy(obj) for _ in object_gather_list]


def _scatter_object_list(
    scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None, src: int | None = None,
    **kwargs: Any,
) -> None:
    import torch.distributed as dist

    if src is None:
        src = kwargs.get("group_src", 0)
    if dist.get_rank() != src or scatter_object_input_list is None:
        raise RuntimeError(
            f"scatter_object_list() on simulated rank {dist.get_rank()}: the objects rank {src} would scatter exist on"
            " no rank of a simulated world. Simulate the source rank, or pass the object to this rank directly."
        )
    scatter_object_output_list[0] = scatter_object_input_list[dist.get_rank()]


_OBJECT_COLLECTIVES: dict[str, Callable[..., None]] = {
    "broadcast_object_list": _broadcast_object_list,
    "all_gather_object": _all_gather_object,
    "gather_object": _gather_object,
    "scatter_object_list": _scatter_object_list,
}
