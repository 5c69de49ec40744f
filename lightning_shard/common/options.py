"""The sharding arguments both front ends take, with the same names, defaults and validation.

``ShardStrategy`` for the ``Trainer`` and for ``Fabric`` accept exactly these arguments (besides Lightning's
own: accelerator, devices, cluster environment, precision, checkpoint IO). Each is checked when the strategy
is constructed, on every rank, before any process group exists, so a bad value can never leave a rank
waiting in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_deprecation
from torch import nn

from lightning_shard.checkpoint.io.selection import SavedParameters
from lightning_shard.checkpoint.save.directory import StateDictType
from lightning_shard.common.fsdp_compat import (
    check_fsdp_flags,
    cpu_offload_flag,
    mixed_precision_from_torch,
    sharding_strategy_name,
)
from lightning_shard.engine.cpu_allocator import CpuAllocator
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.parallel.pipeline import PipelineSchedule
from lightning_shard.engine.policies import (
    GradSync,
    ParamInit,
    ShardingStrategy,
    ShardingStrategyName,
    WrapPolicy,
    WrapPolicySpec,
    resolve_wrap_policy,
)

if TYPE_CHECKING:
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

DEFAULT_TIMEOUT = timedelta(minutes=10)  # long enough for a slow checkpoint write between two collectives, short
# enough that a stalled rank is named within minutes rather than after torch's 30 (gloo) or a silent hang


@dataclass(frozen=True)
class ShardOptions:
    """The validated sharding arguments of a ``ShardStrategy`` (see the strategy's docstring for each)."""

    sharding_strategy: ShardingStrategy
    wrap_policy: WrapPolicy | None
    device_mesh: tuple[int, int] | None
    mixed_precision: MixedPrecision | None
    checkpointing_policy: WrapPolicy | None
    grad_sync: GradSync
    state_dict_type: StateDictType
    saved_parameters: SavedParameters  # save_trainable_only: see [Note: weights a checkpoint leaves out]
    cpu_offload: bool
    broadcast_buffers: bool
    param_init: ParamInit
    cpu_allocator: CpuAllocator
    timeout: timedelta  # how long any rank waits in one collective before StalledRanksError
    process_group_backend: str | None
    tensor_parallel_size: int = 1  # see [Note: the data-parallel ranks under tensor parallelism]
    data_parallel_size: int | None = None  # None: "auto", the world size / (context x tensor_parallel_size)
    context_parallel_size: int = 1  # see lightning_shard.engine.parallel.context
    pipeline_parallel_size: int = 1  # see lightning_shard.engine.parallel.pipeline
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    microbatches: int | None = None  # None: pipeline_parallel_size
    pipeline_split_points: tuple[str, ...] | None = None  # None: blocks split evenly

    @classmethod
    def parse(
        cls,
        *,
        auto_wrap_policy: WrapPolicySpec = None,
        sharding_strategy: ShardingStrategyName | ShardingStrategy | TorchShardingStrategy = "FULL_SHARD",
        device_mesh: tuple[int, int] | None = None,
        mixed_precision: MixedPrecision | TorchMixedPrecision | None = None,
        activation_checkpointing_policy: WrapPolicySpec = None,
        activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
        grad_sync: Literal["microbatch", "step"] | GradSync = "microbatch",
        state_dict_type: Literal["sharded", "full"] | StateDictType = "sharded",
        save_trainable_only: bool = False,
        cpu_offload: bool | CPUOffload = False,
        broadcast_buffers: bool = True,
        param_init: Literal["reset_parameters", "empty"] | ParamInit = "reset_parameters",
        cpu_allocator: Literal["reuse", "system"] | CpuAllocator = "reuse",
        timeout: timedelta | None = None,
        process_group_backend: str | None = None,
        use_orig_params: bool = True,
        limit_all_gathers: bool = True,
        sync_module_states: bool = True,
        tensor_parallel_size: int = 1,
        data_parallel_size: int | Literal["auto"] = "auto",
        context_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: Literal["1F1B", "gpipe"] | PipelineSchedule = "1F1B",
        microbatches: int | None = None,
        pipeline_split_points: list[str] | None = None,
    ) -> ShardOptions:
        """Check every argument; raise ``TypeError``/``ValueError`` naming the argument and the valid values.

        PyTorch FSDP's forms of the arguments Lightning's ``FSDPStrategy`` takes (a ``ShardingStrategy`` member, a
        ``CPUOffload``, a ``MixedPrecision``, ``use_orig_params``/``limit_all_gathers``/``sync_module_states``) are
        translated where they mean exactly what ours do, and refused otherwise (``common.fsdp_compat``)."""
        check_fsdp_flags(
            use_orig_params=use_orig_params, limit_all_gathers=limit_all_gathers, sync_module_states=sync_module_states
        )
        activation_checkpointing_policy = _checkpointing_policy(
            activation_checkpointing, activation_checkpointing_policy
        )
        cpu_offload = cpu_offload_flag(cpu_offload)
        mixed_precision = mixed_precision_from_torch(mixed_precision, has_wrap_policy=auto_wrap_policy is not None)
        if not isinstance(cpu_offload, bool):
            raise TypeError(
                f"cpu_offload must be True or False, got {cpu_offload!r} (PyTorch's CPUOffload(offload_params=...) is"
                " taken too)."
            )
        if not isinstance(save_trainable_only, bool):
            raise TypeError(f"save_trainable_only must be True or False, got {save_trainable_only!r}.")
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}.")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(
                "mixed_precision must be a lightning_shard.MixedPrecision (or None), or PyTorch FSDP's MixedPrecision;"
                f" got {type(mixed_precision).__name__}. For the usual cases pass a precision string instead"
                " (precision='bf16-mixed' on the Trainer or Fabric)."
            )
        strategy = ShardingStrategy.parse(sharding_strategy_name(sharding_strategy))
        context_parallel_size = _positive_int(context_parallel_size, "context_parallel_size")
        if context_parallel_size > 1 and activation_checkpointing_policy is not None:
            raise ValueError(
                f"context_parallel_size={context_parallel_size} with activation checkpointing is not supported: the"
                " recomputation in backward runs the attention outside the step that makes it see the whole"
                " sequence. Drop activation_checkpointing_policy, or use context_parallel_size=1."
            )
        pipeline = _pipeline_options(
            pipeline_parallel_size, pipeline_schedule, microbatches, pipeline_split_points, auto_wrap_policy,
            sharding_strategy=strategy,
        )  # fmt: skip
        return cls(
            sharding_strategy=strategy,
            wrap_policy=resolve_wrap_policy(auto_wrap_policy),
            device_mesh=_check_mesh_fits_strategy(_parse_device_mesh(device_mesh), strategy),
            mixed_precision=mixed_precision,
            checkpointing_policy=resolve_wrap_policy(
                activation_checkpointing_policy, "activation_checkpointing_policy"
            ),
            grad_sync=GradSync.parse(grad_sync),
            state_dict_type=StateDictType.parse(state_dict_type),
            saved_parameters=SavedParameters.TRAINABLE if save_trainable_only else SavedParameters.ALL,
            cpu_offload=cpu_offload,
            broadcast_buffers=broadcast_buffers,
            param_init=ParamInit.parse(param_init),
            cpu_allocator=CpuAllocator.parse(cpu_allocator),
            timeout=_parse_timeout(timeout),
            process_group_backend=_parse_backend(process_group_backend),
            tensor_parallel_size=_positive_int(tensor_parallel_size, "tensor_parallel_size"),
            data_parallel_size=None if data_parallel_size == "auto" else _positive_int(
                data_parallel_size, "data_parallel_size", "or 'auto'"
            ),
            context_parallel_size=context_parallel_size,
            **pipeline,
        )


