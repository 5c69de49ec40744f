"""The memory a training step borrows and gives back, kept between uses.

[Note: the buffer pool]
A step needs the same buffers again and again: every unit's unsharded weights (at most two or
three units at once), the receive buffer of each gradient reduction, the staging of a cast or an
upload. Allocating them anew each time is cheap on a GPU (PyTorch's caching allocator keeps freed
blocks) but not on a CPU: blocks this large are ``mmap``-ed by glibc and returned with ``munmap``
when freed, so every refill touches fresh pages, and the kernel spends more time faulting and
zeroing them than the step spends computing (at a billion parameters, most of the step).

``BufferPool`` keeps every block it hands out, by device and size, and hands a free one out again
before it allocates. It grows only to what is in use at the same time: two units' unsharded
buffers, the reductions' receive buffers, the staging.

The pool must not raise the step's peak, which comes at the end of backward (the shards' gradients
and the optimizer state are all there). The old way, the block of the last-but-one unit of backward
went back to the allocator while the last unit ran; a pool that kept it would hold it idle right at
the peak. So during backward a block goes back to the allocator when no unit still to run in this
backward needs one of its size and another unit of its size still holds one (``ShardedModule``
decides, knowing the order). What stays are the blocks of the last unit of each size and the
gradient memory, through the optimizer step (below the peak) into the next forward, which takes
them back and allocates one block per size anew: a few blocks a step instead of one per unit per
gather, and the same peak.

A unit's unsharded buffer must keep its identity: autograd holds views of it from forward to
backward, and the backward gather must land in the storage those views see. So the pool does not
hand it a new tensor: ``fill`` moves a block's memory into the unit's (empty) storage, and
``drain`` moves it back out, leaving the storage empty as ``resize_(0)`` would. Every view of the
storage follows the memory it holds; nothing else changes. Temporary buffers (a reduction's
receive buffer, the cast staging, a rank-major gather on NCCL) are ``take``-n as tensors and
``give``-n back once the collective that used them has completed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_shard.engine.torch_compat import STORAGES_SWAP_MEMORY


class BufferPool:
    """Free memory blocks by (device, bytes); ``allocations`` counts the blocks it ever had to allocate."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.device, int], list[Tensor]] = {}  # each block: 1D uint8
        self.allocations = 0
        self.allocated_bytes = 0

    def take(self, nbytes: int, device: torch.device) -> Tensor:
        """A 1D ``uint8`` tensor of ``nbytes`` on ``device`` (uninitialised), free until ``give``-n back."""
        free = self._free.get((_canonical(device), nbytes))
        if free:
            return free.pop()
        self.allocations += 1
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, block: Tensor) -> None:
        """Take back a block from ``take`` (or any tensor whose whole storage nobody else reads any more)."""
        storage = block.untyped_storage()
        if storage.nbytes() == 0:
            return
        whole = torch.empty(0, dtype=torch.uint8, device=block.device).set_(storage)
        self._free.setdefault((_canonical(block.device), storage.nbytes()), []).append(whole)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory (contents undefined): every view of it now reads it."""
        if storage.nbytes() == nbytes:
            return  # already filled
        if storage.nbytes() != 0:
            raise RuntimeError(f"BufferPool.fill needs an empty storage, got one of {storage.nbytes()} bytes")
        if not STORAGES_SWAP_MEMORY:  # torch before 2.13: see torch_compat
            storage.resize_(nbytes)
            return
        block = self.take(nbytes, storage.device)
        _swap_memory(storage, block.untyped_storage())  # the block is left empty and dropped

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Move ``storage``'s memory back into the pool, leaving it empty (as ``resize_(0)`` would)."""
        if storage.nbytes() == 0:
            return
        if not STORAGES_SWAP_MEMORY:  # torch before 2.13: see torch_compat
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        _swap_memory(holder, storage)
        self.give(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(holder))

    @property
    def free_bytes(self) -> int:
        """Bytes held for reuse now (not handed out)."""
        return sum(block.numel() for blocks in self._free.values() for block in blocks)

    def release_free(self, nbytes: int, device: torch.device) -> None:
        """Release the free blocks of ``nbytes`` on ``device`` to the allocator."""
        self._free.pop((_canonical(device), nbytes), None)

    def clear(self) -> None:
        """Release the free blocks to the allocator (the next ``take`` of each size allocates again)."""
        self._free.clear()


def _swap_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (pointer and size) of two storages; every tensor viewing either follows its storage."""
    a._swap_data_ptr_(b)  # type: ignore[attr-defined]


def _canonical(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:0`` are one device: key blocks by the index tensors report."""
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device
