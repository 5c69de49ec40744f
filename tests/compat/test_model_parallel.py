"""Both front ends' ``ShardStrategy`` against what Lightning checks of its ``ModelParallelStrategy``
(``tests/tests_pytorch/strategies/test_model_parallel*.py``, ``tests/tests_fabric/strategies/test_model_parallel*.py``)
where the behaviour is not tensor parallelism itself. Checks that ModelParallelStrategy shares with FSDPStrategy
(storage options, checkpoint paths, one module per checkpoint, ...) live in the two FSDP files; the map is in
``tests/compat/__init__.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest.mock import Mock

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

import lightning_shard
from lightning_shard import ShardStrategy
from lightning_shard.engine import sharded_module_of
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy
from tests.compat.support import (
    FeedForward,
    assert_same,
    ddp_checkpoint_into_shard_strategy,
    fabric,
    full_weights,
    on_ranks,
    plain_module,
    raised,
    recorded_warnings,
    trainer,
)

# ----------------------------------------------------------------------------------------------------------------
# The mesh
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy_class", [ShardStrategy, FabricShardStrategy])
def test_the_mesh_is_not_available_before_the_processes_are_set_up(strategy_class: type) -> None:
    """test_device_mesh_access: reading the mesh before set-up is a ``RuntimeError``."""
    with pytest.raises(RuntimeError, match="mesh exists only once the processes are set up"):
        _ = strategy_class().mesh


@pytest.mark.parametrize("strategy_class", [ShardStrategy, FabricShardStrategy])
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_the_device_mesh_before_set_up_is_refused_in_model_parallel_strategys_words(
    strategy_class: type, tensor_parallel_size: int
) -> None:
    """test_device_mesh_access: ``strategy.device_mesh`` read before the processes are set up is the
    ``RuntimeError`` ModelParallelStrategy raises, whatever ``tensor_parallel_size``."""
    strategy = strategy_class(tensor_parallel_size=tensor_parallel_size)
    with pytest.raises(RuntimeError, match="Accessing the device mesh before processes have initialized"):
        _ = strategy.device_mesh


@pytest.mark.parametrize("strategy_class", [ShardStrategy, FabricShardStrategy])
@pytest.mark.parametrize(
    ("num_nodes", "devices", "data_parallel_size", "tensor_parallel_size"),
    [(1, 4, 1, 1), (1, 4, 2, 3), (1, 4, 4, 2), (2, 4, 1, 4), (2, 4, 2, 1), (1, 6, "auto", 4)],
)
def test_parallel_sizes_that_do_not_multiply_to_the_world_are_refused_before_any_rank_is_assigned(
    strategy_class: type, num_nodes: int, devices: int, data_parallel_size: Any, tensor_parallel_size: int
) -> None:
    """test_validate_device_mesh_dimensions: ``data_parallel_size`` x ``tensor_parallel_size`` other than the world
    size is refused by ``setup_environment`` in ModelParallelStrategy's words, as the ``RuntimeError`` it raises and
    a ``ValueError`` (a bad value), before ranks are given to the cluster environment or a process group exists."""
    strategy = strategy_class(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size)
    strategy.accelerator = Mock()
    environment = Mock(world_size=Mock(return_value=num_nodes * devices), local_rank=Mock(return_value=0))
    strategy.cluster_environment = environment
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = num_nodes
    expected = (
        f"The sizes `data_parallel_size={data_parallel_size}` and `tensor_parallel_size={tensor_parallel_size}`"
        f" multiplied should equal the world size \\({num_nodes * devices}\\)"
    )
    with pytest.raises(RuntimeError, match=expected) as info:
        strategy.setup_environment()
    assert isinstance(info.value, ValueError)
    environment.set_global_rank.assert_not_called()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("strategy_class", [ShardStrategy, FabricShardStrategy])
@pytest.mark.parametrize(
    ("num_nodes", "devices", "replicas", "shard_size"),
    [(1, 4, 1, 1), (1, 4, 2, 3), (1, 4, 4, 2), (2, 4, 1, 4), (2, 4, 2, 1)],
)
def test_a_mesh_that_does_not_cover_the_world_is_refused_before_the_process_group(
    strategy_class: type, num_nodes: int, devices: int, replicas: int, shard_size: int
) -> None:
    """test_validate_device_mesh_dimensions: sizes whose product is not the world size are refused when the
    environment is set up, before any process group exists: ``ValueError`` naming both sizes (ModelParallelStrategy:
    ``RuntimeError``; a deliberate difference: it is a bad value)."""
    strategy = strategy_class(sharding_strategy="HYBRID_SHARD", device_mesh=(replicas, shard_size))
    strategy.accelerator = Mock()
    world = num_nodes * devices
    strategy.cluster_environment = Mock(
        world_size=Mock(return_value=world), local_rank=Mock(return_value=1), node_rank=Mock(return_value=0),
        global_rank=Mock(return_value=1),
    )
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = num_nodes
    with pytest.raises(ValueError, match=f"covers {replicas * shard_size} ranks but the world size is {world}"):
        strategy.setup_environment()


def mesh_in_configure_model(rank: int, world_size: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    class Model(BoringModel):
        def configure_model(self) -> None:
            mesh = self.trainer.strategy.mesh
            self.seen = (mesh.replicas, mesh.shard_size, tuple(self.device_mesh.shape))

    model = Model()
    trainer(ShardStrategy(**kwargs), max_steps=1).fit(model)
    f = fabric(FabricShardStrategy(**kwargs))
    mesh = f.strategy.mesh
    return {"trainer": model.seen, "fabric": (mesh.replicas, mesh.shard_size, tuple(f.strategy.device_mesh.shape))}


@pytest.mark.parametrize(
    ("kwargs", "shape"),
    [
        ({}, (1, 2)),
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)}, (2, 1)),
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (1, 2)}, (1, 2)),
        ({"sharding_strategy": "NO_SHARD"}, (2, 1)),
    ],
)
def test_the_mesh_has_the_configured_shape_in_configure_model_and_after_launch(
    kwargs: dict[str, Any], shape: tuple[int, int]
) -> None:
    """test_setup_device_mesh (Trainer and Fabric): the mesh exists in ``configure_model`` and after
    ``fabric.launch()``, with the configured ``(replicas, shard_size)``: the data-parallel layout.
    ModelParallelStrategy's ``("data_parallel", "tensor_parallel")`` ``DeviceMesh`` is ``strategy.device_mesh``
    (``self.device_mesh`` in ``configure_model``), of shape ``(2, 1)`` here."""
    for result in on_ranks(mesh_in_configure_model, kwargs):
        assert result == {"trainer": (*shape, (2, 1)), "fabric": (*shape, (2, 1))}


# ----------------------------------------------------------------------------------------------------------------
# Set-up
# ----------------------------------------------------------------------------------------------------------------


def parallelize_fn_called(rank: int, world_size: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def parallelize(module: nn.Module, mesh: Any) -> nn.Module:
        seen["mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape))
        seen["sharded"] = sharded_module_of(module) is not None
        return module

    f = fabric(FabricShardStrategy(parallelize_fn=parallelize))
    module = f.setup_module(nn.Linear(4, 4))
    return {**seen, "sharded after": sharded_module_of(module) is not None}


def test_parallelize_fn_is_called_with_the_mesh_before_the_model_is_sharded() -> None:
    """test_parallelize_fn_call: ``parallelize_fn(module, device_mesh)`` is called in ``setup_module`` with the
    ``("data_parallel", "tensor_parallel")`` mesh, here of shape (2, 1), before the strategy shards the module (run
    with a plan at (dp=2, tp=2) in tests/test_tensor_parallel.py)."""
    for result in on_ranks(parallelize_fn_called):
        assert result == {"mesh": (("data_parallel", "tensor_parallel"), (2, 1)), "sharded": False,
                          "sharded after": True}


def fit_without_configure_model(rank: int, world_size: int) -> int:
    model = BoringModel()
    t = trainer(ShardStrategy(auto_wrap_policy={nn.Linear}))
    t.fit(model)
    return t.global_step


def test_configure_model_is_optional() -> None:
    """test_configure_model_required (a deliberate difference): ModelParallelStrategy needs ``configure_model`` to
    parallelize in; here a model built in ``__init__`` is sharded by the strategy and trains."""
    assert on_ranks(fit_without_configure_model) == [2, 2]


class NoResetParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight


class MetaModel(L.LightningModule):
    """Two modules without ``reset_parameters``, a parameterless container, a linear layer, and a buffer that the
    LightningModule's own ``reset_parameters`` fills."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(NoResetParameters(), NoResetParameters())
        self.layer2 = nn.Linear(4, 4)
        self.register_buffer("buffer", torch.rand(2))

    def reset_parameters(self) -> None:
        self.buffer.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer2(self.layer1(x))

    def configure_model(self) -> None:
        pass

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch).sum()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_fit_start(self) -> None:
        raise _SetUp  # the model is set up: stop before a forward needs the uninitialised weights


