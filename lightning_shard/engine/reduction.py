"""A unit's gradient reduction: from the gradients on its unsharded faces to this rank's averaged rows on the
sharded faces' ``.grad``, as DDP averages them.

Each rank's part of the reduction ends with one "was used" flag per trainable parameter, so that after the sum
every rank knows which parameters got a gradient on some rank: those unused everywhere keep ``grad=None``, as
with DDP. On gloo with CPU tensors the reduce-scatter is a point-to-point exchange for small shard groups and one
``all_to_all`` of a rank-major buffer for larger ones (see [Note: the fast path per backend] in docs/design.md and
[Note: Python work per collective] in ``collectives``); elsewhere it is one ``reduce_scatter`` of a rank-major
buffer.

The reduced rows land in the unit's ``sharded_grads`` (the shards' ``.grad`` are views of it): straight there
when the shards have no gradient yet and nothing needs casting or downloading, otherwise through a receive
buffer from the pool (see [Note: the buffer pool]) that is given back once the rows are added.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
from torch import Tensor

from lightning_shard.engine import collectives
from lightning_shard.engine.buffer_pool import BufferPool
from lightning_shard.engine.mesh import ShardMesh
from lightning_shard.engine.param_shard import ShardedParam


class ReducedUnit(Protocol):
    """What a reduction reads and writes of the unit it reduces (``lightning_shard.engine.unit.ShardUnit``)."""

    pool: BufferPool
    device: torch.device
    shard_device: torch.device
    mesh: ShardMesh
    dtype: torch.dtype
    reduce_dtype: torch.dtype
    trainable: list[ShardedParam]
    grad_sharded_numel: int
    landing_in_flight: bool

    @property
    def offloaded(self) -> bool: ...

    def grad_landing(self) -> Tensor: ...

    def grad_views(self) -> list[Tensor]: ...


def start_reduction(unit: ReducedUnit, async_op: bool) -> collectives.Pending:
    """Issue ``unit``'s gradient reduction: the reduce-scatter (or, on gloo, the point-to-point exchange), then the
    replica all-reduce; ``wait()`` on the result adds this rank's averaged rows to the shards' ``.grad``."""
    mesh = unit.mesh
    n, k = mesh.shard_size, len(unit.trainable)
    grads = [p.local_grad(p.unsharded.grad) for p in unit.trainable]
    for p in unit.trainable:
        p.unsharded.grad = None
    if mesh.world_size == 1:  # nothing to average: the gradients become the shards' gradients as they are
        return collectives.Pending(None, functools.partial(_keep_local_grads, unit, grads))
    path = collectives.collective_path(mesh.shard_backend, unit.device, mesh.shard_size)
    if mesh.shard_group is not None and path is collectives.CollectivePath.POINT_TO_POINT:
        return _start_exchange(unit, grads)
    device = unit.device
    present = {g.dtype for g in grads if g is not None}
    in_dtype = present.pop() if len(present) == 1 else unit.reduce_dtype  # _chunk_cat wants one input dtype
    # Each rank's chunk ends with k "was used" flags, so that after the sum every rank knows which
    # parameters got a gradient on some rank: those unused everywhere keep grad None, as with DDP.
    used_here = [g is not None for g in grads]
    used = torch.tensor(used_here, dtype=in_dtype, device=device)
    width = unit.grad_sharded_numel + k
    chunked_block = unit.pool.take(n * width * unit.reduce_dtype.itemsize, device)
    chunked = chunked_block.view(unit.reduce_dtype).view(n, width)
    pieces = [p.grad_rows(g, in_dtype, device) for p, g in zip(unit.trainable, grads)]
    torch._chunk_cat([*pieces, used.expand(n, k)], dim=0, num_chunks=n, out=chunked)  # casts to reduce dtype
    del grads, pieces  # the unsharded gradients are copied: free them before communicating
    # DDP divides by the world size before summing. For a power-of-two world size dividing this rank's
    # chunk after the sum gives the same bits (the scaling is exact) and touches 1/N of the data.
    power_of_two = mesh.world_size & (mesh.world_size - 1) == 0
    if not power_of_two or mesh.shard_group is None:
        chunked.div_(mesh.world_size)
    if mesh.shard_group is None:  # replicas only: the all-reduce in _finish reduces the whole buffer
        return collectives.Pending(None, lambda: _finish(unit, chunked.view(-1), used_here, [chunked_block]))
    landing = _direct_landing(unit)
    out_block = None if landing is not None else unit.pool.take(width * unit.reduce_dtype.itemsize, device)
    out = landing if landing is not None else out_block.view(unit.reduce_dtype)  # type: ignore[union-attr]
    divide_by = mesh.world_size if power_of_two else 1
    blocks = [chunked_block] if out_block is None else [chunked_block, out_block]
    if path is collectives.CollectivePath.ALL_TO_ALL:  # gloo, many ranks: see [Note: Python work per collective]
        received_block = unit.pool.take(n * width * unit.reduce_dtype.itemsize, device)
        blocks.append(received_block)
        received = received_block.view(unit.reduce_dtype)
        reduction = collectives.reduce_scatter_all_to_all(
            chunked.view(-1), received, mesh.shard_group, async_op, divide_by, out=out
        )
    else:
        reduction = collectives.reduce_scatter_sum(chunked.view(-1), mesh.shard_group, async_op, divide_by, out=out)
    return collectives.Pending(None, lambda: _finish(unit, _result(reduction), used_here, blocks))

def _start_exchange(unit: ReducedUnit, grads: list[Tensor | None]) -> collectives.Pending:
    """The reduce-scatter as a point-to-point exchange (see [Note: the fast path per backend]): every rank
    sends each peer that peer's rows of every gradient, straight from the gradients (no rank-major copy),
    and sums what it receives for its own rows. The result has the layout ``start_reduction`` gives."""
    mesh = unit.mesh
    assert mesh.shard_group is not None
    n, me, k, total = mesh.shard_size, mesh.shard_rank, len(unit.trainable), unit.grad_sharded_numel
    with torch.no_grad():
        used_here = [g is not None for g in grads]
        used = torch.tensor(used_here, dtype=unit.reduce_dtype, device=unit.device)
        mats = [p.grad_rows(g, unit.reduce_dtype, unit.device) for p, g in zip(unit.trainable, grads)]
        del grads
        power_of_two = mesh.world_size & (mesh.world_size - 1) == 0
        if not power_of_two:  # DDP divides before summing; for a power of two, after is the same bits
            mats = [m / mesh.world_size for m in mats]
        # What each peer sends for this rank's rows, one row per peer in the reduction's layout; with more
        # than two ranks a row for this rank's own part too, so that the rows are summed in rank order.
        rows = n if n > 2 else 1
        landing = _direct_landing(unit)
        blocks: list[Tensor] = []
        if rows == 1 and landing is not None:  # received straight into the shards' gradient memory
            received = landing.view(1, total + k)
        else:
            blocks.append(unit.pool.take(rows * (total + k) * unit.reduce_dtype.itemsize, unit.device))
            received = blocks[-1].view(unit.reduce_dtype).view(rows, total + k)
        for p in unit.trainable:  # zero the padding, which nobody sends, so that only numbers are summed
            if p.local_rows < p.rows_per_rank:
                received[:, p.grad_offset + p.local_rows * p.row_numel : p.grad_offset + p.padded_shard_numel] = 0

        def row_of(rank: int) -> Tensor:
            return received[rank if n > 2 else 0]

        def own_piece(row: Tensor, p: ShardedParam) -> Tensor:
            return row[p.grad_offset : p.grad_offset + p.local_rows * p.row_numel]

        outgoing: list[list[Tensor]] = [[] for _ in range(n)]
        incoming: list[list[Tensor]] = [[] for _ in range(n)]
        for q in range(n):
            if q == me:
                continue
            for p, m in zip(unit.trainable, mats):
                first, count = p.rows_held_by(q)
                if count:
                    outgoing[q].append(m[first : first + count].view(-1))
                if p.local_rows:
                    incoming[q].append(own_piece(row_of(q), p))
            outgoing[q].append(used)
            incoming[q].append(row_of(q)[total:])
    rank_major_bytes = n * (total + k) * unit.reduce_dtype.itemsize  # what a reduce-scatter's input would be
    exchange = collectives.reduce_scatter_exchange(outgoing, incoming, mesh.shard_group, rank_major_bytes)

    def summed() -> Tensor:
        exchange.wait()
        with torch.no_grad():
            # Two ranks: add this rank's part into the peer's row (a + b == b + a). More: put it in its own
            # row and sum the rows in rank order, the same order on every rank.
            target = row_of(me)
            places, pieces = [target[total:]], [used]
            for p, m in zip(unit.trainable, mats):
                if p.local_rows:
                    first, count = p.rows_held_by(me)
                    places.append(own_piece(target, p))
                    pieces.append(m[first : first + count].view(-1))
            # One call for every parameter's part.
            (torch._foreach_add_ if n == 2 else torch._foreach_copy_)(places, pieces)
            if n == 2:
                out = target
            elif landing is not None:
                out = torch.sum(received, 0, out=landing)
            else:
                blocks.append(unit.pool.take((total + k) * unit.reduce_dtype.itemsize, unit.device))
                out = torch.sum(received, 0, out=blocks[-1].view(unit.reduce_dtype))
            return out.div_(mesh.world_size) if power_of_two else out

    return collectives.Pending(None, lambda: _finish(unit, summed(), used_here, blocks))

def _keep_local_grads(unit: ReducedUnit, grads: list[Tensor | None]) -> None:
    """One rank: each gradient becomes its shard's gradient (no copy unless the dtype or device differs);
    parameters without a gradient keep ``None``."""
    for p, g in zip(unit.trainable, grads):
        if g is None:
            continue
        grad = g.to(device=unit.shard_device, dtype=unit.dtype).view(p.sharded.shape)
        if p.sharded.grad is None:
            p.sharded.grad = grad
        else:
            p.sharded.grad.add_(grad)

def _direct_landing(unit: ReducedUnit) -> Tensor | None:
    """The unit's ``sharded_grads`` when the reduction can land in it as it is: no shard has a gradient (after
    ``zero_grad()``), no earlier reduction of the unit is still landing there (a unit run in several forwards
    before one backward reduces once per forward), and the reduce dtype and device are the shards'. ``None``
    otherwise; the caller then marks it in flight until ``_finish``."""
    if unit.reduce_dtype != unit.dtype or unit.offloaded or unit.landing_in_flight:
        return None
    if any(p.sharded.grad is not None for p in unit.trainable):
        return None
    unit.landing_in_flight = True
    return unit.grad_landing()


def _finish(unit: ReducedUnit, reduced: Tensor, used_here: list[bool], blocks: list[Tensor]) -> None:
    """Put this rank's reduced rows (``reduced``: the rows, then the "was used" flags) into the shards' ``.grad``
    and give the reduction's pool ``blocks`` back."""
    if unit.mesh.replicate_group is not None:
        collectives.all_reduce_sum(reduced, unit.mesh.replicate_group)
    # The summed flags matter only for parameters this rank did not use; when it used them all (the usual
    # case) they are not read, which on a GPU saves a device synchronisation per unit.
    total = unit.grad_sharded_numel
    used_anywhere = used_here if all(used_here) else (reduced[total:] > 0).tolist()
    landing = unit.grad_landing()
    landed = reduced.data_ptr() == landing.data_ptr()
    if landed:
        unit.landing_in_flight = False
    if not landed and all(p.sharded.grad is None for p in unit.trainable):  # one copy (cast, download) for all
        landing[:total].copy_(reduced[:total])
        landed = True
    accumulated: list[Tensor] = []
    increments: list[Tensor] = []
    for p, is_used, grad in zip(unit.trainable, used_anywhere, unit.grad_views()):
        if not is_used:
            continue
        rows = slice(p.grad_offset, p.grad_offset + p.local_rows * p.row_numel)
        if p.sharded.grad is None:  # its rows of the gradient memory are free (see [Note: the buffer pool])
            if not landed:
                grad.copy_(reduced[rows].view(p.sharded.shape))
            p.sharded.grad = grad
        else:
            accumulated.append(p.sharded.grad)
            increments.append(reduced[rows].view(p.sharded.shape).to(device=unit.shard_device, dtype=unit.dtype))
    if accumulated:
        torch._foreach_add_(accumulated, increments)
    for block in blocks:
        unit.pool.give(block)


def _result(pending: collectives.Pending) -> Tensor:
    result = pending.wait()
    assert result is not None
    return result
