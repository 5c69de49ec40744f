"""The collectives the engine uses, as plain functions with no hook logic.

Each function takes the group to run on; the engine calls them through this module's attributes, so
a test can wrap them to count calls and bytes. The point-to-point exchange talks to the process
group object itself (its ranks, ``send`` and ``recv``), not to the registry of groups: a model can
still run forward after the ``Trainer`` has torn its process group down (sampling after ``fit``),
as with the collectives, which are also issued on the group object. The backend decides how a
collective is done (see [Note: the fast path per backend] in docs/design.md):

- On gloo with CPU tensors and a shard group of at most ``POINT_TO_POINT_MAX_RANKS`` ranks, a unit's
  all-gather and its gradient reduce-scatter are point-to-point exchanges: every rank sends each peer
  what that peer needs and receives straight into place. The gathered pieces land in the param-major
  buffer with no copy out of a receive buffer, and the reduction moves half the bytes of an all-reduce
  (gloo's own ``reduce_scatter`` is slower still).
- On gloo with CPU tensors and a larger shard group, ``all_gather_single`` into one rank-major buffer
  (copied into the param-major one) and, for the reduction, ``all_to_all_single`` of a rank-major
  buffer whose received rows this rank sums in rank order: one call each, whatever the group size
  (see [Note: Python work per collective]).
- On NCCL (and gloo with CUDA tensors), ``all_gather_single`` into one rank-major buffer (copied
  into the param-major one by a single kernel) and ``reduce_scatter_single``, asynchronous on the
  process group's stream.

[Note: Python work per collective]
A point-to-point exchange posts one ``send`` and one ``recv`` per peer and per parameter: its Python
work grows with the shard group (at 1024 simulated ranks a tiny model's step made half a million
Python calls). Above ``POINT_TO_POINT_MAX_RANKS`` ranks every collective is one call into the
backend, which loops over the peers itself, so a step's Python work no longer depends on the world
size. Up to it the exchanges stay: measured on 2, 4 and 8 gloo ranks (docs/benchmarks.md, "Scaling the
world size (simulated)"), a training step took the same CPU time on both paths (within 4%), and the
exchanges hold less memory (no rank-major gather buffer; one reduction buffer instead of two, none on
two ranks). gloo's own ``reduce_scatter`` took two to five times as long as ``all_to_all`` for the
same bytes, so the larger groups use ``all_to_all``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup

from lightning_shard.engine.progress import RECORD, Activity, about
from lightning_shard.engine.stall import wait_timeout, watching
from lightning_shard.engine.torch_compat import all_gather_single, reduce_scatter_single


@dataclass
class CollectiveStats:
    """Bytes this rank's collectives moved and the time it spent in them (issuing, and waiting for results).

    ``STATS`` accumulates over the process's lifetime; ``ShardMonitor`` reads differences per step.
    """

    all_gather_bytes: int = 0
    reduce_bytes: int = 0
    seconds: float = 0.0

    def snapshot(self) -> CollectiveStats:
        return CollectiveStats(self.all_gather_bytes, self.reduce_bytes, self.seconds)


STATS = CollectiveStats()


class Pending:
    """A collective that has been issued and may still be running; ``wait()`` returns its result (computed once:
    later calls return the same). ``activity``: the collective as this rank counted it when issuing it; a wait
    past the timeout raises ``StalledRanksError`` naming it (see [Note: how a wait ends])."""

    def __init__(self, work: Any, finish: Callable[[], Tensor | None], activity: Activity | None = None) -> None:
        self._work: Any = work
        self._activity = activity
        self._finish: Callable[[], Tensor | None] | None = finish
        self._done = False
        self._result: Tensor | None = None

    def wait(self) -> Tensor | None:
        if self._done:
            return self._result
        if self._work is not None:
            start = time.perf_counter()
            with record_function("lightning_shard::wait"), watching(self._activity):
                wait_for(self._work)
            STATS.seconds += time.perf_counter() - start
            self._work = None
        assert self._finish is not None
        with about(self._activity.unit if self._activity is not None else RECORD.unit):  # its follow-up collectives
            self._done, self._result = True, self._finish()
        self._finish = None  # drop what the result was computed from (buffers held by the closure)
        return self._result


def all_gather_flat(output: Tensor, shard: Tensor, group: ProcessGroup | None, async_op: bool = False) -> Pending:
    """Fill ``output`` (1D, ``group size * shard.numel()``) with every rank's ``shard``, rank-major."""
    start = time.perf_counter()
    activity = RECORD.enter("all-gather")
    with record_function("lightning_shard::all_gather"), watching(activity):
        work = all_gather_single(output, shard, group=group, async_op=async_op)
    STATS.seconds += time.perf_counter() - start
    STATS.all_gather_bytes += output.numel() * output.element_size()
    return Pending(work, lambda: output, activity)


