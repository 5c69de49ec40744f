"""Fingerprints of a sharded model's tensors that are the same whatever world size, mesh or wrap holds them.

[Note: fingerprints that do not depend on the world size]
A checkpoint that holds only some of a model's tensors (``save_trainable_only``, ``fabric.save(filter=...)``)
relies on the others being restored from where they came from, e.g. a pretrained import. It records a
fingerprint of each tensor it leaves out, and a load checks, before the next forward, that those tensors hold
the values they held at the save; a job resumed on another world size must compute the same fingerprint.

The fingerprint of a tensor is two 64-bit integers: the sum of its elements' bit patterns (each read as an
integer of the element's width), and the sum of each bit pattern times a weight given by the element's position
in the full tensor (its flat index modulo a prime, plus one), both modulo 2**64. Integer addition modulo 2**64
gives the same bits in any order, so each rank sums the rows it holds and one all-reduce (replicas of a hybrid
mesh, and all ranks but global rank 0 for buffers, add zeros) gives every rank the full tensor's fingerprint,
however its rows are spread. Values that differ agree on both words only by a coincidence of odds about 2**-64;
the position weight tells the same values in other places apart (rows moved, a transpose).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shard.engine.param_shard import ShardedParam

_POSITION_MODULUS = 1_000_003  # a prime: the position weights repeat only every million elements
_CHUNK_ELEMENTS = 1 << 22  # elements widened to 64 bits at a time: bounded extra memory
_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Fingerprint = str  # 32 hexadecimal digits: the two words, as the checkpoint index stores them


def local_fingerprint(values: Tensor, first_element: int) -> Tensor:
    """The two words (int64) of ``values``, a run of elements of a tensor starting at flat index ``first_element``
    of the full tensor (see [Note: fingerprints that do not depend on the world size])."""
    flat = values.detach().contiguous().reshape(-1)
    width = min(8, flat.element_size())
    per_element = flat.element_size() // width  # complex128: two 64-bit words an element
    bits = flat.view(torch.uint8).view(_INTEGER_OF_WIDTH[width])
    first = first_element * per_element
    words = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK_ELEMENTS):
        chunk = bits[start : start + _CHUNK_ELEMENTS].to(torch.int64, copy=True)  # never the tensor itself
        position = torch.arange(first + start, first + start + chunk.numel(), device=flat.device)
        weight = position.remainder_(_POSITION_MODULUS).add_(1)
        words[0] += chunk.sum()
        words[1] += chunk.mul_(weight).sum()
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
        local_fingerprint(p.sharded, p.first_row * p.row_numel).to(device)
        if replicate_rank == 0 and p.local_rows > 0 else none
        for p in params
    ]
    words += [local_fingerprint(b, 0).to(device) if global_rank == 0 else none for b in buffers]
    table = torch.stack(words)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)  # a sum: see the note
    return [f"{a & 0xFFFFFFFFFFFFFFFF:016x}{b & 0xFFFFFFFFFFFFFFFF:016x}" for a, b in table.tolist()]
