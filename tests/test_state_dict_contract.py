"""State read through the strategies, as Lightning's FSDPStrategy and ModelParallelStrategy give it: the Trainer's
``lightning_module_state_dict()`` / ``optimizer_state(optimizer)`` and Fabric's ``get_module_state_dict`` /
``get_optimizer_state``, under ``state_dict_type="full"`` (rank 0: full CPU tensors; other ranks: ``{}``) and
``"sharded"`` (``DTensor`` views over the mesh), against DDP after the same steps. Also: what a Trainer save reads
(the sharded views, never a full gather), and uneven and 0-dim parameters at the engine level."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.testing import assert_close

from lightning_shard import ShardStrategy
from lightning_shard.testing import RankFailure, run_on_ranks
from tests.fits import trainer_for
from tests.models import GPTBlock, LitModel, MLPBlock, TinyGPT, UnevenMLP, loader

STEPS = 3


class BufferedLit(LitModel):
    """The test GPT with a persistent buffer every step changes (in every state dict) and a non-persistent one (in
    none)."""

    def __init__(self) -> None:
        super().__init__("gpt")
        self.register_buffer("batches_seen", torch.zeros(2))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.batches_seen += 1
        return super().training_step(batch, batch_idx)


def _named_adamw_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A plain optimizer's state by parameter name (first name of a tied one) and its groups' names and options."""
    names = {id(p): n for n, p in module.named_parameters()}
    state = {names[id(p)]: {k: v.detach().clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


# Workers: the Trainer #


def ddp_state(rank: int, world_size: int) -> dict[str, Any]:
    L.seed_everything(0)
    module = BufferedLit()
    trainer = trainer_for(DDPStrategy(), world_size, STEPS)
    trainer.fit(module, train_dataloaders=loader("gpt"))
    state_dict = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"state_dict": state_dict, "optimizer": _named_adamw_state(module, trainer.optimizers[0])}


def _fit_shard(world_size: int, **strategy_kwargs: Any) -> tuple[ShardStrategy, L.Trainer]:
    L.seed_everything(0)
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, **strategy_kwargs)
    trainer = trainer_for(strategy, world_size, STEPS)
    trainer.fit(BufferedLit(), train_dataloaders=loader("gpt"))
    return strategy, trainer


def shard_full_state(rank: int, world_size: int) -> dict[str, Any]:
    strategy, trainer = _fit_shard(world_size, state_dict_type="full")
    state_dict = strategy.lightning_module_state_dict()
    optimizer = strategy.optimizer_state(trainer.optimizers[0])
    tied = state_dict["model.wte.weight"] is state_dict["model.lm_head.weight"] if state_dict else None
    return {"state_dict": state_dict, "optimizer": optimizer, "tied_one_tensor": tied}


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def describe_sharded(state_dict: dict[str, Any], optimizer: dict[str, Any]) -> dict[str, Any]:
    """What a sharded state dict holds: each value's type, placements and mesh, and its full values (collective)."""
    from torch.distributed.tensor import DTensor

    def kind(value: Any) -> Any:
        if isinstance(value, DTensor):
            return ("DTensor", tuple(repr(p) for p in value.placements), tuple(value.device_mesh.shape))
        return type(value).__name__

    optimizer_state = optimizer["state"]
    return {
        "kinds": {k: kind(v) for k, v in state_dict.items()},
        "full": {k: _full(v) for k, v in state_dict.items()},
        "optimizer_kinds": {n: {k: kind(v) for k, v in s.items()} for n, s in optimizer_state.items()},
        "optimizer_full": {n: {k: _full(v) for k, v in s.items()} for n, s in optimizer_state.items()},
        "param_groups": optimizer["param_groups"],
    }


