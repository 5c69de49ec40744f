"""The named choices of the sharding options: one enum per option that picks among named values.

Each member's value is the string a user writes (in Python, in any letter case; in a LightningCLI YAML file as
listed), and each enum's ``parse`` takes a member or such a string and refuses anything else with ``ValueError``
naming the option and the valid values. They sit at the bottom of the layers, importing nothing of the package, so
that the engine, the checkpoint layer and both front ends read the same members.
"""

from __future__ import annotations

import enum
import re
from typing import Literal

from typing_extensions import Self

ShardingStrategyName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]


class OptionChoice(enum.Enum):
    """The named values of one option, the class name in snake case (``GradSync``: ``grad_sync``)."""

    @classmethod
    def parse(cls, value: Self | str) -> Self:
        """The member ``value`` is or names (in any case); anything else raises ``ValueError`` naming the option and
        the valid values."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value.lower() == value.lower():
                    return member
        option = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"Unknown {option} {value!r}. Valid values are: {valid}.")


class ShardingStrategy(OptionChoice):
    """How parameters, gradients and optimizer state are split across ranks.

    - ``FULL_SHARD`` (ZeRO-3): everything sharded; a unit's weights are gathered for its forward,
      freed after it, and gathered again for its backward.
    - ``SHARD_GRAD_OP`` (ZeRO-2): like ``FULL_SHARD`` but a unit's weights stay gathered from its
      forward to its backward (one all-gather per unit per step, more memory).
    - ``NO_SHARD``: replicated, gradients all-reduced (DDP).
    - ``HYBRID_SHARD``: ``FULL_SHARD`` inside groups of ``shard_size`` ranks, replicated across
      ``replicas`` groups (``device_mesh=(replicas, shard_size)``).
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"

    @property
    def reshards_after_forward(self) -> bool:
        """Whether a unit's gathered weights are freed right after its forward (and gathered again for backward)."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class GradSync(OptionChoice):
    """When gradients are reduced while ``accumulate_grad_batches`` > 1.

    - ``MICROBATCH``: reduce-scatter after every micro-batch and accumulate into the sharded
      gradients: gradient memory stays sharded, one reduction per unit per micro-batch.
    - ``STEP``: accumulate full gradients locally and reduce-scatter once per optimizer step:
      one reduction per unit per step, but full-size gradients are held between micro-batches.
    """

    MICROBATCH = "microbatch"
    STEP = "step"


class ParamInit(OptionChoice):
    """How parameters built on the meta device get their first values when the model is sharded.

    - ``RESET_PARAMETERS``: each owning module's ``reset_parameters()`` runs on its unit, materialised in full
      one unit at a time (modules without one leave their parameters uninitialised until loaded).
    - ``EMPTY``: nothing is initialised and no unit is materialised in full: every meta-device parameter is an
      uninitialised shard until a load fills it, and a forward before that raises naming what is missing. For
      models whose weights are about to be loaded (fine-tuning): it saves the time of initialising and keeps
      the import's memory at this rank's shards. See [Note: parameters nothing initialises].
    """

    RESET_PARAMETERS = "reset_parameters"
    EMPTY = "empty"


class CpuAllocator(OptionChoice):
    """What sharding a module on CPU does to the process's C allocator (see [Note: the CPU allocator])."""

    REUSE = "reuse"  # keep large freed blocks in the heap for the next request of the step
    SYSTEM = "system"  # leave the allocator as the process has it


class StateDictType(OptionChoice):
    """How ``trainer.save_checkpoint`` lays out model and optimizer tensors."""

    SHARDED = "sharded"  # every rank writes its own rows; loads at any world size
    FULL = "full"  # gathered one tensor at a time and streamed by rank 0 into model/optimizer.safetensors


class SavedParameters(enum.Enum):
    """Which of the model's parameters a save writes (a filter may leave more out)."""

    ALL = "all"
    TRAINABLE = "trainable"  # those that require grad (save_trainable_only=True)


class PipelineSchedule(str, enum.Enum):
    """The order in which each stage runs its microbatches' forwards and backwards."""

    GPIPE = "gpipe"
    """Every microbatch forward, then every backward; each stage holds all ``M`` microbatches' activations."""
    ONE_F_ONE_B = "1F1B"
    """After ``P - s - 1`` warm-up forwards, stage ``s`` alternates one forward and one backward; see [Note: the
    whole output on every rank] for the forward it repeats."""

    @classmethod
    def parse(cls, value: str | PipelineSchedule) -> PipelineSchedule:
        for member in cls:
            if value == member or (isinstance(value, str) and value.lower() == member.value.lower()):
                return member
        offered = ", ".join(repr(m.value) for m in cls)
        if isinstance(value, str) and value.lower().replace("_", "") in _SCHEDULES_OF_SEVERAL_STAGES_PER_RANK:
            raise ValueError(
                f"pipeline_schedule={value!r} runs several stages on each rank, and each rank holds one stage here:"
                f" use one of {offered} (more microbatches shrink their bubble)."
            )
        raise ValueError(f"pipeline_schedule must be one of {offered}, got {value!r}.")


# torch.distributed.pipelining's and torchtitan's names of schedules that hold several stages per rank
_SCHEDULES_OF_SEVERAL_STAGES_PER_RANK = {"interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble",
                                         "dualpipev"}  # fmt: skip
