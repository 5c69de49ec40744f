"""The collectives the engine uses, as plain functions with no hook logic.

Each function takes the group to run on and calls ``torch.distributed`` through the module
attribute (``dist.all_gather_single``), so a test can wrap those to count calls and bytes.
The backend decides how a collective is done (see [Note: the fast path per backend] in
docs/design.md):

- gloo's ``reduce_scatter`` is about twice as slow as its ``all_reduce`` on the same buffer, so on
  gloo the reduce-scatter is an all-reduce followed by taking this rank's chunk (same result, same
  summation as DDP's all-reduce).
- gloo copies every all-gather's result out of its own receive buffer anyway, so on gloo a unit's
  all-gather writes each parameter's pieces straight to their places (one coalesced collective),
  instead of gathering rank-major and copying into the param-major buffer afterwards. On NCCL the
  flat all-gather followed by one copy kernel is the proven fast path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup


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
    """A collective that has been issued and may still be running; ``wait()`` returns its result."""

    def __init__(self, work: Any, finish: Callable[[], Tensor | None]) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> Tensor | None:
        if self._work is not None:
            start = time.perf_counter()
            with record_function("lightning_shard::wait"):
                self._work.wait()
            STATS.seconds += time.perf_counter() - start
            self._work = None
        return self._finish()


def all_gather_flat(output: Tensor, shard: Tensor, group: ProcessGroup | None, async_op: bool = False) -> Pending:
    """Fill ``output`` (1D, ``group size * shard.numel()``) with every rank's ``shard``, rank-major."""
    start = time.perf_counter()
    with record_function("lightning_shard::all_gather"):
        work = dist.all_gather_single(output, shard, group=group, async_op=async_op)
    STATS.seconds += time.perf_counter() - start
    STATS.all_gather_bytes += output.numel() * output.element_size()
    return Pending(work, lambda: output)


def gathers_into_pieces(group: ProcessGroup | None) -> bool:
    """Whether ``all_gather_pieces`` is this backend's fast path for gathering a unit (gloo: yes)."""
    return dist.get_backend(group) == "gloo"


def all_gather_pieces(
    outputs: list[Tensor], inputs: list[Tensor], group: ProcessGroup | None, async_op: bool = False
) -> Pending:
    """For every pair, fill ``outputs[i]`` (1D, ``group size * inputs[i].numel()``) with every rank's ``inputs[i]``,
    rank-major, in one coalesced collective. ``wait()`` returns ``None``: the results are in ``outputs``."""
    start = time.perf_counter()
    with record_function("lightning_shard::all_gather"):
        with dist._coalescing_manager(group, async_ops=async_op) as coalesced:
            for output, shard in zip(outputs, inputs):
                dist.all_gather_single(output, shard, group=group)
    STATS.seconds += time.perf_counter() - start
    STATS.all_gather_bytes += sum(o.numel() * o.element_size() for o in outputs)
    return Pending(coalesced if async_op else None, lambda: None)


def reduce_scatter_sum(
    full: Tensor, group: ProcessGroup, group_rank: int, async_op: bool = False, divide_by: int = 1
) -> Pending:
    """Sum ``full`` (1D, ``group size`` equal chunks) over the group; ``wait()`` gives this rank's chunk (new tensor)
    divided by ``divide_by``.

    ``full`` is clobbered on backends where the reduction runs in place.
    """
    group_size = dist.get_world_size(group)
    start = time.perf_counter()
    STATS.reduce_bytes += full.numel() * full.element_size()
    with record_function("lightning_shard::reduce_scatter"):
        if dist.get_backend(group) == "gloo":
            work = dist.all_reduce(full, group=group, async_op=async_op)
            STATS.seconds += time.perf_counter() - start
            return Pending(work, lambda: torch.div(full.view(group_size, -1)[group_rank], divide_by))
        out = torch.empty(full.numel() // group_size, dtype=full.dtype, device=full.device)
        work = dist.reduce_scatter_single(out, full, group=group, async_op=async_op)
        STATS.seconds += time.perf_counter() - start
        return Pending(work, lambda: out.div_(divide_by) if divide_by != 1 else out)


def all_reduce_sum(tensor: Tensor, group: ProcessGroup) -> None:
    """Sum ``tensor`` in place over the group."""
    start = time.perf_counter()
    with record_function("lightning_shard::all_reduce"):
        dist.all_reduce(tensor, group=group)
    STATS.seconds += time.perf_counter() - start
    STATS.reduce_bytes += tensor.numel() * tensor.element_size()


def all_reduce_max(tensor: Tensor, group: ProcessGroup | None) -> None:
    """Take the elementwise maximum of ``tensor`` in place over the group (``None``: all ranks)."""
    with record_function("lightning_shard::all_reduce"):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


def broadcast_from_rank0(tensor: Tensor) -> None:
    """Overwrite ``tensor`` on every rank with global rank 0's values."""
    dist.broadcast(tensor, src=0)
