"""Every argument of both ShardStrategy classes is checked before any collective, on every rank: a bad value raises
at once, naming the argument and what it accepts.

One table covers each argument's invalid values. The arguments the strategies check when they are constructed
(everything that does not depend on the devices or the world size) are tried on both front ends; the combinations
that do are checked when the strategy sets up its processes, before the process group exists (a one-process
Trainer and Fabric here: had the check not raised first, they would have created a group).
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shard import MixedPrecision, ShardStrategy
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

# (argument, invalid value, expected exception, a fragment of its message: the argument and what it accepts)
AT_CONSTRUCTION: list[tuple[str, Any, type[Exception], str]] = [
    ("sharding_strategy", "FULL", ValueError, "Unknown sharding_strategy 'FULL'. Valid values are: 'FULL_SHARD'"),
    ("sharding_strategy", 3, ValueError, "Unknown sharding_strategy 3. Valid values are: 'FULL_SHARD'"),
    ("auto_wrap_policy", True, TypeError, "auto_wrap_policy must be module classes, class names, a callable or an"),
    ("auto_wrap_policy", 0, ValueError, "auto_wrap_policy as a parameter count must be >= 1, got 0"),
    ("auto_wrap_policy", [nn.Linear, 3], TypeError, "auto_wrap_policy entries must be nn.Module classes or class"),
    ("auto_wrap_policy", 2.5, TypeError, "auto_wrap_policy must be a set of module classes or class names, a"),
    ("activation_checkpointing_policy", True, TypeError, "activation_checkpointing_policy must be module classes"),
    ("activation_checkpointing_policy", -1, ValueError, "activation_checkpointing_policy as a parameter count must"),
    ("activation_checkpointing_policy", [object], TypeError, "activation_checkpointing_policy entries must be"),
    ("device_mesh", (2,), ValueError, "device_mesh must be a pair of positive ints (replicas, shard_size), got (2,)"),
    ("device_mesh", (0, 2), ValueError, "device_mesh must be a pair of positive ints (replicas, shard_size)"),
    ("device_mesh", (True, 2), ValueError, "device_mesh must be a pair of positive ints (replicas, shard_size)"),
    ("device_mesh", "2x2", ValueError, "device_mesh must be a pair of positive ints (replicas, shard_size)"),
    ("mixed_precision", "bf16", TypeError, "mixed_precision must be a lightning_shard.MixedPrecision (or None)"),
    ("grad_sync", "epoch", ValueError, "Unknown grad_sync 'epoch'. Valid values are: 'microbatch', 'step'"),
    ("state_dict_type", "fsdp", ValueError, "Unknown state_dict_type 'fsdp'. Valid values are: 'sharded', 'full'"),
    ("cpu_offload", "yes", TypeError, "cpu_offload must be True or False, got 'yes'"),
    ("cpu_offload", 1, TypeError, "cpu_offload must be True or False, got 1"),
    ("broadcast_buffers", None, TypeError, "broadcast_buffers must be True or False, got None"),
    ("timeout", 30, TypeError, "timeout must be a datetime.timedelta such as timedelta(minutes=10)"),
    ("timeout", timedelta(0), ValueError, "timeout must be a positive datetime.timedelta"),
    ("timeout", timedelta(seconds=-5), ValueError, "timeout must be a positive datetime.timedelta"),
    ("process_group_backend", "ncl", ValueError, "process_group_backend must be one of 'gloo', 'nccl'"),
    ("process_group_backend", 5, ValueError, "process_group_backend must be one of 'gloo', 'nccl'"),
    ("process_group_backend", "cpu:glo", ValueError, "a per-device map such as 'cpu:gloo,cuda:nccl'"),
]

# Combinations of two arguments, also checked at construction.
COMBINATIONS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"sharding_strategy": "FULL_SHARD", "device_mesh": (2, 2)}, ValueError, "only HYBRID_SHARD does"),
    ({"sharding_strategy": "SHARD_GRAD_OP", "device_mesh": (2, 1)}, ValueError, "only HYBRID_SHARD does"),
    ({"sharding_strategy": "NO_SHARD", "device_mesh": (1, 2)}, ValueError, "sharding_strategy='NO_SHARD' replicates"),
]

# Checked when the processes are set up (the devices and world size are known then), before the process group.
AT_SETUP: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"process_group_backend": "nccl"}, ValueError, "process_group_backend='nccl' needs CUDA devices"),
    ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (1, 2)}, ValueError, "covers 2 ranks but the world size"),
    ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)}, ValueError, "covers 2 ranks but the world size"),
]

FRONT_ENDS = {"trainer": ShardStrategy, "fabric": FabricShardStrategy}


@pytest.mark.parametrize("front", FRONT_ENDS)
@pytest.mark.parametrize(("argument", "value", "error", "message"), AT_CONSTRUCTION)
def test_an_invalid_argument_is_refused_when_the_strategy_is_built(
    front: str, argument: str, value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        FRONT_ENDS[front](**{argument: value})
    assert message in str(raised.value)


@pytest.mark.parametrize("front", FRONT_ENDS)
@pytest.mark.parametrize(("kwargs", "error", "message"), COMBINATIONS)
def test_an_invalid_combination_is_refused_when_the_strategy_is_built(
    front: str, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match="device_mesh") as raised:
        FRONT_ENDS[front](**kwargs)
    assert message in str(raised.value)


@pytest.mark.parametrize(("kwargs", "error", "message"), AT_SETUP)
def test_a_setting_the_devices_cannot_run_is_refused_before_the_process_group_in_the_trainer(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    strategy = ShardStrategy(**kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False)
    with pytest.raises(error) as raised:
        trainer.fit(_Tiny())
    assert message in str(raised.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(("kwargs", "error", "message"), AT_SETUP)
def test_a_setting_the_devices_cannot_run_is_refused_before_the_process_group_in_fabric(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricShardStrategy(**kwargs))
    with pytest.raises(error) as raised:
        fabric.launch()
    assert message in str(raised.value)
    assert not torch.distributed.is_initialized()


def test_the_default_timeout_is_ten_minutes_and_an_explicit_one_is_kept() -> None:
    assert ShardStrategy().options.timeout == timedelta(minutes=10)
    assert FabricShardStrategy(timeout=timedelta(seconds=30)).options.timeout == timedelta(seconds=30)


def test_a_valid_configuration_is_accepted_on_both_front_ends() -> None:
    kwargs: dict[str, Any] = dict(
        sharding_strategy="hybrid_shard",
        auto_wrap_policy={nn.Linear},
        activation_checkpointing_policy={"Linear"},
        device_mesh=(1, 2),
        mixed_precision=MixedPrecision(param_dtype="bfloat16"),
        grad_sync="step",
        state_dict_type="full",
        cpu_offload=False,
        broadcast_buffers=False,
        timeout=timedelta(seconds=30),
        process_group_backend="cpu:gloo,cuda:nccl",
    )
    for cls in FRONT_ENDS.values():
        assert cls(**kwargs).options.device_mesh == (1, 2)


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_the_constructor_type_hints_resolve_at_runtime(front: str) -> None:
    """``typing.get_type_hints`` (what LightningCLI and jsonargparse read) resolves every annotation of ``__init__``."""
    import inspect
    import typing

    init = FRONT_ENDS[front].__init__
    hints = typing.get_type_hints(init)
    assert set(inspect.signature(init).parameters) - {"self"} <= set(hints)
    accelerators = {"trainer": "lightning.pytorch.accelerators", "fabric": "lightning.fabric.accelerators"}
    accelerator = importlib.import_module(accelerators[front]).Accelerator
    assert hints["accelerator"] == accelerator | None


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_fsdp_strategys_older_activation_checkpointing_is_taken_with_its_deprecation_warning(front: str) -> None:
    cls = FRONT_ENDS[front]
    with pytest.deprecated_call(match=r"activation_checkpointing=.*is deprecated, use .*activation_checkpointing_poli"):
        older = cls(activation_checkpointing=[nn.Linear, nn.LayerNorm])
    newer = cls(activation_checkpointing_policy={nn.Linear, nn.LayerNorm})
    assert older.options.checkpointing_policy == newer.options.checkpointing_policy
    with pytest.deprecated_call():
        assert cls(activation_checkpointing=nn.Linear).options.checkpointing_policy == cls(
            activation_checkpointing_policy={nn.Linear}).options.checkpointing_policy
    with pytest.raises(ValueError, match="You cannot set both `activation_checkpointing` and"):
        cls(activation_checkpointing=nn.Linear, activation_checkpointing_policy={nn.Linear})
