"""This rank's place in its pipeline group: what the schedule, the tied weights, the gradient norm and a save
need to know of the pipeline's ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed import ProcessGroup


@dataclass
class PipelineRanks:
    """This rank's place in its pipeline group (built by ``ParallelDims.build``): the ranks of one data x context x
    tensor coordinate, one per stage, in stage order."""

    group: ProcessGroup
    size: int
    stage: int
    global_ranks: list[int]
    # ids of this stage's sharded parameters an earlier stage holds too (tied): counted there by the gradient norm
    # and written there by a save (see [Note: weights tied across stages])
    held_earlier: set[int] = field(default_factory=set)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1
