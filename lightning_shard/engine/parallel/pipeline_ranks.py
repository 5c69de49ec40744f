"""This rank's place in its pipeline group: what the schedule, the tied weights, the gradient norm and a save
need to know of the pipeline's ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class PipelineRanks:
    """This rank's place in its pipeline group: the ranks of one data x context x tensor coordinate, one per
    stage, in stage order."""

    group: ProcessGroup
    size: int
    stage: int
    global_ranks: list[int]
    # ids of this stage's sharded parameters an earlier stage holds too (tied): counted there by the gradient norm
    # and written there by a save (see [Note: weights tied across stages])
    held_earlier: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, device_mesh: DeviceMesh) -> PipelineRanks:
        """The pipeline ranks of a 1-D mesh (``device_mesh["pipeline_parallel"]``)."""
        group = device_mesh.get_group()
        return cls(group, device_mesh.size(), device_mesh.get_local_rank(), dist.get_process_group_ranks(group))

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1