def shard_sharded_state(rank: int, world_size: int, directory: str, **strategy_kwargs: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    strategy, trainer = _fit_shard(world_size, state_dict_type="sharded", **strategy_kwargs)
    state_dict = strategy.lightning_module_state_dict()
    optimizer = strategy.optimizer_state(trainer.optimizers[0])
    engine = strategy.engine
    views = all(
        state_dict[p.fqn].to_local().data_ptr() == p.sharded.data_ptr()
        for p in engine.sharded_params()
        if p.local_rows > 0 and len(p.global_shape) > 0
    )
    described = describe_sharded(state_dict, optimizer)
    dcp.save(state_dict, checkpoint_id=directory)
    dist.barrier()
    converted = None
    if rank == 0:
        dcp_to_torch_save(directory, directory + ".pt")
        converted = torch.load(directory + ".pt", weights_only=True)
    return described | {"views": views, "converted": converted}


class SeenOnSave(L.Callback):
    """Records what ``on_save_checkpoint`` finds in the checkpoint dict, and how many all-gathers the save ran."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.seen = describe_sharded(checkpoint["state_dict"], checkpoint["optimizer_states"][0])


def trainer_save(rank: int, world_size: int, directory: str, layout: str, hooks: bool) -> dict[str, Any]:
    """A Trainer save: what ``on_save_checkpoint`` sees (with ``hooks``), and the number of full tensors gathered
    during the save."""
    L.seed_everything(0)
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, state_dict_type=layout)
    seen = SeenOnSave()
    trainer = trainer_for(strategy, world_size, STEPS, callbacks=[seen] if hooks else [])
    trainer.fit(BufferedLit(), train_dataloaders=loader("gpt"))
    engine = strategy.engine
    gathers = [0]
    gather_full = engine.gather_full

    def counting(*args: Any, **kwargs: Any) -> Tensor:
        gathers[0] += 1
        return gather_full(*args, **kwargs)

    engine.gather_full = counting  # type: ignore[method-assign]
    trainer.save_checkpoint(directory)
    written = len(list(engine.sharded_params())) + sum(
        1 for state in trainer.optimizers[0].state.values() for v in state.values() if v.dim() > 0
    )
    return {"seen": seen.seen, "gathers": gathers[0], "written": written}


class CopiesTheStateDict(L.Callback):
    """Keeps the model's state under another key of the checkpoint, as ``WeightAveraging`` keeps the current model's."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["current_model_state"] = checkpoint["state_dict"]


def save_with_a_copied_state_dict(rank: int, world_size: int, directory: str) -> str:
    L.seed_everything(0)
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock})
    trainer = trainer_for(strategy, world_size, 1, callbacks=[CopiesTheStateDict()])
    trainer.fit(LitModel("gpt"), train_dataloaders=loader("gpt"))
    trainer.save_checkpoint(directory)
    return ""


# Workers: Fabric #


def _fabric_steps(fabric: L.Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    x, y = next(iter(loader("gpt", batch_size=12)))
    local = 12 // fabric.world_size
    x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
    for _ in range(STEPS):
        logits = model(x)
        fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()


def fabric_state(rank: int, world_size: int, strategy: str, layout: str = "sharded") -> dict[str, Any]:
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    from lightning_shard.fabric import ShardStrategy as FabricShard
    from tests.fabric_fits import optimizer_for

    chosen = FabricDDP() if strategy == "ddp" else FabricShard(auto_wrap_policy={GPTBlock}, state_dict_type=layout)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=chosen)
    fabric.launch()
    fabric.seed_everything(0)
    module = TinyGPT()
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(optimizer_for(model))
    _fabric_steps(fabric, model, optimizer, rank)
    if strategy == "ddp":
        state_dict = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return {"state_dict": state_dict, "optimizer": _named_adamw_state(module, optimizer.optimizer)}
    state_dict = fabric.strategy.get_module_state_dict(model)
    optim = fabric.strategy.get_optimizer_state(optimizer)
    if layout == "full":
        return {"state_dict": state_dict, "optimizer": optim}
    return describe_sharded(state_dict, optim)


# Workers: the engine, with uneven and 0-dim parameters #


