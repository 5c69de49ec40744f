"""The Trainer's ``ShardStrategy`` against what Lightning checks of its ``FSDPStrategy``
(``tests/tests_pytorch/strategies/test_fsdp.py``). Each test names, in its docstring, the Lightning test whose
behaviour it checks; see ``tests/compat/__init__.py`` for the whole map and the deliberate differences."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import typing
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins import DoublePrecision, HalfPrecision
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, wrap

import lightning_shard
from lightning_shard import MixedPrecision, ShardingStrategy, ShardPrecision, ShardStrategy
from tests.compat.support import (
    CountingBlock,
    NormModel,
    OtherCountingBlock,
    SeqModel,
    assert_same,
    ddp_checkpoint_into_shard_strategy,
    full_weights,
    on_ranks,
    raised,
    trainer,
    unit_names,
)
from tests.test_buffers import _cpu_sync_batchnorm

# ----------------------------------------------------------------------------------------------------------------
# Arguments (no processes)
# ----------------------------------------------------------------------------------------------------------------


def test_custom_mixed_precision_is_the_strategys_config() -> None:
    """test_custom_mixed_precision: an explicit config is what ``strategy.mixed_precision_config`` gives, ours as it
    is, PyTorch's translated field by field (``reduce_dtype=None`` reduces in ``param_dtype``, as under FSDP)."""
    ours = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert ShardStrategy(mixed_precision=ours).mixed_precision_config == ours
    translated = ShardStrategy(mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16)).mixed_precision_config
    assert translated is not None
    assert (translated.param_dtype, translated.reduce_dtype, translated.buffer_dtype) == (
        torch.bfloat16, torch.bfloat16, None
    )
    assert translated.cast_forward_inputs  # FSDP's cast_root_forward_inputs=True
    assert ShardStrategy(mixed_precision=TorchMixedPrecision()).mixed_precision_config == MixedPrecision(
        cast_forward_inputs=True
    )


def test_torch_mixed_precision_flags_that_cannot_be_honoured_are_refused() -> None:
    """test_custom_mixed_precision (what does not carry over): per-unit input casts and low-precision gradients."""
    for flag in ("keep_low_precision_grads", "cast_forward_inputs"):
        with pytest.raises(ValueError, match=flag):
            ShardStrategy(mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16, **{flag: True}))


def test_torch_mixed_precision_keeps_batchnorm_in_full_precision_with_a_wrap_policy() -> None:
    """test_custom_mixed_precision: FSDP runs ``_module_classes_to_ignore`` (BatchNorm) in full precision when an
    ``auto_wrap_policy`` is given, and not otherwise."""
    config = TorchMixedPrecision(param_dtype=torch.bfloat16)
    wrapped = ShardStrategy(auto_wrap_policy={nn.Linear}, mixed_precision=config).mixed_precision_config
    assert wrapped is not None and wrapped.keeps_fp32(nn.BatchNorm1d(4)) and not wrapped.keeps_fp32(nn.Linear(2, 2))
    unwrapped = ShardStrategy(mixed_precision=config).mixed_precision_config
    assert unwrapped is not None and not unwrapped.keeps_fp32(nn.BatchNorm1d(4))


def test_cpu_offload_takes_a_bool_or_torchs_cpu_offload() -> None:
    """test_strategy_cpu_offload: ``True`` and ``CPUOffload(offload_params=True)`` enable it, ``CPUOffload()`` does
    not. (The attribute is a bool, not a ``CPUOffload``: a deliberate difference.)"""
    assert ShardStrategy(cpu_offload=True).cpu_offload is True
    assert ShardStrategy(cpu_offload=CPUOffload(offload_params=True)).cpu_offload is True
    assert ShardStrategy(cpu_offload=CPUOffload()).cpu_offload is False
    with pytest.raises(TypeError, match="cpu_offload"):
        ShardStrategy(cpu_offload="yes")  # type: ignore[arg-type]


def test_sharding_strategy_takes_names_in_any_case_and_both_enums() -> None:
    """test_sharding_strategy: the default is FULL_SHARD; PyTorch's enum, our enum and names in any case."""
    assert ShardStrategy().sharding_strategy is ShardingStrategy.FULL_SHARD
    for member in (TorchShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.SHARD_GRAD_OP):
        assert ShardStrategy(sharding_strategy=member).sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert ShardStrategy(sharding_strategy="NO_SHARD").sharding_strategy is ShardingStrategy.NO_SHARD
    assert ShardStrategy(sharding_strategy="no_shard").sharding_strategy is ShardingStrategy.NO_SHARD


