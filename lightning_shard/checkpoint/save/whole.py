"""What one shard of a sharded save writes: its rows of the tensors split by rows, the tensors it stores whole, and
(shard 0) the tensors every shard holds alike; and the exchange that gives each shard the rows of the tensors it
stores whole (see [Note: small tensors stored whole] in ``io/layout.py``).

``shard_file_tensors`` decides a shard's file from what it holds, for a real save (``_ShardedWriter``, whose
``gather`` is ``exchange_rows``) and for ``testing_checkpoints.simulate_save`` (whose ``gather`` takes the rows from
the full tensors) alike, so that both write the same files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.checkpoint.io.layout import rows_per_shard, shard_rows, splits_by_rows, whole_owners

# (key, this shard's rows of the tensor, the tensor's global shape), for each tensor a shard holds rows of; or (key,
# tensor, None) for a tensor every shard holds alike (buffers, scalar optimizer state)
Held = tuple[str, Tensor, tuple[int, ...] | None]
Rows = tuple[str, Tensor, tuple[int, ...]]  # a ``Held`` tensor held by rows
# (key, tensor, its rows or None when stored whole): what a shard file holds, in its order
Local = list[tuple[str, Tensor, tuple[int, int] | None]]
# the tensors stored whole (as ``Held``) and their owners -> this shard's of them, whole
Gather = Callable[[Sequence[Rows], dict[str, int]], dict[str, Tensor]]


def shard_file_tensors(held: Sequence[Held], shard: int, shard_size: int, gather: Gather) -> Local:
    """What shard ``shard`` of ``shard_size`` writes, from what it holds (``held``, in the order its file keeps):
    its rows of each tensor split by rows, each tensor it stores whole (``gather`` gives it them), and, on shard 0,
    the tensors every shard holds alike. ``gather`` is called once, on every shard (a collective in a real save)."""
    whole = [(key, rows, shape) for key, rows, shape in held
             if shape is not None and not splits_by_rows(shape, rows.dtype, shard_size)]
    owners = whole_owners([(key, math.prod(shape) * rows.element_size()) for key, rows, shape in whole], shard_size)
    gathered = gather(whole, owners)
    out: Local = []
    for key, tensor, shape in held:
        if shape is None:
            if shard == 0:
                out.append((key, tensor, None))
        elif key in owners:
            if owners[key] == shard:
                out.append((key, gathered[key], None))
        else:
            lo, hi = shard_rows(shape[0] if shape else 1, shard_size, shard)
            if hi > lo:
                out.append((key, tensor, (lo, hi)))
    return out


def exchange_rows(
    whole: Sequence[Rows], owners: dict[str, int], shard: int, shard_size: int, group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[str, Tensor]:
    """The tensors of ``whole`` that shard ``shard`` stores (``owners``), whole, on the CPU: every shard sends each
    owner its rows of the owner's tensors, padded to ``ceil(rows / shard_size)`` rows, in one all-to-all over the shard
    group (bytes on ``device``, the device the group communicates on). Collective over the shard group."""
    if shard_size == 1:
        return {key: rows.detach().reshape(shape).cpu().clone() for key, rows, shape in whole}
    sizes = {key: rows_per_shard(shape[0] if shape else 1, shard_size) * math.prod(shape[1:]) * rows.element_size()
             for key, rows, shape in whole}
    outgoing: list[list[Tensor]] = [[] for _ in range(shard_size)]
    for key, rows, _ in whole:
        padded = torch.zeros(sizes[key], dtype=torch.uint8, device=device)
        data = rows.detach().contiguous().reshape(-1).view(torch.uint8)
        padded[: data.numel()].copy_(data)
        outgoing[owners[key]].append(padded)
    send = torch.cat([t for ts in outgoing for t in ts]) if whole else torch.empty(0, dtype=torch.uint8, device=device)
    mine = [(key, rows, shape) for key, rows, shape in whole if owners[key] == shard]
    each = sum(sizes[key] for key, _, _ in mine)  # what every shard sends this one
    received = torch.empty(shard_size * each, dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, send, [each] * shard_size, [sum(t.numel() for t in ts) for ts in outgoing],
                           group=group)
    by_shard = received.cpu().view(shard_size, each)
    out: dict[str, Tensor] = {}
    at = 0
    for key, rows, shape in mine:
        nbytes = math.prod(shape) * rows.element_size()
        data = by_shard[:, at : at + sizes[key]].reshape(-1)[:nbytes]  # shard by shard: the rows in order
        out[key] = data.clone().view(rows.dtype).reshape(shape)
        at += sizes[key]
    return out