def engine_state(rank: int, world_size: int, sharding: str, directory: str) -> dict[str, Any]:
    """``UnevenMLP`` (rows 3 ranks do not divide, a 2-row head, a 0-dim scale) sharded as ``sharding``, one SGD
    momentum step on the same batch on every rank beside a plain copy stepped alike: both layouts of the model and
    optimizer state, the plain copy's, and what DCP writes from the sharded one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_shard.checkpoint.state_dicts import model_state_dict, optimizer_state_dict
    from lightning_shard.engine import shard_model

    torch.manual_seed(0)
    model = UnevenMLP()
    plain = UnevenMLP()
    plain.load_state_dict(model.state_dict())
    engine = shard_model(model, auto_wrap_policy={MLPBlock}, sharding_strategy=sharding)
    x, y = torch.randn(6, 7, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 1, 0, 1, 0])
    for m in (model, plain):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        F.cross_entropy(m(x), y).backward()
        optimizer.step()
        if m is model:
            sharded_optimizer = optimizer
        else:
            plain_optimizer = optimizer
    full = model_state_dict(model, "full")
    full_optimizer = optimizer_state_dict(model, sharded_optimizer, "full")
    sharded = model_state_dict(model, "sharded")
    sharded_optimizer_state = optimizer_state_dict(model, sharded_optimizer, "sharded")
    described = describe_sharded(sharded, sharded_optimizer_state)
    local_rows = {p.fqn: p.local_rows for p in engine.sharded_params()}
    dcp.save(sharded, checkpoint_id=directory)
    dist.barrier()
    converted = None
    if rank == 0:
        dcp_to_torch_save(directory, directory + ".pt")
        converted = torch.load(directory + ".pt", weights_only=True)
    engine.mesh.destroy()
    return described | {
        "full_layout": full, "full_layout_optimizer": full_optimizer, "converted": converted, "local_rows": local_rows,
        "plain": {k: v.detach().clone() for k, v in plain.state_dict().items()},
        "plain_optimizer": _named_adamw_state(plain, plain_optimizer),
    }


def foreign_optimizer(rank: int, world_size: int) -> str:
    from lightning_shard.checkpoint.state_dicts import optimizer_state_dict
    from lightning_shard.engine import shard_model

    model = UnevenMLP()
    shard_model(model, auto_wrap_policy={MLPBlock})
    optimizer = torch.optim.SGD([*model.parameters(), torch.zeros(3, requires_grad=True)], lr=0.1)
    optimizer_state_dict(model, optimizer, "full")
    return ""


# Fixtures: each run once per session #


@pytest.fixture(scope="module")
def ddp() -> dict[str, Any]:
    return run_on_ranks(ddp_state, 2)[0]


@pytest.fixture(scope="module")
def full() -> list[dict[str, Any]]:
    return run_on_ranks(shard_full_state, 2)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(shard_sharded_state, 2, str(tmp_path_factory.mktemp("dcp") / "sharded"))


def _assert_close_all(got: dict[str, Any], expected: dict[str, Tensor], where: str) -> None:
    """Every tensor of ``expected`` is in ``got`` under its name, equal up to ``assert_close``'s defaults."""
    for name, value in expected.items():
        assert name in got, f"{where}: {name} missing"
        assert_close(got[name], value, msg=lambda m, n=name: f"{where} {n}: {m}")


def _assert_matches_ddp_optimizer(optimizer: dict[str, Any], reference: dict[str, Any]) -> None:
    assert sorted(optimizer["state"]) == sorted(reference["state"])
    for name, state in reference["state"].items():
        assert sorted(optimizer["state"][name]) == sorted(state), name
        _assert_close_all(optimizer["state"][name], state, name)
    assert optimizer["param_groups"] == reference["param_groups"]


# The Trainer, state_dict_type="full" #


def test_full_state_dict_on_rank0_is_ddps_state_dict(full: list[dict[str, Any]], ddp: dict[str, Any]) -> None:
    state_dict = full[0]["state_dict"]
    assert list(state_dict) == list(ddp["state_dict"])  # the same names in the same order, buffers included
    assert all(value.device.type == "cpu" for value in state_dict.values())
    _assert_close_all(state_dict, ddp["state_dict"], "rank 0")
    assert full[0]["tied_one_tensor"] is True  # as a plain module's state_dict(): one tensor under both names
    assert full[1]["state_dict"] == {}