@pytest.mark.parametrize("how", ["name", "enum"])
def test_hybrid_shard_needs_neither_a_wrap_policy_nor_a_process_group(how: str) -> None:
    """test_hybrid_shard_configuration: HYBRID_SHARD is accepted with a wrap policy or a mesh, and here also alone (the
    mesh defaults to (num_nodes, devices)); there is no ``process_group`` argument and no ``_HYBRID_SHARD_ZERO2``."""
    value: Any = "HYBRID_SHARD" if how == "name" else TorchShardingStrategy.HYBRID_SHARD
    assert ShardStrategy(sharding_strategy=value).sharding_strategy.name == "HYBRID_SHARD"
    assert ShardStrategy(sharding_strategy=value, auto_wrap_policy={nn.Linear}).sharding_strategy.name == "HYBRID_SHARD"
    assert ShardStrategy(sharding_strategy=value, device_mesh=(2, 4)).sharding_strategy.name == "HYBRID_SHARD"
    zero2: Any = "_HYBRID_SHARD_ZERO2" if how == "name" else TorchShardingStrategy._HYBRID_SHARD_ZERO2
    with pytest.raises(ValueError, match="_HYBRID_SHARD_ZERO2.*no counterpart"):
        ShardStrategy(sharding_strategy=zero2)
    with pytest.raises(TypeError, match="process_group"):
        ShardStrategy(sharding_strategy=value, process_group=(Mock(), Mock()))  # type: ignore[call-arg]


@pytest.mark.parametrize("flag", ["use_orig_params", "limit_all_gathers", "sync_module_states"])
def test_fsdp_flags_are_taken_as_true_and_refused_as_false(flag: str) -> None:
    """test_use_orig_params: ``use_orig_params=True`` is what ShardStrategy always does (as are
    ``limit_all_gathers=True`` and ``sync_module_states=True``); ``False`` cannot be honoured and is refused."""
    ShardStrategy(**{flag: True})
    with pytest.raises(ValueError, match=f"{flag}=False cannot be honoured"):
        ShardStrategy(**{flag: False})


def test_a_precision_plugin_the_strategy_cannot_run_is_a_type_error() -> None:
    """test_forbidden_precision_raises: a plugin the strategy cannot run raises ``TypeError`` in the constructor and
    on assignment. Lightning's ``HalfPrecision`` (what ``Trainer(precision="bf16-true")`` builds for a strategy that
    is not FSDPStrategy) is translated instead of refused: a deliberate difference."""
    for plugin in (DoublePrecision(), FSDPPrecision("bf16-mixed")):
        with pytest.raises(TypeError, match="ShardPrecision"):
            ShardStrategy(precision_plugin=plugin)
        strategy = ShardStrategy()
        with pytest.raises(TypeError, match="ShardPrecision"):
            strategy.precision_plugin = plugin
    translated = ShardStrategy(precision_plugin=HalfPrecision("bf16-true")).precision_plugin
    assert isinstance(translated, ShardPrecision) and translated.precision == "bf16-true"


def test_activation_checkpointing_policy_takes_classes_and_module_wrap_policy() -> None:
    """test_activation_checkpointing (arguments): a set of classes and PyTorch's ``ModuleWrapPolicy`` are both taken;
    that the chosen modules are recomputed is checked on two ranks below."""
    ShardStrategy(activation_checkpointing_policy={nn.Linear})
    ShardStrategy(activation_checkpointing_policy=ModuleWrapPolicy({nn.Linear, nn.LayerNorm}))


