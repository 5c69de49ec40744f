"""The sharding arguments both front ends take, with the same names, defaults and validation.

``ShardStrategy`` for the ``Trainer`` and for ``Fabric`` accept exactly these arguments (besides Lightning's
own: accelerator, devices, cluster environment, precision, checkpoint IO). Each is checked when the strategy
is constructed, on every rank, before any process group exists, so a bad value can never leave a rank
waiting in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from lightning_shard.checkpoint.save import StateDictType
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.policies import (
    GradSync,
    ParamInit,
    ShardingStrategy,
    ShardingStrategyName,
    WrapPolicy,
    WrapPolicySpec,
    resolve_wrap_policy,
)


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
    cpu_offload: bool
    broadcast_buffers: bool
    param_init: ParamInit
    timeout: timedelta | None

    @classmethod
    def parse(
        cls,
        *,
        auto_wrap_policy: WrapPolicySpec = None,
        sharding_strategy: ShardingStrategyName | ShardingStrategy = "FULL_SHARD",
        device_mesh: tuple[int, int] | None = None,
        mixed_precision: MixedPrecision | None = None,
        activation_checkpointing_policy: WrapPolicySpec = None,
        grad_sync: Literal["microbatch", "step"] | GradSync = "microbatch",
        state_dict_type: Literal["sharded", "full"] | StateDictType = "sharded",
        cpu_offload: bool = False,
        broadcast_buffers: bool = True,
        param_init: Literal["reset_parameters", "empty"] | ParamInit = "reset_parameters",
        timeout: timedelta | None = None,
    ) -> ShardOptions:
        """Check every argument; raise ``TypeError``/``ValueError`` naming the argument and the valid values."""
        if not isinstance(cpu_offload, bool):
            raise TypeError(f"cpu_offload must be True or False, got {cpu_offload!r}.")
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}.")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(
                "mixed_precision must be a lightning_shard.MixedPrecision (or None), got"
                f" {type(mixed_precision).__name__}. For the usual cases pass a precision string instead"
                " (precision='bf16-mixed' on the Trainer or Fabric)."
            )
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta (or None), got {timeout!r}.")
        return cls(
            sharding_strategy=ShardingStrategy.parse(sharding_strategy),
            wrap_policy=resolve_wrap_policy(auto_wrap_policy),
            device_mesh=_parse_device_mesh(device_mesh),
            mixed_precision=mixed_precision,
            checkpointing_policy=resolve_wrap_policy(activation_checkpointing_policy),
            grad_sync=GradSync.parse(grad_sync),
            state_dict_type=StateDictType.parse(state_dict_type),
            cpu_offload=cpu_offload,
            broadcast_buffers=broadcast_buffers,
            param_init=ParamInit.parse(param_init),
            timeout=timeout,
        )


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
