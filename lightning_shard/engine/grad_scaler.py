"""``ShardedGradScaler``: fp16 loss scaling whose inf/nan check every rank agrees on."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.engine import collectives


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf/nan check is agreed by all ranks in one all-reduce.

    Each rank sees only its shards of the gradients, so an overflow shows up on the rank that holds
    those rows; taking the maximum over ranks makes every rank skip the same steps and keep the same scale.
    """

    @override
    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        comm_device = self._scale.device if self._scale is not None else torch.device(self._device)
        if not per_device:  # this rank holds no gradient rows: it still votes
            per_device[comm_device] = torch.zeros(1, device=comm_device)
        found = torch.stack([v.reshape(()).to(comm_device) for v in per_device.values()]).max().reshape(1)
        collectives.all_reduce_max(found, None)  # on the scaler's device: gradients may live in CPU memory
        for v in per_device.values():
            v.copy_(found.reshape(v.shape))
