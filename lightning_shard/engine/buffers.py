"""Buffers are not sharded: every rank holds all of them. They are synced at set-up and, during training, follow
DDP (see [Note: buffers follow DDP] on ``BufferSync``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from lightning_shard.engine import collectives


def materialize_and_sync_buffers(root: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Move buffers to ``device`` (floating ones to ``dtype``), and make every rank hold rank 0's values.

    A buffer registered in several modules (the same tensor) stays one tensor: it is moved once and every module
    gets the moved tensor.
    """
    moved: dict[int, Tensor] = {}  # id of the original buffer -> the tensor every module holding it gets
    for module in root.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if id(buf) in moved:
                module._buffers[name] = moved[id(buf)]
                continue
            if buf.is_meta:
                raise TypeError(
                    f"Buffer {name!r} of {type(module).__name__} is still on the meta device after"
                    f" reset_parameters(); initialise it there, or create it on a real device."
                )
            target = dtype if dtype is not None and buf.is_floating_point() else buf.dtype
            new = buf.to(device=device, dtype=target) if buf.device != device or buf.dtype != target else buf
            moved[id(buf)] = module._buffers[name] = new
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        _broadcast_from_rank0_coalesced(_unique_buffers(root.modules()))


class BufferSync:
    """When the model's buffers are overwritten with global rank 0's during training, as DDP does.

    [Note: buffers follow DDP]
    Buffers are not sharded: every rank holds all of them. DDP (``broadcast_buffers``, since torch
    2.13 ``forward_sync_buffers``, on by default) broadcasts rank 0's buffers at the start of its first
    forward and of every forward that follows one run with gradients enabled outside ``no_sync()``,
    whether or not the new one has gradients. So during training each rank's BatchNorm statistics are
    rank 0's from the step before, updated with this rank's own batch; the first validation forward
    after a training step broadcasts, so every rank validates with rank 0's statistics; the forward
    after an evaluation forward, or after a micro-batch whose gradients are not synchronised,
    broadcasts nothing. Checkpoints hold rank 0's buffers, which every rank loads. The engine makes
    the same decision at every outermost forward of the root: one broadcast per device of all buffers'
    bytes packed together (float statistics and the int64 ``num_batches_tracked`` alike, a buffer held
    by several modules once), and nothing when the model has no buffers or runs on one rank.
    ``accumulating`` stands for ``no_sync()``: the front end sets it for micro-batches that do not end
    an accumulation window, whether or not it holds their gradients back. Set-up broadcasts too, as
    DDP's does (``shard_module``, or the strategy when it is given a model sharded before).
    """

    def __init__(self, root: nn.Module, world_size: int) -> None:
        self.enabled = True  # ShardStrategy(broadcast_buffers=...)
        self.accumulating = False  # inside a micro-batch that does not end an accumulation window
        self._due = True  # whether the next outermost root forward starts with a broadcast
        self._world_size = world_size
        self._owners = [m for m in root.modules() if any(b is not None for b in m._buffers.values())]

    def before_root_forward(self) -> None:
        """Called as the outermost root forward starts: broadcast if due; decide whether the next one is due."""
        due, self._due = self._due, torch.is_grad_enabled() and not self.accumulating
        if due and self.enabled:
            self.broadcast()

    def broadcast(self) -> None:
        """Overwrite every buffer with global rank 0's (collective; nothing with one rank or no buffers)."""
        if self._owners and self._world_size > 1:
            _broadcast_from_rank0_coalesced(_unique_buffers(self._owners))


def _unique_buffers(modules: Iterable[nn.Module]) -> list[Tensor]:
    """The buffers of ``modules`` (their own, not their children's), each tensor once."""
    seen: dict[int, Tensor] = {}
    for module in modules:
        for buf in module._buffers.values():
            if buf is not None:
                seen.setdefault(id(buf), buf)
    return list(seen.values())


def _broadcast_from_rank0_coalesced(buffers: list[Tensor]) -> None:
    """Overwrite ``buffers`` on every rank with global rank 0's values: one broadcast per device, of every buffer's
    bytes packed into one flat ``uint8`` tensor, whatever their dtypes."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for buf in buffers:
        by_device.setdefault(buf.device, []).append(buf)
    is_source = torch.distributed.get_rank() == 0
    with torch.no_grad():
        for device, bufs in by_device.items():
            if is_source:
                flat = torch.cat([buf.reshape(-1).view(torch.uint8) for buf in bufs])
            else:
                flat = torch.empty(sum(buf.nbytes for buf in bufs), dtype=torch.uint8, device=device)
            collectives.broadcast_from_rank0(flat)
            if is_source:
                continue
            # As DDP does: a graph that saved a buffer for backward (BatchNorm in eval mode) before the
            # broadcast does not fail its version check in backward.
            with torch.autograd._unsafe_preserve_version_counter(tuple(bufs)):
                for buf, piece in zip(bufs, flat.split([buf.nbytes for buf in bufs])):
                    if buf.is_contiguous():
                        buf.view(-1).view(torch.uint8).copy_(piece)
                    else:  # a strided view: reinterpret an aligned copy of its bytes
                        buf.copy_(piece.clone().view(buf.dtype).view(buf.shape))