class _Blocks(nn.Module):
    """A ModuleList of blocks and a MultiheadAttention: a container and an ``out_proj`` FSDP would wrap too."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        self.attention = nn.MultiheadAttention(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.attention(x, x, x)[0]


def _units_chosen(policy: Any, model: nn.Module) -> list[str]:
    from lightning_shard.engine.policies import select_unit_modules

    return [name for name, _ in select_unit_modules(model, ShardStrategy(auto_wrap_policy=policy).options.wrap_policy)]


def test_fsdp_policies_choose_what_fsdp_wraps_that_can_be_gathered() -> None:
    """test_strategy_full_state_dict / test_checkpoint_multi_gpus (the policies, without processes): PyTorch's
    ``always_wrap_policy``, ``transformer_auto_wrap_policy``, ``lambda_auto_wrap_policy`` and ``CustomPolicy`` choose
    FSDP's modules, except a container (never called) and ``MultiheadAttention.out_proj`` (read without being called),
    whose parameters stay with the unit around them, with a warning naming them when they hold parameters no unit
    below them owns; a ``CustomPolicy`` that gives a module settings of its own is refused."""
    from torch.distributed.fsdp.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        always_wrap_policy,
        lambda_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    everything = ["blocks.0", "blocks.0.0", "blocks.0.1", "blocks.1", "blocks.1.0", "blocks.1.1", "attention"]
    with pytest.warns(UserWarning, match=r"auto_wrap_policy chose attention\.out_proj, which cannot be a unit"):
        assert _units_chosen(always_wrap_policy, _Blocks()) == everything  # the ModuleList owns nothing: no warning
    with pytest.warns(UserWarning, match=r"auto_wrap_policy chose blocks, which cannot be a unit"):
        assert _units_chosen(ModuleWrapPolicy({nn.ModuleList}), _Blocks()) == []
    by_class = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Sequential})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what it chose, it got: no warning
        assert _units_chosen(by_class, _Blocks()) == ["blocks.0", "blocks.1"]
    by_lambda = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.MultiheadAttention))
    assert _units_chosen(by_lambda, _Blocks()) == ["attention"]
    assert _units_chosen(CustomPolicy(lambda m: isinstance(m, nn.ReLU)), _Blocks()) == ["blocks.0.1", "blocks.1.1"]
    with pytest.raises(ValueError, match="FSDP settings of their own"):
        _units_chosen(CustomPolicy(lambda m: {"mixed_precision": None} if isinstance(m, nn.ReLU) else False), _Blocks())
    with pytest.raises(TypeError, match=r"called as fn\(module, name\)"):
        ShardStrategy(auto_wrap_policy=lambda module, depth, size: True)


def test_save_checkpoint_refuses_storage_options(tmp_path: Path) -> None:
    """test_save_checkpoint_storage_options: ``TypeError`` naming the argument, before anything is written. A
    deliberate difference: ``storage_options`` are taken for URLs (``s3://...``), so only a local path refuses them.
    The message starts in Lightning's words, then says why."""
    with pytest.raises(TypeError, match=re.escape("`ShardStrategy.save_checkpoint(..., storage_options=...)` is not")):
        ShardStrategy().save_checkpoint(checkpoint={}, filepath=tmp_path, storage_options=Mock())


def test_unknown_state_dict_type_is_a_value_error() -> None:
    """test_save_checkpoint_unknown_state_dict_type: ``ValueError`` naming the valid values; here when the strategy
    is built, not at the first save."""
    with pytest.raises(ValueError, match="Unknown state_dict_type 'invalid'.*'sharded', 'full'"):
        ShardStrategy(state_dict_type="invalid")  # type: ignore[arg-type]


class _Stop(Exception):
    pass


def set_up_with_timeout(monkeypatch: pytest.MonkeyPatch, timeout: timedelta) -> timedelta:
    """The timeout the strategy creates its process group with (``init_process_group`` replaced by a recorder)."""
    seen: dict[str, Any] = {}

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Stop  # stop before anything needs a real group

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # restored afterwards: Lightning sets them on the way
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    strategy = ShardStrategy(timeout=timeout, parallel_devices=[torch.device("cpu")])
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = Mock()
    with pytest.raises(_Stop):
        strategy.setup_environment()
    return seen["timeout"]


def test_timeout_reaches_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_set_timeout: a ``timeout`` of 10 minutes or more is the one the process group is created with; a shorter
    one is not (a deliberate difference): the rendezvous, every rank connecting, waits 10 minutes, and the shorter
    ``timeout`` bounds every wait once the group exists (checked on live ranks in tests/test_stall.py)."""
    assert set_up_with_timeout(monkeypatch, timedelta(hours=2)) == timedelta(hours=2)
    assert set_up_with_timeout(monkeypatch, timedelta(seconds=30)) == timedelta(minutes=10)


def test_device_mesh_annotation_parses_a_pair_from_the_command_line() -> None:
    """test_device_mesh_type_annotation: jsonargparse turns ``--device_mesh=[1, 4]`` into ``(1, 4)``, given the type
    the bare signature holds."""
    import jsonargparse

    annotation = inspect.signature(ShardStrategy).parameters["device_mesh"].annotation
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--device_mesh", type=annotation)
    assert parser.parse_args(["--device_mesh=[1, 4]"]).device_mesh == (1, 4)
    assert typing.get_type_hints(ShardStrategy.__init__)["device_mesh"] == annotation


def test_runs_on_cpu_where_fsdp_needs_a_gpu() -> None:
    """test_invalid_on_cpu (a deliberate difference): FSDPStrategy refuses a CPU accelerator; ``strategy="shard"``
    builds on CPU, and every multi-rank test of this suite trains on CPU with gloo."""
    trainer_ = L.Trainer(accelerator="cpu", devices=1, strategy="shard", fast_dev_run=True, logger=False)
    assert isinstance(trainer_.strategy, ShardStrategy)


# ----------------------------------------------------------------------------------------------------------------
# All stages with checkpoints (Lightning's ``_run_multiple_stages``)
# ----------------------------------------------------------------------------------------------------------------


class ManuallyWrapped(SeqModel):
    """Units chosen by hand in ``configure_model`` with PyTorch's ``wrap()``, as Lightning's ``TestFSDPModel``."""

    def configure_model(self) -> None:
        for i in (0, 2):
            self.layer[i] = wrap(self.layer[i])
        self.layer = wrap(self.layer)


def nonwrapped_at_least_two(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """An FSDP-style policy function, as Lightning's ``custom_auto_wrap_policy``."""
    return nonwrapped_numel >= 2


def run_stages(rank: int, world_size: int, tmp: str, strategy_kwargs: dict[str, Any], precision: str = "32-true",
               model_class: type[SeqModel] = SeqModel, sync_batchnorm: bool = False) -> dict[str, Any]:
    """fit, test, save after testing, save weights only, then test and predict on the set-up model and from the
    checkpoint, as Lightning's ``_run_multiple_stages``; the units and both test losses."""
    L.seed_everything(0)
    model = model_class()
    strategy = ShardStrategy(**strategy_kwargs)
    checkpoint = ModelCheckpoint(dirpath=tmp, save_last=True)
    t = trainer(strategy, precision=precision, callbacks=[checkpoint], enable_checkpointing=True, max_steps=-1,
                max_epochs=1, limit_train_batches=2, sync_batchnorm=sync_batchnorm)
    with _cpu_sync_batchnorm() if sync_batchnorm else contextlib.nullcontext():
        t.fit(model)
    tested = t.test(model, verbose=False)[0]["test_loss"]
    path = Path(t.strategy.broadcast(str(checkpoint.last_model_path)))
    t.save_checkpoint(path.with_name("after-test"))
    t.save_checkpoint(path, weights_only=True)
    optimizers_in_weights_only = json.loads((path / "index.json").read_text())["optimizers"]
    with torch.inference_mode():
        again = t.test(model, verbose=False)[0]["test_loss"]
        from_checkpoint = t.test(ckpt_path=path, verbose=False)[0]["test_loss"]
        predictions = t.predict(model)
        predicted_from_checkpoint = t.predict(ckpt_path=path)
    return {
        "units": unit_names(model),
        "tested": [tested, again, from_checkpoint],
        "predictions": [torch.cat(predictions), torch.cat(predicted_from_checkpoint)],
        "optimizers_in_weights_only": optimizers_in_weights_only,
        "is_dir": path.is_dir(),
    }


def _check_stages(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        tested, again, from_checkpoint = result["tested"]
        assert tested == again == from_checkpoint, f"rank {rank}: {result['tested']}"
        torch.testing.assert_close(*result["predictions"])
        assert result["optimizers_in_weights_only"] == [], "weights_only=True saved optimizer state"
        assert result["is_dir"]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_all_stages_run_and_checkpoints_restore_the_trained_model(
    tmp_path: Path, state_dict_type: str, precision: str
) -> None:
    """test_strategy_checkpoint: fit, test, predict, save (also ``weights_only``), and test/predict from the saved
    checkpoint give the trained model's results, in both layouts and precisions."""
    kwargs = {"auto_wrap_policy": {nn.Linear}, "state_dict_type": state_dict_type}
    _check_stages(on_ranks(run_stages, str(tmp_path), kwargs, precision))


@pytest.mark.parametrize(
    ("wrapping", "model_class", "strategy_kwargs", "units"),
    [
        ("manually_wrapped", ManuallyWrapped, {}, ["layer", "layer.0", "layer.2"]),
        ("autowrap_2x", SeqModel, {"auto_wrap_policy": nonwrapped_at_least_two}, ["layer.0", "layer.2"]),
        (
            "autowrap_use_orig_params",
            SeqModel,
            {"auto_wrap_policy": ModuleWrapPolicy({nn.Linear}), "use_orig_params": True},
            ["layer.0", "layer.2"],
        ),
    ],
)
def test_checkpoint_stages_with_manual_and_fsdp_style_wrapping(
    tmp_path: Path, wrapping: str, model_class: type[SeqModel], strategy_kwargs: dict, units: list[str]
) -> None:
    """test_checkpoint_multi_gpus: PyTorch's ``wrap()`` in ``configure_model``, an FSDP policy function
    ``(module, recurse, nonwrapped_numel)`` and ``ModuleWrapPolicy`` choose the units FSDP would, and every stage
    runs with ``ModelCheckpoint(save_last=True)``."""
    results = on_ranks(run_stages, str(tmp_path), strategy_kwargs, "32-true", model_class)
    assert results[0]["units"] == units
    _check_stages(results)


def test_sync_batchnorm_runs_every_stage(tmp_path: Path) -> None:
    """test_strategy_sync_batchnorm: ``Trainer(sync_batchnorm=True)`` through fit, test, predict and checkpoints."""
    kwargs = {"auto_wrap_policy": {nn.Linear}}
    _check_stages(on_ranks(run_stages, str(tmp_path), kwargs, "32-true", NormModel, True))


# ----------------------------------------------------------------------------------------------------------------
# Wrap policies, state dicts and optimizer states after fit
# ----------------------------------------------------------------------------------------------------------------


def full_state_after_fit(rank: int, world_size: int, min_num_params: int) -> dict[str, Any]:
    L.seed_everything(0)
    model = SeqModel()
    expected_keys = list(model.state_dict())
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    strategy = ShardStrategy(auto_wrap_policy=policy, state_dict_type="full")
    trainer(strategy, precision="bf16-mixed").fit(model)
    state = strategy.lightning_module_state_dict()
    full = full_weights(model)
    return {
        "units": unit_names(model),
        "keys": list(state),
        "expected_keys": expected_keys,
        "equal": all(torch.equal(state[k].cpu(), full[k]) for k in state if k in full),
    }


@pytest.mark.parametrize(
    ("min_num_params", "units"), [(2, ["layer.0", "layer.2"]), (1024, ["layer.0"]), (100_000_000, [])]
)
def test_size_based_policy_wraps_what_fsdp_wraps_and_the_full_state_dict_is_on_rank_0(
    min_num_params: int, units: list[str]
) -> None:
    """test_strategy_full_state_dict: ``functools.partial(size_based_auto_wrap_policy, min_num_params=n)`` makes the
    units FSDP would (all, half, none of the linear layers), and with ``state_dict_type="full"`` global rank 0's
    ``lightning_module_state_dict()`` holds the plain model's keys in the same order, the others nothing."""
    zero, one = on_ranks(full_state_after_fit, min_num_params)
    assert zero["units"] == one["units"] == units
    assert zero["keys"] == zero["expected_keys"]
    assert zero["equal"]
    assert one["keys"] == []


def optimizer_state_round_trip(rank: int, world_size: int, tmp: str, min_num_params: int) -> dict[str, Any]:
    L.seed_everything(0)
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    model = SeqModel()
    strategy = ShardStrategy(auto_wrap_policy=policy, state_dict_type="full")
    t = trainer(strategy)
    t.fit(model)
    path = t.strategy.broadcast(f"{tmp}/last.ckpt")
    t.save_checkpoint(path)
    saved = (strategy.lightning_module_state_dict(), strategy.optimizer_state(t.optimizers[0]))
    restored_model = SeqModel()
    restored = ShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full")  # other units: it reshards
    t = trainer(restored)
    t.fit(restored_model, ckpt_path=path)  # max_steps already reached: loads and stops
    return {"saved": saved, "restored": (restored.lightning_module_state_dict(),
                                         restored.optimizer_state(t.optimizers[0]))}


@pytest.mark.parametrize("min_num_params", [2, 1024, 100_000_000])
def test_model_and_optimizer_state_are_full_on_rank_0_and_restored_exactly(tmp_path: Path, min_num_params: int) -> None:
    """test_strategy_save_optimizer_states: with ``state_dict_type="full"``
    the model and optimizer states are full on rank 0 and empty elsewhere, and a run resumed from the checkpoint
    (here under other units; resuming under DDP is a deliberate difference) holds exactly the same states."""
    zero, one = on_ranks(optimizer_state_round_trip, str(tmp_path), min_num_params)
    saved_model, saved_optimizer = zero["saved"]
    assert set(saved_model) == set(SeqModel().state_dict())
    assert set(saved_optimizer) == {"state", "param_groups"} and saved_optimizer["state"]
    assert_same(zero["restored"], zero["saved"])
    assert one["saved"] == ({}, {}) and one["restored"] == ({}, {})


def foreign_parameters_in_the_optimizer(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    class ForeignParameters(SeqModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(nn.Linear(4, 5).parameters(), lr=1e-2)

    t = trainer(ShardStrategy(), max_steps=1)
    return {"fit": raised(lambda: t.fit(ForeignParameters())), "save": raised(lambda: t.save_checkpoint(f"{tmp}/c"))}


def test_an_optimizer_over_tensors_outside_the_model_trains_and_its_save_is_refused(tmp_path: Path) -> None:
    """test_invalid_parameters_in_optimizer: with FSDPStrategy's default (``use_orig_params=True``) an optimizer
    that references no parameter of the model is not refused, and training runs; so here. Its state cannot be
    saved with the model's shards: the save raises, naming the optimizer."""
    for outcome in on_ranks(foreign_parameters_in_the_optimizer, str(tmp_path)):
        assert outcome["fit"] == ""
        assert re.search(r"optimizer.*not (parameters|shards) of the sharded model", outcome["save"]), outcome


def metric_in_training_step(rank: int, world_size: int) -> list[str]:
    class MetricsModel(SeqModel):
        def __init__(self) -> None:
            super().__init__()
            self.metric = torchmetrics.Accuracy("multiclass", num_classes=10)
            self.devices: list[str] = []

        def training_step(self, batch: Tensor, batch_idx: int) -> Any:
            self.devices.append(str(self.metric.tp.device))
            self.metric(torch.rand(2, 10), torch.randint(0, 10, size=(2,)))
            return super().training_step(batch, batch_idx)

    model = MetricsModel()
    trainer(ShardStrategy(auto_wrap_policy={nn.Linear}), max_steps=1).fit(model)
    return model.devices


def test_a_metric_without_parameters_works_in_the_training_step() -> None:
    """test_modules_without_parameters: a torchmetrics metric (buffers, no parameters) sits on the strategy's device
    and updates in ``training_step``."""
    assert on_ranks(metric_in_training_step) == [["cpu"], ["cpu"]]


def configure_model_placement(rank: int, world_size: int) -> dict[str, Any]:
    class ConfiguredModel(BoringModel):
        def configure_model(self) -> None:
            self.layer = nn.Linear(32, 2)
            self.in_configure = (str(self.layer.weight.device), self.layer.weight.dtype)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.layer.parameters(), lr=0.1)

        def on_fit_start(self) -> None:
            self.at_fit_start = (str(self.layer.weight.device), self.layer.weight.dtype)

    model = ConfiguredModel()
    trainer(ShardStrategy(auto_wrap_policy={nn.Linear}), max_steps=1).fit(model)
    return {"in_configure": model.in_configure, "at_fit_start": model.at_fit_start}


def test_configure_model_builds_on_the_cpu_and_setup_shards_onto_the_device() -> None:
    """test_configure_model: modules created in ``configure_model`` are on the CPU in fp32, and after set-up on the
    strategy's device (here also the CPU) in fp32."""
    for result in on_ranks(configure_model_placement):
        assert result == {"in_configure": ("cpu", torch.float32), "at_fit_start": ("cpu", torch.float32)}


class InitContextModel(BoringModel):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_start(self) -> None:
        optimizer = self.optimizers(use_pl_optimizer=False)
        self.seen = (str(self.layer.weight.device), self.layer.weight.dtype,
                     str(optimizer.param_groups[0]["params"][0].device))


def init_module_placement(rank: int, world_size: int, precision: str, empty_init: bool) -> dict[str, Any]:
    t = trainer(ShardStrategy(auto_wrap_policy={nn.Linear}), precision=precision, max_steps=1)
    with t.init_module(empty_init=empty_init):
        model = InitContextModel()
    before = (str(model.layer.weight.device), model.layer.weight.dtype)
    t.fit(model)
    return {"before": before, "after": model.seen}


@pytest.mark.parametrize(
    ("precision", "dtype"), [("32-true", torch.float32), ("16-true", torch.float16), ("bf16-true", torch.bfloat16)]
)
@pytest.mark.parametrize("empty_init", [False, True])
def test_init_module_builds_in_the_precisions_dtype_and_setup_places_it(
    precision: str, dtype: torch.dtype, empty_init: bool
) -> None:
    """test_module_init_context: under ``trainer.init_module(empty_init=...)`` the model is on the CPU (or the meta
    device) in the precision's dtype; after set-up its shards and the optimizer's are on the device, same dtype."""
    device = "meta" if empty_init else "cpu"
    for result in on_ranks(init_module_placement, precision, empty_init):
        assert result == {"before": (device, dtype), "after": ("cpu", dtype, "cpu")}


def checkpointed_forward_counts(rank: int, world_size: int, policy: Any) -> dict[str, int]:
    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Sequential(CountingBlock(32, 32), OtherCountingBlock(32, 32), nn.Linear(32, 2))

    CountingBlock.calls = OtherCountingBlock.calls = 0
    trainer(ShardStrategy(activation_checkpointing_policy=policy), max_steps=1, limit_val_batches=0).fit(Model())
    return {"CountingBlock": CountingBlock.calls, "OtherCountingBlock": OtherCountingBlock.calls}


@pytest.mark.parametrize(
    ("policy", "recomputed"),
    [
        ({CountingBlock}, {"CountingBlock"}),
        (ModuleWrapPolicy({CountingBlock}), {"CountingBlock", "OtherCountingBlock"}),  # FSDP matches subclasses too
    ],
)
def test_activation_checkpointing_recomputes_the_chosen_modules(policy: Any, recomputed: set[str]) -> None:
    """test_activation_checkpointing: the modules the policy chooses run their forward again in backward (two calls
    for one training step), the others once. A set matches classes exactly; ``ModuleWrapPolicy``, as in FSDP,
    matches instances of subclasses too."""
    for counts in on_ranks(checkpointed_forward_counts, policy):
        assert counts == {name: 2 if name in recomputed else 1 for name in counts}, counts


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint paths and formats
# ----------------------------------------------------------------------------------------------------------------


def save_over_existing_paths(rank: int, world_size: int, tmp: str, state_dict_type: str) -> dict[str, str]:
    t = trainer(ShardStrategy(state_dict_type=state_dict_type), max_steps=1)
    t.fit(SeqModel())
    root = Path(t.strategy.broadcast(tmp))
    if rank == 0:
        (root / "not-a-checkpoint").mkdir()
        (root / "not-a-checkpoint" / "file").touch()
        (root / "file.pt").touch()
        (root / "empty").mkdir()
    t.strategy.barrier()
    outcome = {}
    t.save_checkpoint(root / "checkpoint")
    outcome["existing checkpoint"] = raised(lambda: t.save_checkpoint(root / "checkpoint"))
    for name in ("not-a-checkpoint", "file.pt", "empty"):
        outcome[name] = raised(lambda: t.save_checkpoint(root / name))  # noqa: B023 - called at once
    outcome["kept"] = str((root / "not-a-checkpoint" / "file").exists() and (root / "file.pt").is_file())
    return outcome


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_save_replaces_a_checkpoint_and_never_other_data(tmp_path: Path, state_dict_type: str) -> None:
    """test_save_checkpoint_path_exists: an existing checkpoint is replaced, and an empty directory is filled, in both
    layouts. A directory that is not a checkpoint (FSDPStrategy: ``IsADirectoryError`` for ``"full"``, written into
    for ``"sharded"``) and a file (FSDPStrategy: overwritten) are refused on every rank and left as they were: a
    deliberate difference."""
    for outcome in on_ranks(save_over_existing_paths, str(tmp_path), state_dict_type):
        assert outcome["existing checkpoint"] == outcome["empty"] == ""
        for name in ("not-a-checkpoint", "file.pt"):
            assert "Refusing to save a checkpoint" in outcome[name], outcome[name]
        assert outcome["kept"] == "True"


def load_from(rank: int, world_size: int, path: str) -> str:
    return raised(lambda: trainer(ShardStrategy(), max_steps=1).fit(SeqModel(), ckpt_path=path))


def test_loading_a_path_that_is_not_a_checkpoint_is_a_value_error(tmp_path: Path) -> None:
    """test_load_unknown_checkpoint_type: an empty directory is neither kind of checkpoint: ``ValueError``
    (``lightning_shard.CheckpointError`` is a ``ValueError`` and a ``RuntimeError``) naming the path."""
    (tmp_path / "empty_dir").mkdir()
    for message in on_ranks(load_from, str(tmp_path / "empty_dir")):
        assert message.startswith("CheckpointError") and "empty_dir" in message, message
        assert "does not point to a valid checkpoint" in message, message  # Lightning's words first
    assert issubclass(lightning_shard.CheckpointError, ValueError)


@pytest.mark.parametrize("min_num_params", [2, 1024, 100_000_000])
def test_a_ddp_checkpoint_resumes_with_its_model_and_optimizer_state(tmp_path: Path, min_num_params: int) -> None:
    """test_strategy_load_optimizer_states: a checkpoint DDP saved (Lightning's ``.ckpt``) resumes under the strategy,
    whatever the units: every weight and every optimizer state tensor arrives exactly, and the loops go on from the
    saved step. (The pickle is read by a restricted reader that builds tensors and plain values only.)"""
    for result in on_ranks(ddp_checkpoint_into_shard_strategy, str(tmp_path), min_num_params):
        assert_same(result["restored"], result["expected"])
        assert result["step"] == 2


class TwoOptimizers(SeqModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(self.step(batch))
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:  # type: ignore[override]
        return [torch.optim.SGD(self.layer[i].parameters(), lr=0.1) for i in (0, 2)]


def optimizer_count_mismatch(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    one, two = f"{tmp}/one", f"{tmp}/two"
    for model, path in ((SeqModel(), one), (TwoOptimizers(), two)):
        t = trainer(ShardStrategy(), max_steps=1)
        t.fit(model)
        t.save_checkpoint(path)
    return {
        "more in the checkpoint": raised(lambda: trainer(ShardStrategy(), max_steps=5).fit(SeqModel(), ckpt_path=two)),
        "fewer in the checkpoint": raised(
            lambda: trainer(ShardStrategy(), max_steps=5).fit(TwoOptimizers(), ckpt_path=one)
        ),
    }


def test_a_checkpoint_with_another_number_of_optimizers_is_a_runtime_error(tmp_path: Path) -> None:
    """test_strategy_load_optimizer_states_multiple: more or fewer optimizer states than configured optimizers raise a
    ``RuntimeError`` that gives both counts."""
    for outcome in on_ranks(optimizer_count_mismatch, str(tmp_path)):
        lightnings = "You have configured {} optimizers but the checkpoint contains {} optimizers to load"
        assert lightnings.format(1, 2) in outcome["more in the checkpoint"], outcome
        assert lightnings.format(2, 1) in outcome["fewer in the checkpoint"], outcome
        assert "holds 2 optimizer states; the model has 1" in outcome["more in the checkpoint"], outcome
        assert "holds 1 optimizer states; the model has 2" in outcome["fewer in the checkpoint"], outcome
        assert all("Nothing was loaded" in message for message in outcome.values())
        assert all(message.startswith("CheckpointError") for message in outcome.values())
    assert issubclass(lightning_shard.CheckpointError, RuntimeError)


class ComparingModel(SeqModel):
    def __init__(self, compare_to: dict[str, Tensor] | None = None) -> None:
        super().__init__()
        self.compare_to = compare_to
        self.matched: bool | None = None

    def on_train_start(self) -> None:
        if self.compare_to is not None:
            now = full_weights(self)
            self.matched = all(torch.equal(now[k], v) for k, v in self.compare_to.items())


def sharded_checkpoint_and_resume(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    L.seed_everything(0)
    settings = {"default_root_dir": tmp, "enable_checkpointing": True, "max_steps": -1, "max_epochs": 1,
                "limit_train_batches": 2}
    model = ComparingModel()
    t = trainer(ShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded"), **settings)
    t.fit(model)
    before = full_weights(model)
    path = Path(t.strategy.broadcast(t.checkpoint_callback.best_model_path))
    files = sorted(p.name for p in path.iterdir())
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    resumed = ComparingModel(compare_to=before)
    settings["max_epochs"] = 2
    trainer(ShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded"), **settings).fit(
        resumed, ckpt_path=path
    )
    return {"files": files, "trainer_state": trainer_state, "matched": resumed.matched}


def test_sharded_checkpoint_layout_and_resume(tmp_path: Path) -> None:
    """test_save_load_sharded_state_dict: a sharded checkpoint is a directory with one file per rank and the trainer
    state (Lightning's version and the ModelCheckpoint state, no model or optimizer tensors) as JSON; resuming
    from it starts training from exactly the saved weights."""
    for result in on_ranks(sharded_checkpoint_and_resume, str(tmp_path)):
        assert result["files"] == [
            "index.json",
            "shard-00000-of-00002.safetensors",
            "shard-00001-of-00002.safetensors",
            "trainer_state.json",
            "trainer_state.safetensors",
        ]
        state = result["trainer_state"]
        assert "pytorch-lightning_version" in state
        assert len(state["callbacks"]) == 1 and "ModelCheckpoint" in next(iter(state["callbacks"]))
        assert "state_dict" not in state and "optimizer_states" not in state
        assert result["matched"] is True


def save_and_resume_through_urls(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    here = os.getcwd()
    os.chdir(tmp)  # a URL taken for a relative path lands here, not in the repository
    try:
        return _save_and_resume_through_urls(rank, world_size, tmp)
    finally:
        os.chdir(here)


def _save_and_resume_through_urls(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    L.seed_everything(0)
    model = ComparingModel()
    t = trainer(ShardStrategy(auto_wrap_policy={nn.Linear}))
    t.fit(model)
    url = "local://" + t.strategy.broadcast(f"{tmp}/checkpoint")
    t.save_checkpoint(url)
    before = full_weights(model)
    written = sorted(p.name for p in Path(tmp, "checkpoint").iterdir())
    resumed = ComparingModel(compare_to=before)
    trainer(ShardStrategy(auto_wrap_policy={nn.Linear}), max_steps=3).fit(resumed, ckpt_path=url)
    unknown = raised(lambda: t.save_checkpoint("nosuchprotocol://bucket/run/ckpt"))
    return {"written": written, "matched": resumed.matched, "unknown": unknown,
            "taken for a local path": Path("nosuchprotocol:").exists()}


def test_a_url_reaches_the_storage_layer_whole(tmp_path: Path) -> None:
    """test_pl_save_checkpoint_does_not_corrupt_remote_path: a checkpoint path given as a URL is saved to and resumed
    from where the URL says (``local://``), and a URL of a protocol nobody serves is refused naming it: it is never
    taken for a local path (``gs://bucket`` must not become the directory ``gs:/bucket``)."""
    for result in on_ranks(save_and_resume_through_urls, str(tmp_path)):
        assert "index.json" in result["written"]
        assert result["matched"] is True
        assert "nosuchprotocol" in result["unknown"], result["unknown"]
        assert result["taken for a local path"] is False


def consolidate_and_load_plainly(rank: int, world_size: int, tmp: str) -> bool:
    L.seed_everything(0)
    model = SeqModel()
    t = trainer(ShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded"), max_steps=3)
    t.fit(model)
    sharded = t.strategy.broadcast(f"{tmp}/sharded")
    t.save_checkpoint(sharded)
    single_file = f"{tmp}/model.safetensors"
    if rank == 0:
        lightning_shard.consolidate(sharded, single_file)
    t.strategy.barrier()
    trained = full_weights(model)
    plain = SeqModel()
    plain.load_state_dict(load_file(single_file))  # strict: every key, nothing else
    return all(torch.equal(plain.state_dict()[k], v) for k, v in trained.items())


def test_a_sharded_checkpoint_consolidates_into_one_file_a_plain_model_loads(tmp_path: Path) -> None:
    """test_save_sharded_and_consolidate_and_load: the sharded checkpoint becomes one file (``consolidate``) that an
    unsharded model loads with ``load_state_dict``, weight for weight. (Lightning then resumes DDP from it with the
    optimizer state: the optimizer state does not carry over to DDP here, a deliberate difference.)"""
    assert on_ranks(consolidate_and_load_plainly, str(tmp_path)) == [True, True]
