"""Bringing a running job over from DDP (a Lightning ``.ckpt``), FSDPStrategy's full ``.ckpt`` and
ModelParallelStrategy (FSDP2 ``fully_shard``, a ``torch.distributed.checkpoint`` directory), and taking it back.

Each migration is checked against the run that was never interrupted: a job saved under one strategy and resumed
under another, at another world size with the same global batch, reproduces the uninterrupted run's losses (to 1e-5,
the tolerance of every resharded resume) with the model and optimizer state arriving whole. Pickles are read only
through restricted readers: a ``.ckpt`` whose pickle would run a command, or a DCP ``.metadata`` naming a type DCP
does not write, is refused by name, and the command never runs.
"""

from __future__ import annotations

import collections
import os
import pickle
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_shard import CheckpointError, ShardStrategy
from lightning_shard.checkpoint.convert import convert
from lightning_shard.checkpoint.interop.dcp import read_metadata
from lightning_shard.cli import main as cli_main
from lightning_shard.engine import sharded_module_of
from lightning_shard.testing import RankFailure, RankStatus, run_on_ranks
from tests.checkpoint_fits import global_losses, module_full_state
from tests.models import LitModel, make_dataset

GLOBAL_BATCH = 12  # 8 steps per epoch of the 96 samples, at 2 and at 3 ranks


# --------------------------------------------------------------------------------------------------
# Fits under each strategy, recording losses and the full state where training starts and ends
# --------------------------------------------------------------------------------------------------


class Recorded(LitModel):
    """The test GPT (AdamW, two parameter groups: no weight decay for biases and norms, the learning rate halved every
    5 steps), recording the full model and optimizer state when training starts (after a restore) and when it ends,
    under any strategy. Its hyperparameters are saved, as ``save_hyperparameters()`` saves them."""

    def __init__(self, kind: str = "gpt", lr: float = 1e-2) -> None:
        super().__init__(kind, lr)
        self.save_hyperparameters()

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        self.start = full_state(self, self.trainer.optimizers)

    def on_train_end(self) -> None:
        self.end = full_state(self, self.trainer.optimizers)