class _SetUp(Exception):
    pass


def materialise_meta_model(rank: int, world_size: int, front_end: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = MetaModel()
    before = (model.layer1[0].weight.is_meta, model.layer2.weight.is_meta, model.buffer.is_meta)
    with recorded_warnings() as messages:
        if front_end == "trainer":
            try:
                trainer(ShardStrategy()).fit(model)
            except _SetUp:
                pass
        else:
            fabric(FabricShardStrategy()).setup_module(model)
    return {
        "before": before,
        "warned": [m for m in messages if "reset_parameters" in m],
        "meta": [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta],
        "buffer": model.buffer.tolist(),
    }


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_set_up_materialises_a_meta_model_and_names_modules_without_reset_parameters(front_end: str) -> None:
    """test_meta_device_materialization: after set-up no parameter or buffer is on the meta device, the
    LightningModule's ``reset_parameters`` has filled its buffer, and rank 0 warns, naming the modules without
    ``reset_parameters()`` (their weights stay uninitialised until loaded)."""
    results = on_ranks(materialise_meta_model, front_end)
    for result in results:
        assert result["before"] == (True, True, True)
        assert result["meta"] == [] and result["buffer"] == [1.0, 1.0]
    assert any("NoResetParameters" in m for m in results[0]["warned"]), results[0]["warned"]


def set_up_a_model_sharded_by_torch(rank: int, world_size: int, front_end: str) -> str:
    from torch.distributed.fsdp import fully_shard

    class Model(BoringModel):
        def __init__(self) -> None:
            super().__init__()
            fully_shard(self.layer)

    if front_end == "trainer":
        return raised(lambda: trainer(ShardStrategy(), max_steps=1).fit(Model()))
    return raised(lambda: fabric(FabricShardStrategy()).setup_module(Model()))


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_a_model_already_sharded_by_torchs_fsdp_is_refused(front_end: str) -> None:
    """test_fsdp_v1_modules_unsupported: modules wrapped by PyTorch's own FSDP are refused with ``TypeError`` at
    set-up (here any FSDP: ``FullyShardedDataParallel`` or ``fully_shard``; the strategy shards the plain model)."""
    for message in on_ranks(set_up_a_model_sharded_by_torch, front_end):
        assert message.startswith("TypeError") and "already sharded by PyTorch's FSDP" in message, message


# ----------------------------------------------------------------------------------------------------------------
# State dicts and checkpoints
# ----------------------------------------------------------------------------------------------------------------


class TemplateModel(L.LightningModule):
    """The LightningModule of Lightning's ModelParallel tests: the gated MLP, AdamW, loss = output sum."""

    def __init__(self) -> None:
        super().__init__()
        self.model = FeedForward()

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(batch).sum()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randn(8, 32, generator=torch.Generator().manual_seed(0)), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters())