def test_full_optimizer_state_on_rank0_is_ddps_by_name(full: list[dict[str, Any]], ddp: dict[str, Any]) -> None:
    _assert_matches_ddp_optimizer(full[0]["optimizer"], ddp["optimizer"])
    assert full[1]["optimizer"] == {}


# The Trainer, state_dict_type="sharded" #


def test_sharded_state_dict_is_dtensors_of_ddps_weights(sharded: list[dict[str, Any]], ddp: dict[str, Any]) -> None:
    for rank in (0, 1):
        kinds, values = sharded[rank]["kinds"], sharded[rank]["full"]
        assert list(kinds) == list(ddp["state_dict"])
        assert kinds["model.wte.weight"] == ("DTensor", ("Shard(dim=0)",), (2,))
        assert kinds["batches_seen"] == "Tensor"  # buffers: plain tensors, the same on every rank
        _assert_close_all(values, ddp["state_dict"], f"rank {rank}")
        assert sharded[rank]["views"]  # each DTensor's local tensor is this rank's live shard


def test_sharded_optimizer_state_is_dtensors_of_ddps_state(sharded: list[dict[str, Any]], ddp: dict[str, Any]) -> None:
    for rank in (0, 1):
        kinds = sharded[rank]["optimizer_kinds"]
        assert kinds["model.wte.weight"] == {
            "exp_avg": ("DTensor", ("Shard(dim=0)",), (2,)),
            "exp_avg_sq": ("DTensor", ("Shard(dim=0)",), (2,)),
            "step": "Tensor",
        }
        got = {"state": sharded[rank]["optimizer_full"], "param_groups": sharded[rank]["param_groups"]}
        _assert_matches_ddp_optimizer(got, ddp["optimizer"])


def test_sharded_state_dict_saves_with_dcp_into_ddps_weights(
    sharded: list[dict[str, Any]], ddp: dict[str, Any]
) -> None:
    converted = sharded[0]["converted"]
    assert sorted(converted) == sorted(ddp["state_dict"])
    _assert_close_all(converted, ddp["state_dict"], "dcp_to_torch_save")


@pytest.mark.parametrize(
    ("world_size", "device_mesh"),
    [(2, (2, 1)), pytest.param(4, (2, 2), id="4-ranks-(2,2)")],
)
def test_hybrid_shard_gives_replicate_by_shard_dtensors(
    tmp_path: Path, ddp: dict[str, Any], world_size: int, device_mesh: tuple[int, int]
) -> None:
    reference = ddp if world_size == 2 else run_on_ranks(ddp_state, world_size)[0]
    results = run_on_ranks(
        shard_sharded_state, world_size, str(tmp_path / "dcp"), sharding_strategy="HYBRID_SHARD",
        device_mesh=device_mesh,
    )
    for rank, result in enumerate(results):
        assert result["kinds"]["model.wte.weight"] == ("DTensor", ("Replicate()", "Shard(dim=0)"), device_mesh)
        assert result["optimizer_kinds"]["model.wte.weight"]["exp_avg"][1] == ("Replicate()", "Shard(dim=0)")
        _assert_close_all(result["full"], reference["state_dict"], f"rank {rank}")
    _assert_close_all(results[0]["converted"], reference["state_dict"], "dcp_to_torch_save")


# The Trainer's own saves #


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_on_save_checkpoint_sees_the_sharded_views(tmp_path: Path, ddp: dict[str, Any], layout: str) -> None:
    results = run_on_ranks(trainer_save, 2, str(tmp_path / "ckpt"), layout, True)
    for rank, result in enumerate(results):
        seen = result["seen"]
        assert seen["kinds"]["model.wte.weight"] == ("DTensor", ("Shard(dim=0)",), (2,)), f"rank {rank}"
        _assert_close_all(seen["full"], ddp["state_dict"], f"rank {rank}")
        got = {"state": seen["optimizer_full"], "param_groups": seen["param_groups"]}
        _assert_matches_ddp_optimizer(got, ddp["optimizer"])


