"""Fabric's ``ShardStrategy`` against what Lightning checks of Fabric's ``FSDPStrategy``
(``tests/tests_fabric/strategies/test_fsdp.py`` and ``test_fsdp_integration.py``). Each test names, in its
docstring, the Lightning test whose behaviour it checks; see ``tests/compat/__init__.py`` for the whole map and the
deliberate differences."""

from __future__ import annotations

import inspect
import os
import re
import threading
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import DoublePrecision, HalfPrecision
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, wrap

import lightning_shard
from lightning_shard import MixedPrecision, ShardingStrategy
from lightning_shard.checkpoint.io.index import read_index
from lightning_shard.engine import sharded_module_of
from lightning_shard.fabric import ShardPrecision, ShardStrategy
from tests.checkpoint_fits import module_full_state
from tests.compat.support import (
    CountingBlock,
    OtherCountingBlock,
    assert_same,
    fabric,
    full_weights,
    on_ranks,
    plain_module,
    raised,
    recorded_warnings,
    unit_names,
)

# ----------------------------------------------------------------------------------------------------------------
# Arguments (no processes)
# ----------------------------------------------------------------------------------------------------------------


def test_custom_mixed_precision_is_the_strategys_config() -> None:
    """test_custom_mixed_precision: an explicit config is ``strategy.mixed_precision_config``; PyTorch's is taken
    field by field."""
    ours = MixedPrecision(param_dtype=torch.bfloat16)
    assert ShardStrategy(mixed_precision=ours).mixed_precision_config == ours
    translated = ShardStrategy(mixed_precision=TorchMixedPrecision(param_dtype=torch.float16)).mixed_precision_config
    assert translated is not None and (translated.param_dtype, translated.reduce_dtype) == (torch.float16,) * 2


def test_cpu_offload_takes_a_bool_or_torchs_cpu_offload() -> None:
    """test_cpu_offload: ``True`` and ``CPUOffload(offload_params=True)`` enable it; ``CPUOffload()`` does not."""
    assert ShardStrategy(cpu_offload=True).cpu_offload is True
    assert ShardStrategy(cpu_offload=CPUOffload(offload_params=True)).cpu_offload is True
    assert ShardStrategy(cpu_offload=CPUOffload()).cpu_offload is False


def test_sharding_strategy_takes_names_in_any_case_and_both_enums() -> None:
    """test_sharding_strategy: default FULL_SHARD; PyTorch's enum, ours, and names in any case."""
    assert ShardStrategy().sharding_strategy is ShardingStrategy.FULL_SHARD
    torch_member = TorchShardingStrategy.SHARD_GRAD_OP
    assert ShardStrategy(sharding_strategy=torch_member).sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert ShardStrategy(sharding_strategy="NO_SHARD").sharding_strategy is ShardingStrategy.NO_SHARD
    assert ShardStrategy(sharding_strategy="no_shard").sharding_strategy is ShardingStrategy.NO_SHARD


def test_hybrid_shard_needs_neither_a_wrap_policy_nor_a_process_group() -> None:
    """test_hybrid_shard_configuration: HYBRID_SHARD with or without a wrap policy or mesh; no ``process_group``
    argument and no ``_HYBRID_SHARD_ZERO2``."""
    for kwargs in ({}, {"auto_wrap_policy": {nn.Linear}}, {"device_mesh": (2, 4)}):
        assert ShardStrategy(sharding_strategy="HYBRID_SHARD", **kwargs).sharding_strategy.name == "HYBRID_SHARD"
    with pytest.raises(ValueError, match="no counterpart"):
        ShardStrategy(sharding_strategy=TorchShardingStrategy._HYBRID_SHARD_ZERO2)
    with pytest.raises(TypeError, match="process_group"):
        ShardStrategy(sharding_strategy="HYBRID_SHARD", process_group=(Mock(), Mock()))  # type: ignore[call-arg]


@pytest.mark.parametrize("flag", ["use_orig_params", "limit_all_gathers", "sync_module_states"])
def test_fsdp_flags_are_taken_as_true_and_refused_as_false(flag: str) -> None:
    """test_setup_use_orig_params: ``use_orig_params=True`` (the default) is what ShardStrategy always does;
    ``False`` is refused when the strategy is built (FSDPStrategy refuses it at a joint set-up)."""
    ShardStrategy(**{flag: True})
    with pytest.raises(ValueError, match=f"{flag}=False cannot be honoured"):
        ShardStrategy(**{flag: False})