class FullyShardedRecorded(Recorded):
    """``Recorded`` with every block and the root sharded by PyTorch's ``fully_shard`` (ModelParallelStrategy)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def full_state(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """Every parameter (under each of its names) and per-parameter optimizer tensor in full, keyed as
    ``module_full_state`` keys them, under ShardStrategy, DDP or ``fully_shard`` (collective)."""
    if sharded_module_of(module) is not None:
        return module_full_state(module, optimizers)
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    params = {n: whole(p) for n, p in module.named_parameters(remove_duplicate=False)}
    names = {id(p): n for n, p in module.named_parameters()}
    optim = {f"{i}/{names[id(q)]}/{k}": whole(v) for i, o in enumerate(optimizers) for q, s in o.state.items()
             for k, v in s.items()}
    return {"params": params, "optimizer": optim}


def fit(
    rank: int,
    world_size: int,
    strategy: str,
    ckpt_dir: str,
    epochs: int,
    resume: str | None = None,
    strategy_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``epochs`` epochs of the test GPT under ``strategy`` ("ddp", "shard", "model_parallel"), saving ``last.ckpt``
    in ``ckpt_dir`` at the end of each, resuming from ``resume``."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    L.seed_everything(0)
    kwargs = strategy_kwargs or {}
    module = FullyShardedRecorded("gpt") if strategy == "model_parallel" else Recorded("gpt")
    chosen = {
        "ddp": lambda: DDPStrategy(**kwargs),
        "shard": lambda: ShardStrategy(auto_wrap_policy={"GPTBlock"}, **kwargs),
        "model_parallel": lambda: ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1,
                                                        **kwargs),
    }[strategy]()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=chosen, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)],
    )
    data = DataLoader(make_dataset("gpt"), batch_size=GLOBAL_BATCH // world_size, shuffle=False)
    trainer.fit(module, train_dataloaders=data, ckpt_path=resume)
    return {"losses": module.losses, "start": getattr(module, "start", None), "end": module.end,
            "global_step": trainer.global_step}


def assert_state_arrived(resumed: list[dict[str, Any]], saved: dict[str, Any]) -> None:
    """Every resumed rank starts from the model and optimizer state the interrupted run ended with."""
    for r in resumed:
        assert r["start"]["params"].keys() == saved["params"].keys()
        assert r["start"]["optimizer"].keys() == saved["optimizer"].keys()
        for name, t in saved["params"].items():
            torch.testing.assert_close(r["start"]["params"][name], t, msg=name)
        for name, t in saved["optimizer"].items():
            torch.testing.assert_close(r["start"]["optimizer"][name], t, msg=name)


# --------------------------------------------------------------------------------------------------
# From DDP
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DDP on 2 ranks: 2 epochs uninterrupted, and 1 epoch whose last.ckpt (a pickled .ckpt) the tests resume."""
    root = tmp_path_factory.mktemp("ddp")
    uninterrupted = run_on_ranks(fit, 2, "ddp", str(root / "full"), 2)
    first = run_on_ranks(fit, 2, "ddp", str(root / "first"), 1)
    return {"root": root, "uninterrupted": uninterrupted, "first": first, "ckpt": root / "first" / "last.ckpt"}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_ddp_checkpoint_resumes_under_shard_strategy(tmp_path: Path, ddp: dict[str, Any], world_size: int) -> None:
    assert ddp["ckpt"].is_file()  # Lightning's pickled .ckpt
    resumed = run_on_ranks(fit, world_size, "shard", str(tmp_path), 2, str(ddp["ckpt"]))
    assert_state_arrived(resumed, ddp["first"][0]["end"])
    assert all(r["global_step"] == 16 for r in resumed)  # the loops came in: epoch 2 only
    expected = global_losses(ddp["uninterrupted"])[8:]
    torch.testing.assert_close(global_losses(resumed), expected, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# From ModelParallelStrategy (FSDP2): a DCP directory, and the full .ckpt FSDP's rekeying writes
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ModelParallelStrategy with ``fully_shard`` on 2 gloo CPU ranks: 2 epochs uninterrupted, and 1 epoch saved as
    a DCP directory (its default) and as one full .ckpt (``save_distributed_checkpoint=False``)."""
    root = tmp_path_factory.mktemp("model_parallel")
    uninterrupted = run_on_ranks(fit, 2, "model_parallel", str(root / "full"), 2)
    first = run_on_ranks(fit, 2, "model_parallel", str(root / "first"), 1)
    run_on_ranks(fit, 2, "model_parallel", str(root / "first_full"), 1, None, {"save_distributed_checkpoint": False})
    return {"root": root, "uninterrupted": uninterrupted, "first": first, "dcp": root / "first" / "last.ckpt",
            "full": root / "first_full" / "last.ckpt"}


def renamed_dcp(source: Path, out: Path, old: str, new: str) -> Path:
    """A copy of a (trusted) DCP directory whose top-level entry ``old`` is called ``new``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    shutil.copytree(source, out)
    metadata = FileSystemReader(str(out)).read_metadata()

    def rename(key: str) -> str:
        return new + key[len(old) :] if key.startswith(old + ".") else key

    metadata.state_dict_metadata = {rename(k): v for k, v in metadata.state_dict_metadata.items()}
    metadata.planner_data = {rename(k): (new, *p[1:]) if p[0] == old else p for k, p in metadata.planner_data.items()}
    storage = metadata.storage_data
    metadata.storage_data = {MetadataIndex(rename(i.fqn), i.offset, i.index): v for i, v in storage.items()}
    (out / ".metadata").write_bytes(pickle.dumps(metadata))
    return out


@pytest.mark.parametrize("model_key", ["state_dict", "model"])  # ModelParallelStrategy's, FSDPStrategy's sharded
def test_a_model_parallel_dcp_checkpoint_resumes_under_shard_strategy(
    tmp_path: Path, model_parallel: dict[str, Any], model_key: str
) -> None:
    dcp = model_parallel["dcp"]
    if model_key != "state_dict":  # FSDPStrategy(state_dict_type="sharded") writes the same layout under "model"
        dcp = renamed_dcp(dcp, tmp_path / "dcp", "state_dict", model_key)
    assert any(key.startswith(model_key + ".") for key in read_metadata(dcp).state_dict_metadata)
    resumed = run_on_ranks(fit, 3, "shard", str(tmp_path / "resumed"), 2, str(dcp))
    assert_state_arrived(resumed, model_parallel["first"][0]["end"])
    expected = global_losses(model_parallel["uninterrupted"])[8:]
    torch.testing.assert_close(global_losses(resumed), expected, rtol=0, atol=1e-5)


def test_a_full_ckpt_keyed_in_module_order_resumes_under_shard_strategy(
    tmp_path: Path, model_parallel: dict[str, Any]
) -> None:
    """FSDPStrategy(state_dict_type="full") and ModelParallelStrategy(save_distributed_checkpoint=False) write DDP's
    .ckpt layout with the optimizer state rekeyed by FSDP.rekey_optim_state_dict to positions in the module's
    parameter order (FSDPStrategy needs CUDA, so ModelParallelStrategy's file stands for both): its parameter groups
    (decay, no decay) interleave in module order, so reading it in the optimizer's order would misplace the state."""
    groups = torch.load(model_parallel["full"], weights_only=True)["optimizer_states"][0]["param_groups"]
    assert groups[0]["params"] != list(range(len(groups[0]["params"])))  # not DDP's order
    resumed = run_on_ranks(fit, 3, "shard", str(tmp_path), 2, str(model_parallel["full"]))
    assert_state_arrived(resumed, model_parallel["first"][0]["end"])
    expected = global_losses(model_parallel["uninterrupted"])[8:]
    torch.testing.assert_close(global_losses(resumed), expected, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# lightning-shard convert, and export --format dcp
# --------------------------------------------------------------------------------------------------


def test_convert_turns_a_ddp_ckpt_into_a_checkpoint_directory_that_resumes(
    tmp_path: Path, ddp: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "converted"
    assert cli_main(["convert", str(ddp["ckpt"]), str(out)]) == 2  # position-keyed: the module must name them
    assert "--module" in capsys.readouterr().err and not out.exists()
    # the LightningModule class names them: built on the meta device with the checkpoint's hyperparameters
    assert cli_main(["convert", str(ddp["ckpt"]), str(out), "--module", "tests.test_migration:Recorded"]) == 0
    assert (out / "index.json").is_file() and not list(out.glob("*.ckpt"))
    resumed = run_on_ranks(fit, 3, "shard", str(tmp_path / "again"), 2, str(out))
    assert_state_arrived(resumed, ddp["first"][0]["end"])
    torch.testing.assert_close(global_losses(resumed), global_losses(ddp["uninterrupted"])[8:], rtol=0, atol=1e-5)


def test_convert_turns_a_dcp_directory_into_a_checkpoint_directory_that_resumes(
    tmp_path: Path, model_parallel: dict[str, Any]
) -> None:
    out = tmp_path / "converted"
    assert cli_main(["convert", str(model_parallel["dcp"]), str(out)]) == 0  # keyed by name: no module needed
    resumed = run_on_ranks(fit, 2, "shard", str(tmp_path / "again"), 2, str(out))
    assert_state_arrived(resumed, model_parallel["first"][0]["end"])
    expected = global_losses(model_parallel["uninterrupted"])[8:]
    torch.testing.assert_close(global_losses(resumed), expected, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ShardStrategy on 3 ranks: 2 epochs uninterrupted, and 1 epoch whose checkpoint directory is exported."""
    root = tmp_path_factory.mktemp("shard")
    uninterrupted = run_on_ranks(fit, 3, "shard", str(root / "full"), 2)
    first = run_on_ranks(fit, 3, "shard", str(root / "first"), 1)
    return {"uninterrupted": uninterrupted, "first": first, "ckpt": root / "first" / "last.ckpt"}


def test_a_checkpoint_exported_as_dcp_resumes_under_model_parallel_strategy(
    tmp_path: Path, shard: dict[str, Any]
) -> None:
    out = tmp_path / "dcp"
    assert cli_main(["export", str(shard["ckpt"]), str(out), "--format", "dcp"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    resumed = run_on_ranks(fit, 2, "model_parallel", str(tmp_path / "again"), 2, str(out))
    assert_state_arrived(resumed, shard["first"][0]["end"])
    assert all(r["global_step"] == 16 for r in resumed)
    expected = global_losses(shard["uninterrupted"])[8:]
    torch.testing.assert_close(global_losses(resumed), expected, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Pickles are never run: refused by name, on every rank, and by convert
# --------------------------------------------------------------------------------------------------


class RunsACommand:
    """Unpickling this calls ``os.system``: what a malicious checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def malicious_ckpt(tmp_path: Path, ddp_ckpt: Path) -> tuple[Path, Path]:
    """A copy of a real DDP .ckpt whose hyperparameters hold a pickle that would run ``touch MARKER``."""
    checkpoint = torch.load(ddp_ckpt, weights_only=True)
    marker = tmp_path / "MARKER"
    checkpoint["hyper_parameters"] = {"lr": 0.01, "payload": RunsACommand(marker)}
    path = tmp_path / "x.ckpt"
    torch.save(checkpoint, path)
    return path, marker


def test_a_ckpt_whose_pickle_runs_a_command_is_refused_and_never_run(
    tmp_path: Path, ddp: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    path, marker = malicious_ckpt(tmp_path, ddp["ckpt"])
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(fit, 2, "shard", str(tmp_path / "resumed"), 2, str(path))
    for outcome in failure.value.outcomes.values():
        assert outcome.status is RankStatus.RAISED, outcome.error  # every rank, none left waiting
        assert f"{path} holds a pickle that calls posix.system (os.system); refused" in outcome.error
    assert cli_main(["convert", str(path), str(tmp_path / "converted"), "--module",
                     "tests.test_migration:Recorded"]) == 2
    assert "holds a pickle that calls posix.system (os.system); refused" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "converted").exists()
    with pytest.raises(pickle.UnpicklingError):  # the guard is ours: torch's weights-only reader refuses it as well
        torch.load(path, weights_only=True)
    assert not marker.exists()


def test_dcp_metadata_naming_a_type_dcp_does_not_write_is_refused(
    tmp_path: Path, model_parallel: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    dcp = shutil.copytree(model_parallel["dcp"], tmp_path / "dcp")
    metadata = FileSystemReader(str(dcp)).read_metadata()  # a trusted copy, read by DCP itself
    marker = tmp_path / "MARKER"
    metadata.storage_meta = RunsACommand(marker)
    (dcp / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(fit, 2, "shard", str(tmp_path / "resumed"), 2, str(dcp))
    for outcome in failure.value.outcomes.values():
        assert outcome.status is RankStatus.RAISED, outcome.error
        assert "names posix.system, which is not one of the types torch.distributed.checkpoint writes" in outcome.error
    metadata.storage_meta = collections.defaultdict(int)  # harmless, but not DCP's: refused all the same
    (dcp / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"names collections\.defaultdict, which is not one of the types"):
        convert(dcp, tmp_path / "converted")
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------
# The engine-level entry point and Fabric
# --------------------------------------------------------------------------------------------------


def out_of_order_groups(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the head and the 0-dim scale in a first group, out of the module's parameter order."""
    first = [model.head.weight, model.scale]
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return torch.optim.AdamW([{"params": first, "weight_decay": 0.0}, {"params": rest}], lr=1e-2)


def adamw_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x, y = make_dataset("uneven")[:8]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def plain_steps_saved_as_ddp_would(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One AdamW step of ``UnevenMLP`` in this process, saved as a Trainer under DDP saves it; the full state then,
    and the parameters after a second step."""
    from tests.models import UnevenMLP

    torch.manual_seed(0)
    model = UnevenMLP()
    optimizer = out_of_order_groups(model)
    adamw_step(model, optimizer)
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "epoch": 3}, path)
    saved = full_state(model, [optimizer])
    adamw_step(model, optimizer)
    return saved, {n: p.detach().clone() for n, p in model.named_parameters()}


def load_into_shards(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """``load_checkpoint`` of a .ckpt into a freshly sharded model, recording the rows each read takes; then one more
    step on the same batch on every rank (so the averaged gradient is the single process's)."""
    from lightning_shard.checkpoint import load_checkpoint
    from lightning_shard.checkpoint.interop import lightning_ckpt
    from lightning_shard.engine import shard_model
    from tests.fits import full_params
    from tests.models import MLPBlock, UnevenMLP

    reads: list[tuple[tuple[int, ...], int, int]] = []
    original = lightning_ckpt._rows

    def spy(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        reads.append((tuple(tensor.shape), start, stop))
        return original(tensor, start, stop)

    torch.manual_seed(1)  # other weights: everything must come from the file
    model = UnevenMLP()
    shard_model(model, auto_wrap_policy={MLPBlock})
    optimizer = out_of_order_groups(model)
    lightning_ckpt._rows = spy
    try:
        values, result = load_checkpoint(path, model, [optimizer])
    finally:
        lightning_ckpt._rows = original
    state = module_full_state(model, [optimizer])
    adamw_step(model, optimizer)
    engine = sharded_module_of(model)
    assert engine is not None
    return {"values": values, "missing": result.missing_keys, "state": state, "reads": reads,
            "next": full_params(engine)}


def load_failing_on_rank_1(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """``load_checkpoint`` of a .ckpt whose reads fail on rank 1 only (its disk went away): the error, and whether
    each rank's model still holds what it held before."""
    from lightning_shard.checkpoint import load_checkpoint
    from lightning_shard.checkpoint.format import CheckpointError
    from lightning_shard.checkpoint.interop import lightning_ckpt
    from lightning_shard.engine import shard_model
    from tests.models import MLPBlock, UnevenMLP

    torch.manual_seed(1)
    model = UnevenMLP()
    shard_model(model, auto_wrap_policy={MLPBlock})
    before = module_full_state(model, [])["params"]
    original = lightning_ckpt._rows

    def failing(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        if rank == 1:
            raise OSError("Input/output error")
        return original(tensor, start, stop)

    lightning_ckpt._rows = failing
    try:
        load_checkpoint(path, model)
        error = ""
    except CheckpointError as err:
        error = str(err)
    finally:
        lightning_ckpt._rows = original
    after = module_full_state(model, [])["params"]
    return {"error": error, "unchanged": all(torch.equal(value, after[name]) for name, value in before.items())}


def test_a_ckpt_load_failing_on_one_rank_leaves_every_ranks_model_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "ddp.ckpt"
    plain_steps_saved_as_ddp_would(path)
    for r in run_on_ranks(load_failing_on_rank_1, 2, str(path)):
        assert "rank 1: OSError: Input/output error" in r["error"], r["error"]
        assert r["unchanged"]


def test_load_checkpoint_reads_a_ddp_ckpt_each_rank_its_rows(tmp_path: Path) -> None:
    """Engine level: a .ckpt written by DDP (out-of-order parameter groups, a 0-dim parameter with per-element Adam
    state) fills 3 ranks' shards and optimizers, each rank reading only its rows of every tensor, and the next step
    is the single process's."""
    path = tmp_path / "ddp.ckpt"
    expected, after_next_step = plain_steps_saved_as_ddp_would(path)
    for rank, r in enumerate(run_on_ranks(load_into_shards, 3, str(path))):
        assert r["values"] == {"epoch": 3} and r["missing"] == []
        assert r["state"]["optimizer"].keys() == expected["optimizer"].keys()
        for name, t in (expected["params"] | expected["optimizer"]).items():
            got = r["state"]["params"].get(name, r["state"]["optimizer"].get(name))
            torch.testing.assert_close(got, t, msg=name)
        for name, t in after_next_step.items():
            torch.testing.assert_close(r["next"][name], t, msg=name)
        for shape, start, stop in r["reads"]:
            rows = shape[0] if shape else 1
            per_rank = -(-rows // 3)
            assert (start, stop) == (0, rows) or (start == rank * per_rank and stop - start <= per_rank), (shape, start)
        assert any(shape and stop - start < shape[0] for shape, start, stop in r["reads"])


def test_a_ckpt_written_with_weight_averaging_resumes_the_trained_weights_not_the_average(tmp_path: Path) -> None:
    """Lightning's WeightAveraging saves the average under "state_dict" and the trained weights under
    "current_model_state": the trained ones (those the optimizer state belongs to) are loaded, with a warning that the
    average is not carried over."""
    path = tmp_path / "ddp.ckpt"
    expected, after_next_step = plain_steps_saved_as_ddp_would(path)
    checkpoint = torch.load(path)
    trained = checkpoint["state_dict"]
    checkpoint["state_dict"] = {k: v + 1.0 for k, v in trained.items()}  # stands for the averaged weights
    checkpoint["current_model_state"] = trained
    checkpoint["averaging_state"] = {"n_averaged": torch.tensor(1)}
    torch.save(checkpoint, path)
    for r in run_on_ranks(load_into_shards, 2, str(path)):
        assert r["values"] == {"epoch": 3} and r["missing"] == []
        for name, t in expected["params"].items():
            torch.testing.assert_close(r["state"]["params"][name], t, msg=name)
        for name, t in after_next_step.items():
            torch.testing.assert_close(r["next"][name], t, msg=name)


def fabric_save_under_ddp(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from lightning.fabric.strategies import DDPStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=DDPStrategy())
    fabric.launch()
    torch.manual_seed(0)
    module = LitModel("gpt")
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    x, y = make_dataset("gpt")[rank * 4 : rank * 4 + 4]
    fabric.backward(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    return full_state(module, [optimizer.optimizer])


def fabric_load_under_shard(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    strategy = FabricShardStrategy(auto_wrap_policy={"GPTBlock"})
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(1)
    module = LitModel("gpt")
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    state = {"model": model, "optimizer": optimizer, "step": 0}
    rest = fabric.load(path, state)
    return {"step": state["step"], "rest": rest, "state": module_full_state(module, [optimizer.optimizer])}


def test_fabric_load_reads_a_checkpoint_fabric_saved_under_ddp(tmp_path: Path) -> None:
    path = str(tmp_path / "fabric.ckpt")
    saved = run_on_ranks(fabric_save_under_ddp, 2, path)[0]
    for r in run_on_ranks(fabric_load_under_shard, 3, path):
        assert r["step"] == 1 and r["rest"] == {}
        for name, t in (saved["params"] | saved["optimizer"]).items():
            got = r["state"]["params"].get(name, r["state"]["optimizer"].get(name))
            torch.testing.assert_close(got, t, msg=name)


# --------------------------------------------------------------------------------------------------
# What is refused, and why
# --------------------------------------------------------------------------------------------------


def test_the_types_lightning_writes_are_read_and_nothing_else(tmp_path: Path) -> None:
    import numpy as np
    from lightning.pytorch.utilities.parsing import AttributeDict

    from lightning_shard.checkpoint.open import open_checkpoint

    values = {
        "pytorch-lightning_version": "2.6.0", "epoch": 1,
        "hyper_parameters": AttributeDict(lr=0.1, data=Path("/data/train")),
        "callbacks": {"Tracker": {"best": np.float64(0.25), "seen": np.arange(3), "score": torch.tensor(1.5)}},
    }
    torch.save({"state_dict": {"w": torch.ones(2)}, **values}, tmp_path / "ok.ckpt")
    state = open_checkpoint(tmp_path / "ok.ckpt").trainer_state()
    assert state["hyper_parameters"] == {"lr": 0.1, "data": Path("/data/train")}  # read as the dict it holds
    assert state["callbacks"]["Tracker"]["best"] == 0.25 and state["callbacks"]["Tracker"]["seen"].tolist() == [0, 1, 2]
    refused = {"state_dict": {}, "x": collections.Counter(a=1), "y": collections.defaultdict(int)}
    torch.save(refused, tmp_path / "no.ckpt")  # Counter is torch's own allowed type; defaultdict calls its factory
    with pytest.raises(CheckpointError, match=r"holds a pickle that calls builtins\.int, collections\.defaultdict;"):
        open_checkpoint(tmp_path / "no.ckpt")
    torch.save({"state_dict": {}, "x": np.array([1, "a"], dtype=object)}, tmp_path / "objects.ckpt")
    with pytest.raises(CheckpointError, match=r"holds a pickle that builds numpy\.dtypes\.ObjectDType; refused"):
        open_checkpoint(tmp_path / "objects.ckpt")


def test_position_keys_that_fit_both_writers_differently_are_refused() -> None:
    from lightning_shard.checkpoint.interop.foreign import name_positions

    module_order = ["a", "b", "c"]
    # DDP's order (the optimizer's) and FSDP's (the module's) agree when each group lists parameters in module order
    assert name_positions([[0, 1], [2]], [["a", "b"], ["c"]], module_order, "opt") == {0: "a", 1: "b", 2: "c"}
    # groups interleaved in module order: only DDP's order gives consecutive runs, only FSDP's gives these
    assert name_positions([[0, 1], [2]], [["a", "c"], ["b"]], module_order, "opt") == {0: "a", 1: "c", 2: "b"}
    assert name_positions([[0, 2], [1]], [["a", "c"], ["b"]], module_order, "opt") == {0: "a", 2: "c", 1: "b"}
    with pytest.raises(CheckpointError, match="fits both the optimizer's order"):
        name_positions([[0, 1], [2]], [["b", "a"], ["c"]], module_order, "opt")
    with pytest.raises(CheckpointError, match=r"groups hold \[3\] parameters, the optimizer's \[2, 1\]"):
        name_positions([[0, 1, 2]], [["a", "b"], ["c"]], module_order, "opt")


def test_what_is_no_checkpoint_is_refused_saying_what_it_is(tmp_path: Path) -> None:
    from lightning_shard.checkpoint.open import open_checkpoint

    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"neither index\.json .* nor \.metadata .* it holds \['notes\.txt'\]"):
        open_checkpoint(tmp_path / "dir")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(CheckpointError, match="not a torch.save zip archive.*load_safetensors_into"):
        open_checkpoint(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "missing.ckpt")
    torch.save([1, 2], tmp_path / "list.ckpt")
    with pytest.raises(CheckpointError, match="holds a list, not Lightning's checkpoint dict"):
        open_checkpoint(tmp_path / "list.ckpt")