def strategy_state_dict(rank: int, world_size: int, state_dict_type: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TemplateModel()
    expected_keys = list(model.state_dict())
    strategy = ShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=state_dict_type)
    trainer(strategy).fit(model)
    state = strategy.lightning_module_state_dict()
    full = full_weights(model)
    as_full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    return {"keys": list(state), "expected_keys": expected_keys,
            "distributed": all(hasattr(v, "full_tensor") for v in state.values()),
            "equal": all(torch.equal(as_full[k].cpu(), full[k]) for k in as_full)}


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_lightning_module_state_dict_is_sharded_on_every_rank_or_full_on_rank_0(state_dict_type: str) -> None:
    """test_strategy_state_dict: ``save_distributed_checkpoint=True`` is ``state_dict_type="sharded"``: every rank
    returns the plain model's keys, in order, as distributed tensors; ``"full"``: rank 0 only, full tensors. Either
    way the values are the trained weights."""
    zero, one = on_ranks(strategy_state_dict, state_dict_type)
    assert zero["keys"] == zero["expected_keys"] and zero["equal"]
    if state_dict_type == "sharded":
        assert one["keys"] == one["expected_keys"] and one["equal"]
        assert zero["distributed"] and one["distributed"]
    else:
        assert one["keys"] == [] and not zero["distributed"]