def test_checkpoint_io_unsupported() -> None:
    """The strategy writes checkpoints itself: reading its ``CheckpointIO`` plugin, or setting one (as
    ``Fabric(plugins=[...])`` does, before any process starts), is ``NotImplementedError`` in FSDPStrategy's words,
    then ours; so is passing one to the strategy."""

    class Elsewhere(TorchCheckpointIO):
        pass

    strategy = ShardStrategy()
    with pytest.raises(NotImplementedError, match="does not use the `CheckpointIO` plugin"):
        _ = strategy.checkpoint_io
    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO` plugin.*Elsewhere"):
        strategy.checkpoint_io = Elsewhere()
    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO` plugin.*Elsewhere"):
        ShardStrategy(checkpoint_io=Elsewhere())
    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO` plugin.*Elsewhere"):
        L.Fabric(accelerator="cpu", devices=1, strategy=ShardStrategy(), plugins=[Elsewhere()])


NOT_SET_UP = "is only possible if the module passed to .* is wrapped in `FullyShardedDataParallel`"  # Lightning's


@pytest.mark.parametrize("module", [nn.Linear(2, 2), Mock()], ids=["plain module", "not a module"])
def test_no_backward_sync_needs_a_set_up_module(module: Any) -> None:
    """test_no_backward_sync: ``TypeError`` for a module the strategy did not set up (or anything else), in
    Lightning's words first, then saying what to do."""
    control = ShardStrategy()._backward_sync_control
    expected = f"{NOT_SET_UP}.*Got: .*not sharded"
    with pytest.raises(TypeError, match=expected), control.no_backward_sync(module, True):
        pass


def test_a_precision_plugin_the_strategy_cannot_run_is_a_type_error() -> None:
    """test_forbidden_precision_raises: ``TypeError`` in the constructor and on assignment; Fabric's
    ``HalfPrecision`` is translated instead (a deliberate difference)."""
    with pytest.raises(TypeError, match="ShardPrecision"):
        ShardStrategy(precision=DoublePrecision())
    strategy = ShardStrategy()
    with pytest.raises(TypeError, match="ShardPrecision"):
        strategy.precision = DoublePrecision()
    translated = ShardStrategy(precision=HalfPrecision("bf16-true")).precision
    assert isinstance(translated, ShardPrecision) and translated.precision == "bf16-true"


def test_clipping_by_norm_needs_a_set_up_module() -> None:
    """test_grad_clipping_norm_error: ``TypeError`` for a module the strategy did not set up, or for something that is
    no module at all, in Lightning's words first, saying which call needs it."""
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for given in (module, Mock()):
        with pytest.raises(TypeError, match=NOT_SET_UP) as raised_error:
            ShardStrategy().clip_gradients_norm(given, optimizer, max_norm=1.0)
        assert "`ShardStrategy.clip_gradients_norm` is set up with fabric.setup_module()" in str(raised_error.value)


def test_save_checkpoint_refuses_storage_options(tmp_path: Path) -> None:
    """test_save_checkpoint_storage_options: ``TypeError`` naming the argument, before anything is written. A
    deliberate difference: ``storage_options`` are taken for URLs (``s3://...``), so only a local path refuses them.
    The message starts in Lightning's words, then says why."""
    with pytest.raises(TypeError, match=re.escape("`ShardStrategy.save_checkpoint(..., storage_options=...)` is not")):
        ShardStrategy().save_checkpoint(path=tmp_path, state={}, storage_options=Mock())


def test_loading_needs_a_state_to_fill(tmp_path: Path) -> None:
    """test_load_checkpoint_no_state: ``ValueError`` for ``state=None`` and ``state={}``."""
    for state in (None, {}):
        with pytest.raises(ValueError, match="pass the state with the set-up model"):
            ShardStrategy().load_checkpoint(path=tmp_path, state=state)


def test_unknown_state_dict_type_is_a_value_error() -> None:
    """test_save_checkpoint_unknown_state_dict_type: ``ValueError``, when the strategy is built."""
    with pytest.raises(ValueError, match="Unknown state_dict_type"):
        ShardStrategy(state_dict_type="invalid")  # type: ignore[arg-type]


def test_loading_a_bare_optimizer_is_not_implemented(tmp_path: Path) -> None:
    """test_load_raw_checkpoint_optimizer_unsupported: ``fabric.load_raw(path, optimizer)`` raises
    ``NotImplementedError``."""
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(NotImplementedError):
        ShardStrategy().load_checkpoint(path=tmp_path, state=optimizer)


class _Stop(Exception):
    pass


def set_up_with_timeout(monkeypatch: pytest.MonkeyPatch, timeout: timedelta) -> dict[str, Any]:
    """Set the strategy's process group up with ``init_process_group`` replaced by a recorder; what each timeout
    became."""
    seen: dict[str, Any] = {}

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        seen["created with"] = kwargs["timeout"]
        raise _Stop  # stop before anything needs a real group

    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    strategy = ShardStrategy(timeout=timeout, parallel_devices=[torch.device("cpu")])
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = Mock()
    with pytest.raises(_Stop):
        strategy.setup_environment()
    return seen


def test_timeout_reaches_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_set_timeout: a ``timeout`` of 10 minutes or more is the one the process group is created with; a shorter
    one is not (a deliberate difference): the rendezvous, every rank connecting, waits 10 minutes, and the shorter
    ``timeout`` bounds every wait once the group exists (checked on live ranks in tests/test_stall.py)."""
    assert set_up_with_timeout(monkeypatch, timedelta(hours=2))["created with"] == timedelta(hours=2)
    assert set_up_with_timeout(monkeypatch, timedelta(seconds=30))["created with"] == timedelta(minutes=10)


def threads_left_after_set_up(rank: int, world_size: int) -> dict[str, Any]:
    f = fabric(ShardStrategy())
    f.setup_module(nn.Linear(4, 4))
    ours = [t for t in threading.enumerate() if t.name.startswith("lightning_shard")]
    stoppable = [t.daemon and callable(getattr(t, "stop", None)) for t in ours]
    for thread in ours:
        thread.stop()  # type: ignore[attr-defined]  # what thread checks of test suites do
    after = f.all_reduce(torch.ones(1), reduce_op="sum")  # the process group is unaffected
    return {"threads": len(ours), "stoppable": stoppable, "alive": [t.is_alive() for t in ours], "sum": after.item()}


def test_threads_left_running_can_be_stopped_as_test_suites_do() -> None:
    """Lightning's test suites (and suites modelled on them) fail a test that leaves a thread running, unless it is
    a daemon thread with a ``stop()`` that ends it. The thread publishing a rank's progress is one."""
    for result in on_ranks(threads_left_after_set_up):
        assert result["threads"] >= 1 and all(result["stoppable"]) and not any(result["alive"]), result
        assert result["sum"] == 2.0


def test_device_mesh_annotation_parses_a_pair_from_the_command_line() -> None:
    """test_device_mesh_type_annotation: jsonargparse turns ``--device_mesh=[1, 4]`` into ``(1, 4)``, given the type
    the bare signature holds."""
    import jsonargparse

    annotation = inspect.signature(ShardStrategy).parameters["device_mesh"].annotation
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--device_mesh", type=annotation)
    assert parser.parse_args(["--device_mesh=[1, 4]"]).device_mesh == (1, 4)
    assert typing.get_type_hints(ShardStrategy.__init__)["device_mesh"] == annotation


# ----------------------------------------------------------------------------------------------------------------
# Set-up, training and state on two ranks
# ----------------------------------------------------------------------------------------------------------------


def grads_with_no_backward_sync(rank: int, world_size: int, grad_sync: str, enabled: bool) -> dict[str, Any]:
    f = fabric(ShardStrategy(grad_sync=grad_sync))
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    model = f.setup_module(nn.Linear(4, 3))
    model.load_state_dict(reference.state_dict())
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * r + i)) for r in range(2) for i in (0, 1)]
    mine = batches[2 * rank: 2 * rank + 2]
    with f.no_backward_sync(model, enabled=enabled):
        f.backward(model(mine[0]).square().sum())
    after_first = [p.grad is not None for p in model.parameters()]
    f.backward(model(mine[1]).square().sum())
    for b in batches:  # what DDP computes: the mean over ranks of each rank's summed gradients
        reference(b).square().sum().div(world_size).backward()
    engine = sharded_module_of(plain_module(model))
    assert engine is not None
    grads = {p.fqn: engine.gather_full(p, p.sharded.grad) for p in engine.sharded_params()}
    expected = {n: p.grad for n, p in reference.named_parameters()}
    return {"after_first": after_first, "grads": grads, "expected": expected}


@pytest.mark.parametrize(("grad_sync", "enabled", "held"), [("step", True, True), ("step", False, False),
                                                             ("microbatch", True, False)])
def test_no_backward_sync_holds_the_reduction_back_and_the_gradients_add_up(
    grad_sync: str, enabled: bool, held: bool
) -> None:
    """test_no_backward_sync: with ``enabled=True`` (and ``grad_sync="step"``) the micro-batch's gradients are not
    reduced into the shards until a backward outside the context; with ``enabled=False`` they are at once. Either
    way the accumulated gradients are DDP's."""
    for result in on_ranks(grads_with_no_backward_sync, grad_sync, enabled):
        assert result["after_first"] == [not held] * 2
        torch.testing.assert_close(result["grads"], result["expected"])


def checkpointed_forward_counts(rank: int, world_size: int, policy: Any) -> dict[str, int]:
    f = fabric(ShardStrategy(activation_checkpointing_policy=policy))
    CountingBlock.calls = OtherCountingBlock.calls = 0
    model = f.setup_module(nn.Sequential(CountingBlock(4, 4), OtherCountingBlock(4, 4), nn.Linear(4, 1)))
    f.backward(model(torch.randn(2, 4)).sum())
    return {"CountingBlock": CountingBlock.calls, "OtherCountingBlock": OtherCountingBlock.calls}


@pytest.mark.parametrize(
    ("policy", "recomputed"),
    [
        ({CountingBlock}, {"CountingBlock"}),
        (ModuleWrapPolicy({CountingBlock}), {"CountingBlock", "OtherCountingBlock"}),
    ],
)
def test_activation_checkpointing_recomputes_the_chosen_modules(policy: Any, recomputed: set[str]) -> None:
    """test_activation_checkpointing: the chosen modules run forward again in backward, the others once."""
    for counts in on_ranks(checkpointed_forward_counts, policy):
        assert counts == {name: 2 if name in recomputed else 1 for name in counts}, counts


def one_module_in_the_state(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    f = fabric(ShardStrategy())
    model = f.setup_module(nn.Linear(4, 4))
    other = f.setup_module(nn.Linear(4, 4))
    path = f.broadcast(f"{tmp}/checkpoint")
    f.save(path, {"model": model})
    plain_file = f"{tmp}/weights.safetensors"
    if rank == 0:
        save_file({k: v.contiguous() for k, v in nn.Linear(4, 4).state_dict().items()}, plain_file)
    f.barrier()
    return {
        "save nothing": raised(lambda: f.save(f"{tmp}/x", {})),
        "save plain module": raised(lambda: f.save(f"{tmp}/x", {"model": nn.Linear(3, 3)})),
        "save two": raised(lambda: f.save(f"{tmp}/x", {"model1": model, "model2": other})),
        "load nothing": raised(lambda: f.load(path, {"other": "data"})),
        "load plain module": raised(lambda: f.load(path, {"model": nn.Linear(3, 3)})),
        "load two": raised(lambda: f.load(path, {"model1": model, "model2": other})),
        "load raw module": raised(lambda: f.load_raw(plain_file, model)),
    }


def test_a_checkpoint_holds_exactly_one_set_up_module(tmp_path: Path) -> None:
    """test_save_checkpoint_one_fsdp_module_required / test_load_checkpoint_one_fsdp_module_required: saving or loading
    a state with no set-up module, or with two, is a ``ValueError``; a set-up module alone (``load_raw``) is fine."""
    for outcome in on_ranks(one_module_in_the_state, str(tmp_path)):
        assert outcome.pop("load raw module") == ""
        for case, message in outcome.items():
            assert message.startswith("ValueError") and "exactly one module" in message, (case, message)


def load_from_an_empty_directory(rank: int, world_size: int, path: str) -> dict[str, str]:
    f = fabric(ShardStrategy())
    model = f.setup_module(nn.Linear(4, 4))
    return {"load": raised(lambda: f.load(path, {"model": model})), "load_raw": raised(lambda: f.load_raw(path, model)),
            "load, no module set up": raised(lambda: f.load(path, {"model": nn.Linear(4, 4)}))}


def test_loading_a_path_that_is_not_a_checkpoint_is_a_value_error(tmp_path: Path) -> None:
    """test_load_unknown_checkpoint_type / test_load_raw_checkpoint_validate_single_file: an empty directory is no
    checkpoint, for ``load`` and ``load_raw`` alike: ``ValueError`` (``CheckpointError``) naming the path, before
    the state is looked at (a state without a set-up module gets the same error). ``load_raw`` also reads the model
    of a checkpoint directory, not only a single file (a deliberate difference)."""
    (tmp_path / "empty_dir").mkdir()
    lightnings = {  # the words of Lightning's strategies come first, for code and log searches written for them
        "load": "does not point to a valid checkpoint",
        "load, no module set up": "does not point to a valid checkpoint",
        "load_raw": "The given path must be a single file containing the full state dict",
    }
    for outcome in on_ranks(load_from_an_empty_directory, str(tmp_path / "empty_dir")):
        for call, message in outcome.items():
            assert message.startswith("CheckpointError") and "empty_dir" in message, message
            assert lightnings[call] in message, message
    assert issubclass(lightning_shard.CheckpointError, ValueError)


def save_over_existing_paths(rank: int, world_size: int, tmp: str, state_dict_type: str) -> dict[str, str]:
    f = fabric(ShardStrategy(state_dict_type=state_dict_type))
    model = f.setup_module(nn.Linear(4, 4))
    root = Path(f.broadcast(tmp))
    if rank == 0:
        (root / "not-a-checkpoint").mkdir()
        (root / "not-a-checkpoint" / "file").touch()
        (root / "file.pt").touch()
    f.barrier()
    f.save(root / "checkpoint", {"model": model})
    return {
        "existing checkpoint": raised(lambda: f.save(root / "checkpoint", {"model": model})),
        "not-a-checkpoint": raised(lambda: f.save(root / "not-a-checkpoint", {"model": model})),
        "file.pt": raised(lambda: f.save(root / "file.pt", {"model": model})),
    }


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_save_replaces_a_checkpoint_and_never_other_data(tmp_path: Path, state_dict_type: str) -> None:
    """test_save_checkpoint_path_exists: an existing checkpoint is replaced; a directory that is not a checkpoint and
    a file are refused and kept (FSDPStrategy overwrites or writes into them: a deliberate difference)."""
    for outcome in on_ranks(save_over_existing_paths, str(tmp_path), state_dict_type):
        assert outcome["existing checkpoint"] == ""
        assert "Refusing to save" in outcome["not-a-checkpoint"] and "Refusing to save" in outcome["file.pt"]


class TiedWeights(nn.Module):
    """An embedding tied to the output head, as in Llama/GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.layers = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 100, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layers(self.embed(x)))


def tied_weights_under_a_policy(rank: int, world_size: int, policy: Any, tied: bool) -> dict[str, Any]:
    f = fabric(ShardStrategy(auto_wrap_policy=policy))
    torch.manual_seed(0)
    module = TiedWeights() if tied else nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    with recorded_warnings() as messages:
        model = f.setup_module(module)
        optimizer = f.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        x = torch.randint(0, 100, (2, 3)) if tied else torch.randn(2, 32)
        f.backward(model(x).float().square().mean())
        optimizer.step()
    weights = full_weights(module)
    return {
        "warnings": [m for m in messages if "shared" in m or "tied" in m],
        "still tied": (not tied) or torch.equal(weights["embed.weight"], weights["head.weight"]),
    }


@pytest.mark.parametrize(
    ("case", "policy", "tied"),
    [
        ("tied weights across units", ModuleWrapPolicy({nn.Embedding}), True),
        ("tied weights in one unit", ModuleWrapPolicy({nn.Sequential}), True),
        ("no shared parameters", ModuleWrapPolicy({nn.Linear}), False),
        ("no policy", None, True),
    ],
)
def test_shared_parameters_need_no_warning_and_stay_tied(case: str, policy: Any, tied: bool) -> None:
    """test_warn_shared_params_across_fsdp_units, test_no_warn_shared_params_same_fsdp_unit,
    test_no_warn_no_shared_params, test_no_warn_no_policy: FSDPStrategy warns when tied weights fall into different
    units, because FSDP would split them. Here a tied weight belongs to the lowest unit holding both uses and is
    stored once, so no case warns (a deliberate difference for the first) and the tie survives a training step."""
    for result in on_ranks(tied_weights_under_a_policy, policy, tied):
        assert result == {"warnings": [], "still tied": True}, case


# ----------------------------------------------------------------------------------------------------------------
# Integration: training, saving and loading (test_fsdp_integration.py)
# ----------------------------------------------------------------------------------------------------------------


def _two_layers(manual_wrapping: bool) -> nn.Module:
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    if manual_wrapping:
        for i in (0, 2):
            model[i] = wrap(model[i])
    return model


def _train_step(f: L.Fabric, manual_wrapping: bool, seed: int) -> tuple[nn.Module, Any]:
    f.seed_everything(seed)
    with f.init_module():
        model = _two_layers(manual_wrapping)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = f.setup(model, optimizer)
    loss = torch.nn.functional.mse_loss(model(torch.randn(4, 32)), torch.ones(4, 2))
    f.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def train_save_load(rank: int, world_size: int, tmp: str, manual_wrapping: bool, precision: str) -> dict[str, Any]:
    policy = None if manual_wrapping else {nn.Linear}
    f = fabric(ShardStrategy(auto_wrap_policy=policy), precision=precision)
    model, optimizer = _train_step(f, manual_wrapping, seed=0)
    path = f.broadcast(f"{tmp}/checkpoint")
    before = module_full_state(plain_module(model), [optimizer.optimizer])
    f.save(path, {"model": model, "optimizer": optimizer, "steps": 1})
    files = sorted(p.name for p in Path(path).iterdir())
    model, optimizer = _train_step(f, manual_wrapping, seed=1)  # other weights, other optimizer state
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "steps": 0}
    remainder = f.load(path, state)
    after = module_full_state(plain_module(model), [optimizer.optimizer])
    coconut = raised(lambda: f.load(path, {"model": model, "coconut": 11}))
    lenient = {"model": model, "coconut": 11}
    f.load(path, lenient, strict=False)
    return {"units": unit_names(model), "files": files, "before": before, "after": after, "steps": state["steps"],
            "remainder": remainder, "coconut": coconut, "lenient": lenient["coconut"]}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("manual_wrapping", [True, False])
def test_train_save_and_load_restore_model_optimizer_and_values(
    tmp_path: Path, manual_wrapping: bool, precision: str
) -> None:
    """test_train_save_load: units by hand (``wrap()`` under ``fabric.init_module()``) or by policy; the sharded save
    writes one file per rank; loading restores the weights and optimizer state exactly and the plain values; a key
    the checkpoint lacks is a ``KeyError`` naming it unless ``strict=False``, which leaves the value alone."""
    for result in on_ranks(train_save_load, str(tmp_path), manual_wrapping, precision):
        assert result["units"] == ["0", "2"]
        assert result["files"] == ["index.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors",
                                   "trainer_state.json", "trainer_state.safetensors"]
        assert_same(result["after"], result["before"])
        assert result["steps"] == 1 and result["remainder"] == {}
        assert result["coconut"].startswith("KeyError") and "coconut" in result["coconut"], result["coconut"]
        assert result["lenient"] == 11


def full_state_dict_round_trip(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full"))
    model, optimizer = _train_step(f, manual_wrapping=False, seed=0)
    path = f.broadcast(f"{tmp}/full-checkpoint")
    f.save(path, {"model": model, "optimizer": optimizer, "steps": 1})
    before = module_full_state(plain_module(model), [optimizer.optimizer])
    with lightning_shard.summon_full_params(model):  # as FSDP.summon_full_params: the full weights, by name
        summoned = {k: v.detach().clone() for k, v in model.state_dict().items()}
    on_disk = load_file(f"{path}/model.safetensors")
    model, optimizer = _train_step(f, manual_wrapping=False, seed=1)
    remainder = f.load(path, {"model": model, "optimizer": optimizer})
    after = module_full_state(plain_module(model), [optimizer.optimizer])
    optimizer.step()  # the loaded state steps
    return {"on_disk": on_disk, "summoned": summoned, "before": before, "after": after, "remainder": remainder}


def test_full_state_dict_is_one_model_file_and_loads_back_exactly(tmp_path: Path) -> None:
    """test_save_full_state_dict: with ``state_dict_type="full"`` the model is one file of the plain state dict
    (``model.safetensors``, read with ``safetensors.torch.load_file``, not ``torch.load``: a deliberate difference)
    equal to the weights ``summon_full_params`` gives, and loading the checkpoint into a sharded model restores
    weights and optimizer state exactly, returning the values the state did not ask for."""
    for result in on_ranks(full_state_dict_round_trip, str(tmp_path)):
        assert_same(result["on_disk"], result["before"]["params"])
        assert_same(result["summoned"], result["on_disk"])
        assert_same(result["after"], result["before"])
        assert result["remainder"] == {"steps": 1}


def plain_weights_into_a_sharded_model(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, f"{tmp}/model.safetensors")
        torch.save(plain.state_dict(), f"{tmp}/model.pt")
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}))
    f.barrier()
    model, _ = _train_step(f, manual_wrapping=False, seed=1)
    f.load_raw(f"{tmp}/model.safetensors", model)
    from_safetensors = full_weights(model)
    _train_step(f, manual_wrapping=False, seed=2)  # other weights again, then the torch.save file
    f.load_raw(f"{tmp}/model.pt", model)
    return {"safetensors": from_safetensors, "torch.save": full_weights(model),
            "expected": dict(plain.named_parameters())}


def test_a_plain_models_weights_load_into_the_sharded_model(tmp_path: Path) -> None:
    """test_load_full_state_dict_into_sharded_model: an unsharded model's weights load into the sharded model with
    ``fabric.load_raw``, weight for weight, from a ``.safetensors`` file and from a ``torch.save`` file of its state
    dict (read with ``torch.load(weights_only=True)``, never unpickled in full)."""
    for result in on_ranks(plain_weights_into_a_sharded_model, str(tmp_path)):
        expected = {k: v.detach() for k, v in result["expected"].items()}
        assert_same(result["safetensors"], expected)
        assert_same(result["torch.save"], expected)


def single_device_checkpoint_into_a_sharded_model(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    torch.manual_seed(0)
    plain = _two_layers(manual_wrapping=False)
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(plain(torch.randn(4, 32)), torch.ones(4, 2)).backward()
    optimizer.step()
    path = f"{tmp}/full-checkpoint.pt"
    if rank == 0:  # what fabric.save writes on one device: one pickle of the plain state dicts
        torch.save({"model": plain.state_dict(), "optimizer": optimizer.state_dict(), "steps": 1}, path)
    names = {id(p): n for n, p in plain.named_parameters()}
    expected = {
        "params": {n: p.detach().clone() for n, p in plain.named_parameters()},
        "optimizer": {f"0/{names[id(p)]}/{k}": v.clone() for p, st in optimizer.state.items() for k, v in st.items()},
    }
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}))
    f.barrier()
    model, sharded_optimizer = _train_step(f, manual_wrapping=False, seed=1)
    state: dict[str, Any] = {"model": model, "optimizer": sharded_optimizer, "steps": 44}
    f.load(path, state)
    return {"expected": expected, "loaded": module_full_state(plain_module(model), [sharded_optimizer.optimizer]),
            "steps": state["steps"]}


def test_a_single_device_checkpoint_loads_into_the_sharded_model(tmp_path: Path) -> None:
    """test_load_full_state_dict_into_sharded_model / test_save_full_state_dict (3.): the full checkpoint Fabric writes
    on one device (a ``torch.save`` of the plain state dicts) loads into the sharded model and optimizer exactly, and
    the plain values come back."""
    for result in on_ranks(single_device_checkpoint_into_a_sharded_model, str(tmp_path)):
        assert_same(result["loaded"], result["expected"])
        assert result["steps"] == 1


def setup_module_placement(rank: int, world_size: int, move_to_device: bool) -> dict[str, Any]:
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}))
    model = f.setup_module(nn.Linear(10, 10, bias=False), move_to_device=move_to_device)
    params = list(model.parameters())
    return {"count": len(params), "numel": params[0].numel(), "device": str(params[0].device),
            "is_parameter": isinstance(params[0], nn.Parameter), "module_device": str(model.device),
            "fabric_device": str(f.device)}


@pytest.mark.parametrize("move_to_device", [True, False])
def test_setup_module_shards_onto_the_device_whatever_move_to_device_says(move_to_device: bool) -> None:
    """test_setup_module_move_to_device: the strategy places the shards: a 10x10 weight becomes one ``nn.Parameter``
    of 50 elements per rank, on the device, and the module reports that device."""
    for result in on_ranks(setup_module_placement, move_to_device):
        assert result == {"count": 1, "numel": 50, "device": "cpu", "is_parameter": True, "module_device": "cpu",
                          "fabric_device": "cpu"}


def joint_setup_with_param_groups(rank: int, world_size: int) -> dict[str, Any]:
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}))
    model = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(5, 2, bias=False))
    optimizer = torch.optim.Adam([{"params": model[0].parameters(), "lr": 1e-2},
                                  {"params": model[1].parameters(), "lr": 1e-6}])
    wrapped_model, wrapped_optimizer = f.setup(model, optimizer)
    groups = wrapped_optimizer.param_groups
    return {"lrs": [g["lr"] for g in groups],
            "same": [groups[i]["params"][0] is wrapped_model.module[i].weight for i in range(2)],
            "parameters": [isinstance(wrapped_model.module[i].weight, nn.Parameter) for i in range(2)]}


def test_joint_setup_keeps_parameter_groups_on_the_layers_parameters() -> None:
    """test_setup_with_orig_params_and_multiple_param_groups: ``fabric.setup(model, optimizer)`` keeps both parameter
    groups and their learning rates, each pointing at its layer's own (sharded) ``nn.Parameter``."""
    for result in on_ranks(joint_setup_with_param_groups):
        assert result == {"lrs": [1e-2, 1e-6], "same": [True, True], "parameters": [True, True]}


def init_module_placement(rank: int, world_size: int, precision: str) -> list[Any]:
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}), precision=precision)
    seen = []
    for empty_init in (False, True):
        with f.init_module(empty_init=empty_init):
            model = nn.Linear(100, 100, bias=False)
        seen.append((str(model.weight.device), model.weight.dtype))
        model = f.setup(model)
        seen.append((str(model.weight.device), model.weight.dtype))
    return seen


@pytest.mark.parametrize(
    ("precision", "dtype"), [("32-true", torch.float32), ("16-true", torch.float16), ("bf16-true", torch.bfloat16)]
)
def test_init_module_builds_in_the_precisions_dtype_and_setup_places_it(precision: str, dtype: torch.dtype) -> None:
    """test_module_init_context: under ``fabric.init_module(empty_init=...)`` on the CPU or the meta device in the
    precision's dtype; after set-up on the device, same dtype."""
    for seen in on_ranks(init_module_placement, precision):
        assert seen == [("cpu", dtype), ("cpu", dtype), ("meta", dtype), ("cpu", dtype)]


def save_with_filter(rank: int, world_size: int, tmp: str, state_dict_type: str) -> tuple[list[str], list[str]]:
    f = fabric(ShardStrategy(state_dict_type=state_dict_type))
    model = f.setup_module(nn.Linear(32, 2))
    f.save(f"{tmp}/filtered", {"model": model}, filter={"model": lambda k, v: "bias" in k})
    index = read_index(Path(tmp) / "filtered")
    return sorted(index["tensors"]), sorted(index["left_out"])


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_save_with_a_filter_writes_only_the_filtered_keys(tmp_path: Path, state_dict_type: str) -> None:
    """test_save_filter: the filtered keys are written, in both layouts (FSDPStrategy: the full layout only,
    ``NotImplementedError`` for the sharded one: a deliberate difference); the weights left out are recorded, and a
    load checks them (tests/test_partial_checkpoints.py)."""
    for tensors, left_out in on_ranks(save_with_filter, str(tmp_path), state_dict_type):
        assert (tensors, left_out) == (["model/bias"], ["model/weight"])


def already_checkpointed(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    f = fabric(ShardStrategy(activation_checkpointing_policy={nn.Linear}))
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    apply_activation_checkpointing(model)
    with recorded_warnings() as messages:
        f.setup(model)
    return {"warned": any("already checkpointed" in m for m in messages)}


def test_a_model_checkpointed_by_hand_gets_a_warning() -> None:
    """test_manual_activation_checkpointing: a policy on a model PyTorch's ``apply_activation_checkpointing``
    already checkpoints warns on rank 0."""
    assert on_ranks(already_checkpointed)[0] == {"warned": True}


def wrapped_by_hand_under_a_policy(rank: int, world_size: int) -> dict[str, Any]:
    f = fabric(ShardStrategy(auto_wrap_policy=lambda module, name: name == "0"))
    results = {}
    for empty_init in (False, True):
        with f.init_module(empty_init=empty_init):
            model = nn.Sequential(nn.Linear(1, 1), nn.ReLU(), wrap(nn.Linear(1, 1)))
        model = f.setup(model)
        results[f"empty_init={empty_init}"] = {
            "units": unit_names(model), "meta": any(p.is_meta for p in model.parameters())
        }
    return results


def test_units_by_hand_and_by_policy_together_and_meta_weights_are_materialised() -> None:
    """test_rewrap_warnings (a deliberate difference): FSDPStrategy skips its policy (with a warning) for a model
    already wrapped by hand and leaves such a model's meta-device weights on the meta device (with a warning). Here
    the units chosen by hand and by the policy are units together, and every weight is materialised."""
    for results in on_ranks(wrapped_by_hand_under_a_policy):
        for result in results.values():
            assert result == {"units": ["0", "2"], "meta": False}


def clip_gradients(rank: int, world_size: int, clip_type: str, precision: str) -> dict[str, Any]:
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}), precision=precision)
    model = nn.Linear(32, 2, bias=False)
    model.weight.data.fill_(0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = f.setup(model, optimizer)
    f.backward(model(torch.full((1, 32), 0.1)).sum())  # every gradient element is the same
    engine = sharded_module_of(plain_module(model))
    assert engine is not None
    param = next(engine.sharded_params())
    grad_before = engine.gather_full(param, param.sharded.grad)
    if clip_type == "norm":
        returned = f.clip_gradients(model, optimizer, max_norm=float(grad_before.norm()) / 10)
    else:
        returned = f.clip_gradients(model, optimizer, clip_val=float(grad_before[0, 0]) / 2)
    grad_after = engine.gather_full(param, param.sharded.grad)
    optimizer.step()
    return {"before": grad_before, "after": grad_after, "returned": returned}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("clip_type", ["norm", "val"])
def test_clip_gradients_by_norm_and_by_value(clip_type: str, precision: str) -> None:
    """test_clip_gradients: clipping by value sets every element to the clip value; clipping by norm, which
    FSDPStrategy skips as incorrect, scales the full gradient to the requested global norm and returns the norm
    before clipping."""
    for result in on_ranks(clip_gradients, clip_type, precision):
        before, after = result["before"], result["after"]
        if clip_type == "val":
            torch.testing.assert_close(after, torch.full_like(before, float(before[0, 0]) / 2))
        else:
            torch.testing.assert_close(after.norm(), before.norm() / 10)
            torch.testing.assert_close(result["returned"], before.norm())


def save_and_load_through_urls(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    here = os.getcwd()
    os.chdir(tmp)  # a URL taken for a relative path lands here, not in the repository
    try:
        return _save_and_load_through_urls(rank, world_size, tmp)
    finally:
        os.chdir(here)


def _save_and_load_through_urls(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}))
    model, optimizer = _train_step(f, manual_wrapping=False, seed=0)
    url = "local://" + f.broadcast(f"{tmp}/checkpoint")
    f.save(url, {"model": model, "optimizer": optimizer, "steps": 5})
    before = module_full_state(plain_module(model), [optimizer.optimizer])
    model, optimizer = _train_step(f, manual_wrapping=False, seed=1)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "steps": 0}
    f.load(url, state)
    unknown = raised(lambda: f.save("nosuchprotocol://bucket/run/ckpt", {"model": model}))
    return {"before": before, "after": module_full_state(plain_module(model), [optimizer.optimizer]),
            "steps": state["steps"], "unknown": unknown, "taken for a local path": Path("nosuchprotocol:").exists(),
            "written": (Path(tmp) / "checkpoint" / "index.json").is_file()}


def test_a_url_reaches_the_storage_layer_whole(tmp_path: Path) -> None:
    """test_save_checkpoint_does_not_corrupt_remote_path (and ModelParallel's remote save, load and
    consolidate-and-load tests over ``local://``): ``fabric.save``/``fabric.load`` with a URL write and read where it
    says, restoring everything; a URL of a protocol nobody serves is refused naming it, never taken for a local
    path."""
    for result in on_ranks(save_and_load_through_urls, str(tmp_path)):
        assert result["written"] is True
        assert_same(result["after"], result["before"])
        assert result["steps"] == 5
        assert "nosuchprotocol" in result["unknown"], result["unknown"]
        assert result["taken for a local path"] is False


def consolidate_and_load(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    f = fabric(ShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded"))
    model, optimizer = _train_step(f, manual_wrapping=False, seed=0)
    sharded = f.broadcast(f"{tmp}/checkpoint_sharded")
    f.save(sharded, {"model": model, "optimizer": optimizer, "steps": 1})
    single = f"{tmp}/checkpoint_full.safetensors"
    if rank == 0:
        lightning_shard.consolidate(sharded, single)
    f.barrier()
    trained = full_weights(model)
    fresh, _ = _train_step(f, manual_wrapping=False, seed=1)
    f.load_raw(single, fresh)
    return {"trained": trained, "loaded": full_weights(fresh)}


def test_a_sharded_checkpoint_consolidates_and_loads_into_a_new_sharded_model(tmp_path: Path) -> None:
    """test_save_sharded_and_consolidate_and_load: a sharded save becomes one file (``consolidate``) that loads into a
    freshly set-up sharded model (``fabric.load_raw``), weight for weight. The consolidated file holds the model
    only: the optimizer state resumes from the checkpoint directory itself (a deliberate difference)."""
    for result in on_ranks(consolidate_and_load, str(tmp_path)):
        assert_same(result["loaded"], result["trained"])
