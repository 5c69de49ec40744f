"""Fingerprints of a sharded model's tensors that are the same whatever world size, mesh or wrap holds them.

[Note: fingerprints that do not depend on the world size]
A checkpoint that holds only some of a model's tensors (``save_trainable_only``, ``fabric.save(filter=...)``)
relies on the others being restored from where they came from, e.g. a pretrained import. It records a
fingerprint of each tensor it leaves out, and a load checks, before the next forward, that those tensors hold
the values they held at the save; a job resumed on another world size must compute the same fingerprint.

The fingerprint of a tensor is two 64-bit integers. Read each element's bits as an integer of its width and
view the tensor as rows (dim 0) of columns (the other dims flattened): the first word is the sum over rows of
each row's sum times the row's weight, the second the sum over columns of each column's sum times the column's
weight, a weight being the row's (column's) index in the full tensor modulo a prime, plus one; both modulo 2**64.
Integer addition modulo 2**64 gives the same bits in any order, and both sums are sums over rows, so each rank
sums the rows it holds and one all-reduce (replicas of a hybrid mesh, and all ranks but global rank 0 for
buffers, add zeros) gives every rank the full tensor's fingerprint, however its rows are spread. Values that
differ agree on both words only by a coincidence; the weights tell the same values in other rows or other
columns apart (rows moved, a transpose). Each word is one reduction over the rank's rows, accumulated in 64 bits
without a widened copy: a save or a check reads each weight once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.engine.param_shard import ShardedParam

_POSITION_MODULUS = 1_000_003  # a prime: the weights repeat only every million rows (columns)
_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Fingerprint = str  # 32 hexadecimal digits: the two words, as the checkpoint index stores them


def local_fingerprint(values: Tensor, first_row: int) -> Tensor:
    """The two words (int64) of ``values``, rows of a tensor starting at row ``first_row`` of the full tensor (a
    0-dim tensor is one row of one column; see [Note: fingerprints that do not depend on the world size])."""
    rows = values.detach().reshape(values.shape[0] if values.dim() else 1, -1)
    if rows.dtype.is_complex or rows.element_size() > 8:
        rows = torch.view_as_real(rows).reshape(rows.shape[0], -1) if rows.dtype.is_complex else rows
    rows = rows.contiguous()
    width = rows.element_size()
    bits = rows.view(torch.uint8).view(_INTEGER_OF_WIDTH[width]) if width in _INTEGER_OF_WIDTH else rows
    device = bits.device
    row_weight = torch.arange(first_row, first_row + bits.shape[0], device=device).remainder_(_POSITION_MODULUS)
    column_weight = torch.arange(bits.shape[1], device=device).remainder_(_POSITION_MODULUS)
    words = torch.empty(2, dtype=torch.int64, device=device)
    words[0] = (bits.sum(dim=1, dtype=torch.int64) * row_weight.add_(1)).sum()
    words[1] = (bits.sum(dim=0, dtype=torch.int64) * column_weight.add_(1)).sum()
    return words


def fingerprints(
    params: Sequence[ShardedParam], buffers: Sequence[Tensor], replicate_rank: int, device: torch.device
) -> list[Fingerprint]:
    """The fingerprint of each parameter (this rank holding its rows) and each buffer (every rank holding it
    whole), in order. Collective over all ranks: one all-reduce."""
    if not params and not buffers:
        return []
    global_rank = dist.get_rank() if dist.is_initialized() else 0
    none = torch.zeros(2, dtype=torch.int64, device=device)
    words = [
        local_fingerprint(p.sharded, p.first_row).to(device)
        if replicate_rank == 0 and p.local_rows > 0 else none
        for p in params
    ]
    words += [local_fingerprint(b, 0).to(device) if global_rank == 0 else none for b in buffers]
    table = torch.stack(words)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)  # a sum: see the note
    return [f"{a & 0xFFFFFFFFFFFFFFFF:016x}{b & 0xFFFFFFFFFFFFFFFF:016x}" for a, b in table.tolist()]