def test_trainer_save_under_full_gathers_only_what_it_writes(tmp_path: Path) -> None:
    for rank, result in enumerate(run_on_ranks(trainer_save, 2, str(tmp_path / "ckpt"), "full", False)):
        # One all-gather per tensor the full writer streams into model/optimizer.safetensors; a full state dict
        # built for checkpoint["state_dict"] and ["optimizer_states"] would gather every one of them once more.
        assert result["gathers"] == result["written"], f"rank {rank}: {result}"


def test_a_state_dict_copied_into_the_checkpoint_is_refused_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(save_with_a_copied_state_dict, 2, str(tmp_path / "ckpt"))
    for rank, outcome in failure.value.outcomes.items():
        assert "/current_model_state/model.wte.weight is a DTensor" in outcome.error, f"rank {rank}: {outcome.error}"
    assert not (tmp_path / "ckpt").exists()


# Fabric #


@pytest.fixture(scope="module")
def fabric_ddp() -> dict[str, Any]:
    return run_on_ranks(fabric_state, 2, "ddp")[0]


def test_fabric_full_state_on_rank0_is_ddps(fabric_ddp: dict[str, Any]) -> None:
    results = run_on_ranks(fabric_state, 2, "shard", "full")
    state_dict = results[0]["state_dict"]
    assert list(state_dict) == list(fabric_ddp["state_dict"])
    _assert_close_all(state_dict, fabric_ddp["state_dict"], "rank 0")
    _assert_matches_ddp_optimizer(results[0]["optimizer"], fabric_ddp["optimizer"])
    assert results[1] == {"state_dict": {}, "optimizer": {}}


def test_fabric_sharded_state_is_dtensors_of_ddps(fabric_ddp: dict[str, Any]) -> None:
    for rank, result in enumerate(run_on_ranks(fabric_state, 2, "shard", "sharded")):
        assert result["kinds"]["wte.weight"] == ("DTensor", ("Shard(dim=0)",), (2,))
        _assert_close_all(result["full"], fabric_ddp["state_dict"], f"rank {rank}")
        got = {"state": result["optimizer_full"], "param_groups": result["param_groups"]}
        _assert_matches_ddp_optimizer(got, fabric_ddp["optimizer"])


# The engine: uneven rows, ranks without rows, 0-dim parameters #


@pytest.mark.parametrize(("sharding", "placement"), [("FULL_SHARD", "Shard(dim=0)"), ("NO_SHARD", "Replicate()")])
def test_uneven_and_scalar_parameters_in_both_layouts(tmp_path: Path, sharding: str, placement: str) -> None:
    results = run_on_ranks(engine_state, 3, sharding, str(tmp_path / "dcp"))
    plain, plain_optimizer = results[0]["plain"], results[0]["plain_optimizer"]
    if sharding == "FULL_SHARD":  # the 2-row head leaves rank 2 without rows; the scale is rank 0's alone
        assert [r["local_rows"]["head.weight"] for r in results] == [1, 1, 0]
        assert [r["local_rows"]["scale"] for r in results] == [1, 0, 0]
    assert list(results[0]["full_layout"]) == list(plain)
    _assert_close_all(results[0]["full_layout"], plain, "full, rank 0")
    _assert_close_all(results[0]["converted"], plain, "dcp_to_torch_save")
    _assert_matches_ddp_optimizer(results[0]["full_layout_optimizer"], plain_optimizer)
    assert [(r["full_layout"], r["full_layout_optimizer"]) for r in results[1:]] == [({}, {}), ({}, {})]
    for rank, result in enumerate(results):
        assert result["kinds"]["head.weight"] == ("DTensor", (placement,), (3,))
        assert result["kinds"]["scale"] == ("DTensor", ("Replicate()",), (3,))  # 0-dim: replicated
        _assert_close_all(result["full"], plain, f"sharded, rank {rank}")
        got = {"state": result["optimizer_full"], "param_groups": result["param_groups"]}
        _assert_matches_ddp_optimizer(got, plain_optimizer)


def test_optimizer_over_foreign_tensors_is_refused_on_every_rank() -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(foreign_optimizer, 2)
    for rank, outcome in failure.value.outcomes.items():
        assert "not shards of the sharded model" in outcome.error, f"rank {rank}: {outcome.error}"