def fabric_state_dicts(rank: int, world_size: int, state_dict_type: str) -> dict[str, Any]:
    f = fabric(FabricShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=state_dict_type))
    torch.manual_seed(0)
    model = f.setup_module(FeedForward())
    optimizer = f.setup_optimizers(torch.optim.AdamW(model.parameters()))
    f.backward(model(torch.rand(2, 32)).sum())
    optimizer.step()
    module_state = f.strategy.get_module_state_dict(model)
    optimizer_state = f.strategy.get_optimizer_state(optimizer)

    def full(t: Tensor) -> Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return {
        "module": {k: full(v) for k, v in module_state.items()},
        "optimizer keys": sorted(optimizer_state),
        "moments": {k: full(v["exp_avg"]) for k, v in optimizer_state.get("state", {}).items()},
        "weights": full_weights(model),
    }


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_fabric_module_and_optimizer_state_dicts(state_dict_type: str) -> None:
    """test_save_full_state_dict (Fabric, the state dicts it compares): the set-up module's state dict and the
    optimizer's state, sharded on every rank or full on rank 0, hold the trained weights and Adam moments under the
    module's own names."""
    zero, one = on_ranks(fabric_state_dicts, state_dict_type)
    assert_same(zero["module"], zero["weights"])
    assert zero["optimizer keys"] == ["param_groups", "state"]
    assert set(zero["moments"]) == set(zero["weights"])
    if state_dict_type == "sharded":
        assert_same(one["module"], one["weights"])
    else:
        assert one["module"] == {} and one["optimizer keys"] == []


def full_checkpoint_into_a_plain_model(rank: int, world_size: int, tmp: str) -> bool:
    torch.manual_seed(0)
    model = TemplateModel()
    t = trainer(ShardStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="full"))
    t.fit(model)
    path = t.strategy.broadcast(f"{tmp}/last.ckpt")
    t.save_checkpoint(path)
    trained = full_weights(model)
    plain = TemplateModel()
    plain.load_state_dict(load_file(f"{path}/model.safetensors"))
    return all(torch.equal(plain.state_dict()[k], v) for k, v in trained.items())


def test_a_full_checkpoint_holds_a_model_file_a_plain_model_loads(tmp_path: Path) -> None:
    """test_load_full_state_checkpoint_into_regular_model: the full checkpoint's model loads into an unsharded model,
    weight for weight, from ``model.safetensors`` in the checkpoint directory (DDP cannot resume from the directory
    itself, nor take its optimizer state: a deliberate difference)."""
    assert on_ranks(full_checkpoint_into_a_plain_model, str(tmp_path)) == [True, True]