def _pipeline_options(
    size: object, schedule: object, microbatches: object, split_points: object, auto_wrap_policy: object, *,
    sharding_strategy: ShardingStrategy,
) -> dict[str, Any]:  # fmt: skip
    """The pipeline arguments, checked: the stages are whole blocks by ``auto_wrap_policy`` (classes or names; none:
    the model's repeated blocks, found at set-up), and what pipeline parallelism does not compose with yet is
    refused, naming it."""
    size = _positive_int(size, "pipeline_parallel_size")
    parsed = PipelineSchedule.parse(schedule)  # type: ignore[arg-type]
    count = None if microbatches is None else _positive_int(microbatches, "microbatches")
    if split_points is not None and not (
        isinstance(split_points, (list, tuple)) and all(isinstance(n, str) for n in split_points)
    ):
        raise TypeError(f"pipeline_split_points must be a list of block names, got {split_points!r}.")
    if size > 1:
        if sharding_strategy is ShardingStrategy.HYBRID_SHARD:
            raise ValueError(
                f"pipeline_parallel_size={size} with sharding_strategy='HYBRID_SHARD' is not supported yet: pipeline"
                " stages shard over their data-parallel ranks (FULL_SHARD, SHARD_GRAD_OP or NO_SHARD). See the"
                " composition table in docs/pipeline_parallel.md."
            )
        if isinstance(auto_wrap_policy, (int, bool)):
            raise ValueError(
                f"pipeline_parallel_size={size} splits the model into stages of whole blocks, which auto_wrap_policy"
                f" names; got {auto_wrap_policy!r}. Pass auto_wrap_policy={{YourBlock}} (the block class, or its"
                " name)."
            )
    return {"pipeline_parallel_size": size, "pipeline_schedule": parsed, "microbatches": count,
            "pipeline_split_points": None if split_points is None else tuple(split_points)}  # fmt: skip


def _positive_int(value: object, name: str, other: str = "") -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"{name} must be a positive int{' ' + other if other else ''}, got {value!r}.")


