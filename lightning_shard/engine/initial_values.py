"""Every rank starts from global rank 0's initial values, as with DDP, without sending the values that agree.

[Note: initial values agree with rank 0]
DDP broadcasts rank 0's parameters when it wraps a model, so every rank starts from rank 0's weights,
whatever it built. The engine keeps that guarantee without broadcasting every full parameter. Each rank
materialises a unit (one at a time) and initialises it itself, as rank 0 does; ranks seeded alike
(Lightning's ``seed_everything``, or the same ``torch.manual_seed``) draw the same values. Every rank then
computes a checksum of each full tensor of the unit, and one all-reduce of the unit's checksums (the
maximum of ``c`` and of ``~c``, the bitwise complement, whose maximum is the complement of the minimum of
``c``) tells every rank which tensors are the same on every rank. Only a tensor that differs somewhere is
broadcast from rank 0, as before: ranks that built or seeded their models differently still start from
rank 0's weights, at the old cost.

The checksum of a tensor is two 64-bit integers: its bytes read as 64-bit words and summed modulo 2**64
(integer addition in any order gives the same bits, so every rank computes the same sum for the same
bytes), and the sum of 64 block sums weighted by the block's position, so that the same values in another
place (rows moved, blocks swapped) are told apart too. Values that differ any other way agree on both
words only by a coincidence of odds about 2**-64.

What it saves: a checksum reads each value once (about 10 ms for 200 MB on one core), where a broadcast
moves every full tensor to every other rank and needs a copy of it; set-up no longer grows with the world
size (measured in docs/benchmarks.md, "Scaling the world size (simulated)").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_shard.engine import collectives

_BLOCKS = 64  # position-weighted blocks per tensor in the second checksum word


def values_of_rank0(tensors: list[Tensor], device: torch.device, group: ProcessGroup | None = None) -> list[Tensor]:
    """``tensors`` as rank 0 of ``group`` holds them (``None``: all ranks, global rank 0; under tensor parallelism the
    data-parallel ranks of one column). Collective over the group: one all-reduce of checksums, and a broadcast (on
    ``device``) for each tensor that is not the same on every rank. A tensor that agrees comes back as it is (the
    caller must not overwrite it in place); one that was broadcast is a new tensor on ``device``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not tensors:
        return tensors
    sums = torch.stack([checksum(t) for t in tensors]).to(device)  # (k, 2)
    # ~c = -c - 1 reverses the order of int64 without overflow: the maximum of ~c is ~(the minimum of c).
    extremes = torch.cat([sums, torch.bitwise_not(sums)])
    collectives.all_reduce_max(extremes, group)
    agrees = (extremes[: len(tensors)] == torch.bitwise_not(extremes[len(tensors) :])).all(dim=1).tolist()
    return [t if same else _broadcast_from_rank0(t, device, group) for t, same in zip(tensors, agrees)]


def checksum(tensor: Tensor) -> Tensor:
    """Two int64 words of ``tensor``'s bytes: their sum as 64-bit words modulo 2**64, and the position-weighted sum
    of ``_BLOCKS`` block sums (see [Note: initial values agree with rank 0])."""
    data = tensor.detach()
    if not data.is_contiguous() or data.storage_offset() * data.element_size() % 8:  # not readable as 64-bit words
        data = data.clone(memory_format=torch.contiguous_format)
    raw = data.reshape(-1).view(torch.uint8)
    words = raw.numel() // 8
    body = raw[: words * 8].view(torch.int64)
    tail = raw[words * 8 :].to(torch.int64)  # fewer than 8 bytes, one word each
    per_block = words // _BLOCKS
    blocks = body[: per_block * _BLOCKS].view(_BLOCKS, per_block).sum(1)  # wraps modulo 2**64, like every sum here
    rest = body[per_block * _BLOCKS :].sum() + tail.sum()
    total = blocks.sum() + rest
    weighted = (blocks * torch.arange(1, _BLOCKS + 1, dtype=torch.int64, device=blocks.device)).sum() + rest * (
        _BLOCKS + 1
    )
    return torch.stack([total, weighted])


def _broadcast_from_rank0(full: Tensor, device: torch.device, group: ProcessGroup | None) -> Tensor:
    on_device = full.detach().to(device).contiguous()
    if on_device.data_ptr() == full.data_ptr():
        on_device = on_device.clone()  # never overwrite the caller's tensor
    collectives.broadcast_from_rank0(on_device, group)
    return on_device