def test_a_ddp_checkpoint_loads_into_the_sharded_model(tmp_path: Path) -> None:
    """test_load_standard_checkpoint_into_distributed_model: a regular DDP checkpoint (weights and optimizer states)
    loads into the sharded model: every weight and optimizer state tensor arrives exactly."""
    for result in on_ranks(ddp_checkpoint_into_shard_strategy, str(tmp_path), 1, TemplateModel):
        assert_same(result["restored"], result["expected"])


class CustomModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.parameter = nn.Parameter(torch.rand(2, 2))
        self.layer1 = nn.Linear(4, 4)
        self.layer2 = nn.Linear(4, 4)
        self.register_buffer("persistent_buffer", torch.rand(2), persistent=True)
        self.register_buffer("non_persistent_buffer", torch.rand(2), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer2(self.layer1(x))


def load_raw_module_state(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    torch.manual_seed(0)
    source = CustomModel()
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    if rank == 0:
        save_file(state, f"{tmp}/all.safetensors")
        save_file({k: v for k, v in state.items() if k != "parameter"}, f"{tmp}/missing.safetensors")
    f = fabric(FabricShardStrategy(auto_wrap_policy={nn.Linear}))
    f.barrier()
    model = f.setup_module(CustomModel())
    f.load_raw(f"{tmp}/all.safetensors", model)
    loaded = {**full_weights(model), "persistent_buffer": plain_module(model).persistent_buffer.clone()}
    strict = raised(lambda: f.load_raw(f"{tmp}/missing.safetensors", model))
    lenient = raised(lambda: f.load_raw(f"{tmp}/missing.safetensors", model, strict=False))
    return {"loaded": loaded, "expected": state, "strict": strict, "lenient": lenient}


def test_load_raw_fills_parameters_and_buffers_and_is_strict_about_keys(tmp_path: Path) -> None:
    """test_load_raw_module_state: a full state dict fills every parameter and persistent buffer of the set-up
    model; a key the file lacks is an error naming it under ``strict=True`` (a ``RuntimeError``, as
    ``load_state_dict`` and FSDPStrategy raise; ModelParallelStrategy raises ``KeyError``), and is left alone under
    ``strict=False``."""
    for result in on_ranks(load_raw_module_state, str(tmp_path)):
        assert_same(result["loaded"], result["expected"])
        assert "parameter" in result["strict"] and result["strict"].startswith("CheckpointError"), result["strict"]
        assert issubclass(lightning_shard.CheckpointError, RuntimeError)
        assert result["lenient"] == ""


def plain_values_round_trip(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    f = fabric(FabricShardStrategy())
    model = f.setup_module(nn.Linear(2, 2))
    values = {"step": 7, "name": "run-1", "history": [0.5, 0.25], "nested": {"a": None, "b": True},
              "tensor": torch.arange(3)}
    path = f.broadcast(f"{tmp}/checkpoint")
    f.save(path, {"model": model, **values})
    restored: dict[str, Any] = {"model": model, **{k: None for k in values}}
    f.load(path, restored)
    restored.pop("model")

    class Opaque:
        pass

    return {"values": values, "restored": restored,
            "object": raised(lambda: f.save(f"{tmp}/other", {"model": model, "meta": Opaque()}))}


def test_plain_values_round_trip_and_arbitrary_objects_are_refused(tmp_path: Path) -> None:
    """test_model_parallel_load_checkpoint_loads_non_tensor_metadata: values other than tensors (numbers, strings,
    lists, dicts, None, and tensors among them) come back from ``fabric.load`` as saved. An arbitrary Python object,
    which ModelParallelStrategy pickles, is refused at save with a message: nothing is ever pickled (a deliberate
    difference)."""
    for result in on_ranks(plain_values_round_trip, str(tmp_path)):
        assert_same(result["restored"], result["values"])
        assert "cannot be stored without pickle" in result["object"], result["object"]
