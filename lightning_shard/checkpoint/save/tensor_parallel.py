"""The rows of the whole tensors a rank writes in a sharded save under tensor parallelism.

[Note: tensor-parallel checkpoints]
A checkpoint holds every tensor in its whole (global) shape, so that it loads at any data- and tensor-parallel size,
without tensor parallelism too. Under tensor parallelism a rank's rows of a parameter (see [Note: DTensor parameters
in the engine]) are one block of the whole tensor; each rank writes rows of the whole tensor, and the index lists
every piece (``"split": "pieces"``, file and rows), because the rows no longer follow the one rule of [Note: rows by
rule]:

- ``Shard(0)`` (``ColwiseParallel``): the rank's rows of its local tensor are rows of the whole tensor, shifted by
  where its tensor-parallel part starts; written as they are.
- ``Shard(1)`` (``RowwiseParallel``): the ranks of one tensor-parallel group hold the same rows, each some columns.
  They gather their blocks (one all-gather over the group per tensor, the rows of one data-parallel rank at a time),
  and each writes a ``1/T`` part of those whole rows.
- replicated (plain parameters, ``Replicate()``): the ranks of one tensor-parallel group hold the same rows; each
  writes a ``1/T`` part of them.

Optimizer state shaped like a parameter, and averaged weights, are written like it. A load reads, for each rank, the
rows of the whole tensor its block covers (whole rows, checked, then its columns kept for ``Shard(1)``), whatever the
sizes that wrote them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.checkpoint.io.layout import shard_rows
from lightning_shard.engine.param_shard import ShardedParam


def tensor_parallel_piece(
    p: ShardedParam, value: Tensor, tp_size: int, tp_rank: int
) -> tuple[Tensor, tuple[int, int]] | None:
    """The rows of the whole tensor this rank (``tp_rank`` of its tensor-parallel group of ``tp_size``) writes of
    ``value`` (shaped like ``p``'s shard), and which rows they are; ``None`` when it writes none. Collective over the
    tensor-parallel group for a ``Shard(1)`` parameter."""
    tp = p.tensor_parallel
    start, stop, _ = p.rows_in_full()
    if tp is not None and tp.shard_dim == 0:
        return (value, (start, stop)) if stop > start else None
    if tp is not None and tp.shard_dim == 1:
        value = _whole_rows(value, tp.device_mesh.get_group(), tp.global_shape[1], tp_size)
    lo, hi = shard_rows(stop - start, tp_size, tp_rank)
    return (value[lo:hi], (start + lo, start + hi)) if hi > lo else None


def _whole_rows(block: Tensor, group: dist.ProcessGroup, columns: int, tp_size: int) -> Tensor:
    """The whole rows whose columns ``block`` and the other ranks of ``group`` hold (split as ``torch.chunk`` splits
    ``columns``, the split ``Shard(1)`` makes); one all-gather of blocks padded to the widest."""
    widths = [len(c) for c in torch.arange(columns).chunk(tp_size)]
    widths += [0] * (tp_size - len(widths))
    widest = max(widths)
    padded = block.new_zeros(block.shape[0], widest, *block.shape[2:])
    padded[:, : block.shape[1]] = block
    gathered = [torch.empty_like(padded) for _ in range(tp_size)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:, :w] for g, w in zip(gathered, widths)], dim=1)