def exchanges_point_to_point(backend: str | None, device: torch.device) -> bool:
    """Whether the fast path for tensors on ``device`` over a group of ``backend`` is the point-to-point ``exchange``
    (for groups of at most ``POINT_TO_POINT_MAX_RANKS``): gloo with CPU tensors. Otherwise (NCCL, or gloo with CUDA
    tensors) it is ``all_gather_flat`` with one copy and ``reduce_scatter_sum``."""
    return device.type == "cpu" and backend is not None and "gloo" in backend


POINT_TO_POINT_MAX_RANKS = 8  # see [Note: Python work per collective]


class CollectivePath(enum.Enum):
    """How a unit's all-gather and gradient reduction are done over its shard group (see the module docstring)."""

    POINT_TO_POINT = enum.auto()  # gloo, CPU, small group: ``all_gather_pieces`` and ``reduce_scatter_exchange``
    ALL_TO_ALL = enum.auto()  # gloo, CPU, larger group: ``all_gather_flat`` and ``reduce_scatter_all_to_all``
    FLAT = enum.auto()  # NCCL (or gloo with CUDA tensors): ``all_gather_flat`` and ``reduce_scatter_sum``

    @property
    def gathers_in_place(self) -> bool:
        """Whether the all-gather lands straight in the param-major buffer (else rank-major, then one copy)."""
        return self is CollectivePath.POINT_TO_POINT


def collective_path(backend: str | None, device: torch.device, group_size: int) -> CollectivePath:
    """The path for a shard group of ``group_size`` ranks of ``backend`` with tensors on ``device``."""
    if not exchanges_point_to_point(backend, device):
        return CollectivePath.FLAT
    if group_size <= POINT_TO_POINT_MAX_RANKS:
        return CollectivePath.POINT_TO_POINT
    return CollectivePath.ALL_TO_ALL


def exchange(
    outgoing: list[list[Tensor]], incoming: list[list[Tensor]], group: ProcessGroup, op: str = "exchange"
) -> Pending:
    """Send ``outgoing[q]`` to group rank ``q`` and receive ``incoming[q]`` from it, tensor by tensor, for every
    other rank ``q`` (this rank's own entries are ignored). Asynchronous; ``wait()`` returns ``None``. ``op``
    names the collective this exchange is, in a ``StalledRanksError``.

    Both sides must list matching tensor sizes in the same order (see ``_EXCHANGE_TAG``).
    """
    start = time.perf_counter()
    rank, size = group.rank(), group.size()
    activity = RECORD.enter(op)
    works: list[Any] = []
    for peer in [(rank + i) % size for i in range(1, size)]:  # no rank is everybody's first peer
        for tensor in incoming[peer]:
            works.append(group.recv([tensor], peer, _EXCHANGE_TAG))
        for tensor in outgoing[peer]:
            works.append(group.send([tensor], peer, _EXCHANGE_TAG))
    STATS.seconds += time.perf_counter() - start
    return Pending(_AllWorks(works), lambda: None, activity)


# Point-to-point messages between two ranks are matched in the order they are posted. Every rank issues the
# engine's exchanges in the same order, so the n-th message from a peer is always the n-th one expected; the
# tag keeps them apart from any point-to-point traffic of the user's own on the same group.
_EXCHANGE_TAG = 0x5A4D


class _AllWorks:
    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> None:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)