def _parse_device_mesh(device_mesh: object) -> tuple[int, int] | None:
    """``(replicas, shard_size)`` as a tuple of two positive ints (whether it covers the world is checked at set-up,
    once the world size is known)."""
    if device_mesh is None:
        return None
    if (
        isinstance(device_mesh, (tuple, list))
        and len(device_mesh) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in device_mesh)
    ):
        return int(device_mesh[0]), int(device_mesh[1])
    raise ValueError(f"device_mesh must be a pair of positive ints (replicas, shard_size), got {device_mesh!r}.")


def _check_mesh_fits_strategy(
    device_mesh: tuple[int, int] | None, strategy: ShardingStrategy
) -> tuple[int, int] | None:
    """A ``device_mesh`` must describe what ``strategy`` does: only HYBRID_SHARD both shards and replicates (whether
    it covers the world is checked at set-up, once the world size is known)."""
    if device_mesh is None:
        return None
    replicas, shard_size = device_mesh
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and replicas != 1:
        raise ValueError(
            f"device_mesh={device_mesh} replicates across {replicas} groups, which only HYBRID_SHARD does;"
            f" use sharding_strategy='HYBRID_SHARD' or drop device_mesh."
        )
    if strategy is ShardingStrategy.NO_SHARD and shard_size != 1:
        raise ValueError(
            f"device_mesh={device_mesh} shards over {shard_size} ranks, but sharding_strategy='NO_SHARD' replicates"
            f" every parameter on every rank; use sharding_strategy='HYBRID_SHARD' or drop device_mesh."
        )
    return device_mesh


def _parse_timeout(timeout: object) -> timedelta:
    """A positive ``timedelta``; ``None`` is ``DEFAULT_TIMEOUT``."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta such as timedelta(minutes=10) (or None for the default of"
            f" {DEFAULT_TIMEOUT}), got {timeout!r}."
        )
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}.")
    return timeout


def _parse_backend(backend: object) -> str | None:
    """``None`` (gloo on CPU, NCCL on CUDA), a backend name torch knows, or a per-device map such as
    ``"cpu:gloo,cuda:nccl"``."""
    if backend is None:
        return None
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if isinstance(backend, str):
        names = [part.split(":", 1)[-1] for part in backend.split(",")] if ":" in backend else [backend]
        if names and all(name.strip().lower() in known for name in names):
            return backend
    raise ValueError(
        f"process_group_backend must be one of {', '.join(repr(b) for b in known)}, a per-device map such as"
        f" 'cpu:gloo,cuda:nccl', or None (gloo on CPU, NCCL on GPUs); got {backend!r}."
    )


def check_backend_for_device(backend: str, device_type: str) -> None:
    """Refuse, before the process group exists, a backend that cannot run on the strategy's devices."""
    if device_type == "cpu" and backend.strip().lower() == "nccl":
        raise ValueError(
            "process_group_backend='nccl' needs CUDA devices, but this ShardStrategy runs on the CPU. Use"
            " process_group_backend='gloo' (or None), or accelerator='gpu'."
        )


class ShardOptionsMixin:
    """The validated arguments as read-only attributes of a front end's strategy (``strategy.sharding_strategy``...)."""

    options: ShardOptions

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.options.sharding_strategy

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """The explicit ``mixed_precision`` argument (``None``: what the precision plugin implies)."""
        return self.options.mixed_precision

    @property
    def grad_sync(self) -> GradSync:
        return self.options.grad_sync

    @property
    def state_dict_type(self) -> StateDictType:
        return self.options.state_dict_type

    @property
    def cpu_offload(self) -> bool:
        return self.options.cpu_offload

    @property
    def broadcast_buffers(self) -> bool:
        return self.options.broadcast_buffers

    @property
    def param_init(self) -> ParamInit:
        return self.options.param_init

    @property
    def cpu_allocator(self) -> CpuAllocator:
        return self.options.cpu_allocator

    @property
    def tensor_parallel_size(self) -> int:
        return self.options.tensor_parallel_size

    @property
    def context_parallel_size(self) -> int:
        return self.options.context_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.options.pipeline_parallel_size


def _checkpointing_policy(
    activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None, policy: WrapPolicySpec
) -> WrapPolicySpec:
    """``activation_checkpointing_policy``, or the classes of FSDPStrategy's older ``activation_checkpointing`` (with
    FSDPStrategy's deprecation warning); both at once are refused as FSDPStrategy refuses them."""
    if activation_checkpointing is None:
        return policy
    if policy is not None:
        raise ValueError(
            "You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter."
        )
    classes = set(activation_checkpointing) if isinstance(activation_checkpointing, list | tuple | set) else {
        activation_checkpointing
    }
    rank_zero_deprecation(
        f"`ShardStrategy(activation_checkpointing={activation_checkpointing})` is deprecated, use "
        f"`ShardStrategy(activation_checkpointing_policy={classes})` instead."
    )
    return classes