def wait_for(work: Any) -> None:
    """Wait for a collective's ``work``, at most the strategy's timeout where it set one (see [Note: how a wait
    ends]): a point-to-point work keeps its group's creation timeout otherwise, and so may an NCCL one."""
    timeout = wait_timeout()
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def all_gather_pieces(
    outputs: list[Tensor], inputs: list[Tensor], group: ProcessGroup, async_op: bool = False
) -> Pending:
    """For every pair, fill ``outputs[i]`` (1D, ``group size * inputs[i].numel()``) with every rank's ``inputs[i]``,
    rank-major: this rank's piece is copied into place and every other rank's piece is received straight into
    place. ``wait()`` returns ``None``: the results are in ``outputs``."""
    rank, size = group.rank(), group.size()
    slots = [output.view(size, -1) for output in outputs]
    with record_function("lightning_shard::all_gather"):
        pending = exchange([inputs] * size, [[slot[q] for slot in slots] for q in range(size)], group, "all-gather")
        torch._foreach_copy_([slot[rank] for slot in slots], inputs)  # this rank's pieces, in one call
    STATS.all_gather_bytes += sum(o.numel() * o.element_size() for o in outputs)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_exchange(
    outgoing: list[list[Tensor]], incoming: list[list[Tensor]], group: ProcessGroup, nbytes: int
) -> Pending:
    """The point-to-point part of a reduce-scatter (``exchange``); the caller sums what arrives. ``nbytes``: the
    size of the equivalent reduce-scatter's input, for ``STATS``."""
    STATS.reduce_bytes += nbytes
    with record_function("lightning_shard::reduce_scatter"):
        return exchange(outgoing, incoming, group, "reduce-scatter")


def reduce_scatter_sum(
    full: Tensor, group: ProcessGroup, async_op: bool = False, divide_by: int = 1, out: Tensor | None = None
) -> Pending:
    """Sum ``full`` (1D, ``group size`` equal chunks) over the group; ``wait()`` gives this rank's chunk (in
    ``out``, 1D, if given; else a new tensor) divided by ``divide_by``."""
    group_size = group.size()
    start = time.perf_counter()
    STATS.reduce_bytes += full.numel() * full.element_size()
    activity = RECORD.enter("reduce-scatter")
    with record_function("lightning_shard::reduce_scatter"), watching(activity):
        if out is None:
            out = torch.empty(full.numel() // group_size, dtype=full.dtype, device=full.device)
        work = reduce_scatter_single(out, full, group=group, async_op=async_op)
    STATS.seconds += time.perf_counter() - start
    result = out
    return Pending(work, lambda: result.div_(divide_by) if divide_by != 1 else result, activity)


def reduce_scatter_all_to_all(
    full: Tensor, received: Tensor, group: ProcessGroup, async_op: bool = False, divide_by: int = 1,
    out: Tensor | None = None,
) -> Pending:
    """Sum ``full`` (1D, ``group size`` equal chunks) over the group as gloo does it fastest for many ranks: every
    rank sends each peer that peer's chunk in one ``all_to_all_single`` into ``received`` (1D, the size of ``full``),
    then sums the received chunks in rank order, the same order on every rank. ``wait()`` gives this rank's chunk
    (in ``out``, 1D, if given; else a new tensor) divided by ``divide_by``."""
    group_size = group.size()
    start = time.perf_counter()
    STATS.reduce_bytes += full.numel() * full.element_size()
    activity = RECORD.enter("reduce-scatter")
    with record_function("lightning_shard::reduce_scatter"), watching(activity):
        work = dist.all_to_all_single(received, full, group=group, async_op=async_op)
    STATS.seconds += time.perf_counter() - start

    def summed() -> Tensor:
        rows = received.view(group_size, -1)
        result = torch.sum(rows, 0, out=out) if out is not None else torch.sum(rows, 0)
        return result.div_(divide_by) if divide_by != 1 else result

    return Pending(work, summed, activity)


def all_reduce_sum(tensor: Tensor, group: ProcessGroup) -> None:
    """Sum ``tensor`` in place over the group."""
    start = time.perf_counter()
    with record_function("lightning_shard::all_reduce"), watching(RECORD.enter("all-reduce")):
        wait_for(dist.all_reduce(tensor, group=group, async_op=True))
    STATS.seconds += time.perf_counter() - start
    STATS.reduce_bytes += tensor.numel() * tensor.element_size()


def all_reduce_max(tensor: Tensor, group: ProcessGroup | None) -> None:
    """Take the elementwise maximum of ``tensor`` in place over the group (``None``: all ranks)."""
    with record_function("lightning_shard::all_reduce"), watching(RECORD.enter("all-reduce (max)")):
        wait_for(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True))


def broadcast_from_rank0(tensor: Tensor, group: ProcessGroup | None = None) -> None:
    """Overwrite ``tensor`` on every rank of ``group`` (``None``: all ranks) with the values of the group's rank 0."""
    with watching(RECORD.enter("broadcast from rank 0")):
        wait_for(dist.broadcast(tensor, group=group, group_src=0, async_op=True))
