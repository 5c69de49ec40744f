"""Background saves with ``Trainer(plugins=[AsyncCheckpointIO()])`` and Fabric's ``ShardStrategy(async_save=True)``:
the checkpoint resumes exactly, at most one save is in flight, a failure in the background is raised on every rank
(in Fabric also at the end of the process), and plugins that would be ignored are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader

from lightning_shard import ShardStrategy
from lightning_shard.testing import RankFailure, RankStatus, run_on_ranks
from tests.checkpoint_fits import fit
from tests.jobs import job_env, start_jobs
from tests.models import LitModel, make_dataset

_WORKER = "lightning_shard-background-save"


def _running() -> int:
    return sum(t.name == _WORKER and t.is_alive() for t in threading.enumerate())


class _CountingStrategy(ShardStrategy):
    """Records how many background saves run right after each save call returns to the training loop."""

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        super().save_checkpoint(*args, **kwargs)
        self.in_flight.append(_running())


def fit_async(rank: int, world_size: int, ckpt_dir: str, epochs: int, every_step: bool = False) -> dict[str, Any]:
    if not every_step:
        return fit(rank, world_size, ckpt_dir, epochs, trainer_kwargs={"plugins": [AsyncCheckpointIO()]})
    L.seed_everything(0)
    strategy = _CountingStrategy(auto_wrap_policy={"GPTBlock"})
    strategy.in_flight = []
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy,
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        plugins=[AsyncCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=2, monitor="step",
                                   mode="max")],
    )
    trainer.fit(LitModel("gpt"), DataLoader(make_dataset("gpt"), batch_size=6, shuffle=False))
    return {"in_flight": strategy.in_flight, "after_fit": _running()}


def test_a_background_save_resumes_to_the_uninterrupted_losses(tmp_path: Path) -> None:
    uninterrupted = run_on_ranks(fit, 2, str(tmp_path / "full"), 2)
    first = run_on_ranks(fit_async, 2, str(tmp_path / "first"), 1)
    resumed = run_on_ranks(fit, 2, str(tmp_path / "resumed"), 2, str(tmp_path / "first" / "last.ckpt"))
    for full, part1, part2 in zip(uninterrupted, first, resumed):
        assert part1["losses"] + part2["losses"] == full["losses"]  # same world size: bit for bit


def test_at_most_one_save_is_in_flight_and_saves_do_run_in_the_background(tmp_path: Path) -> None:
    for r in run_on_ranks(fit_async, 2, str(tmp_path), 1, True):
        # Training resumed while each save was being written, and never with two saves running.
        assert r["in_flight"] and set(r["in_flight"]) == {1}, r["in_flight"]
        assert r["after_fit"] == 0  # the end of fit waited for the last one
    kept = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert len(kept) == 2 and all((tmp_path / k / "index.json").is_file() for k in kept), kept  # save_top_k=2


def fail_in_background(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    from lightning_shard.checkpoint.save import directory as save

    original = save._ShardedWriter.write_tensors

    def broken(self: Any, local: Any) -> Any:
        if rank == 1 and threading.current_thread().name == _WORKER:
            raise OSError("No space left on device")
        return original(self, local)

    save._ShardedWriter.write_tensors = broken  # type: ignore[method-assign]
    try:
        return fit_async(rank, world_size, ckpt_dir, 1)
    finally:
        save._ShardedWriter.write_tensors = original  # type: ignore[method-assign]


def test_a_failure_in_the_background_is_raised_on_every_rank_and_leaves_no_directory(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as raised:
        run_on_ranks(fail_in_background, 2, str(tmp_path))
    for rank, outcome in raised.value.outcomes.items():
        assert outcome.status is RankStatus.RAISED, (rank, outcome)
        assert "rank 1: OSError: No space left on device" in outcome.error, (rank, outcome.error)
    assert not (tmp_path / "last.ckpt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.tmp")]  # nothing half-written left


def other_io(rank: int, world_size: int, ckpt_dir: str) -> str:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class Elsewhere(TorchCheckpointIO):
        pass

    try:
        L.Trainer(
            accelerator="cpu", devices=world_size, strategy=ShardStrategy(), max_steps=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, plugins=[Elsewhere()],
        ).fit(LitModel("gpt"), DataLoader(make_dataset("gpt"), batch_size=6))
    except TypeError as err:
        return str(err)
    return ""


def test_a_checkpoint_io_plugin_that_would_be_ignored_is_refused_on_every_rank(tmp_path: Path) -> None:
    for message in run_on_ranks(other_io, 2, str(tmp_path)):
        assert "the CheckpointIO plugin Elsewhere would not be used" in message


def full_layout_in_background(rank: int, world_size: int) -> str:
    try:
        L.Trainer(
            accelerator="cpu", devices=world_size, strategy=ShardStrategy(state_dict_type="full"), max_steps=1,
            logger=False, enable_progress_bar=False, enable_model_summary=False, plugins=[AsyncCheckpointIO()],
        ).fit(LitModel("gpt"), DataLoader(make_dataset("gpt"), batch_size=6))
    except ValueError as err:
        return str(err)
    return ""


def test_async_checkpoint_io_with_the_full_layout_is_refused_on_every_rank_at_set_up() -> None:
    for message in run_on_ranks(full_layout_in_background, 2):
        assert message.startswith("AsyncCheckpointIO saves the sharded layout in the background"), message
        assert message.endswith("Use state_dict_type='sharded' or remove AsyncCheckpointIO."), message


# Fabric: ShardStrategy(async_save=True) #


def fabric_resume_after_background_save(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from tests.fabric_fits import FabricRun, fabric_fit

    uninterrupted = fabric_fit(rank, world_size, FabricRun(steps=6))
    ckpt, saving = str(Path(tmp) / "fabric.ckpt"), {"async_save": True}
    first = fabric_fit(rank, world_size, FabricRun(steps=3, save_to=ckpt, strategy_kwargs=saving))
    rest = fabric_fit(rank, world_size, FabricRun(steps=3, first_step=3, resume_from=ckpt))
    return {"uninterrupted": uninterrupted["losses"], "resumed": first["losses"] + rest["losses"]}


def test_a_fabric_background_save_resumes_to_the_uninterrupted_losses(tmp_path: Path) -> None:
    for r in run_on_ranks(fabric_resume_after_background_save, 2, str(tmp_path)):
        assert r["resumed"] == r["uninterrupted"]  # same world size: bit for bit


def _slow_background_writes(seconds: float) -> Any:
    from lightning_shard.checkpoint.save import directory as save

    original = save._ShardedWriter.write_tensors

    def slow(self: Any, local: Any) -> Any:
        if threading.current_thread().name == _WORKER:
            time.sleep(seconds)
        return original(self, local)

    save._ShardedWriter.write_tensors = slow  # type: ignore[method-assign]
    return original


def fabric_saves_wait_for_each_other(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from lightning_shard.checkpoint.save import directory as save
    from tests.fabric_fits import FabricRun, make_fabric, make_fabric_model, optimizer_for

    original = _slow_background_writes(1.0)
    try:
        fabric = make_fabric(FabricRun(strategy_kwargs={"async_save": True}), world_size)
        model = fabric.setup_module(make_fabric_model("gpt"))
        optimizer = fabric.setup_optimizers(optimizer_for(model))
        first, second = Path(tmp) / "first", Path(tmp) / "second"
        fabric.save(first, {"model": model, "optimizer": optimizer, "step": 1})
        after_first = {"running": _running(), "written": (first / "index.json").is_file()}
        fabric.save(second, {"model": model, "optimizer": optimizer, "step": 2})
        after_second = {"running": _running(), "first_written": (first / "index.json").is_file()}
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(second, state)  # must wait for the save of this very directory
        return {"first": after_first, "second": after_second, "loaded_step": state["step"], "end": _running()}
    finally:
        save._ShardedWriter.write_tensors = original  # type: ignore[method-assign]


def test_fabric_background_saves_run_one_at_a_time_and_load_waits_for_them(tmp_path: Path) -> None:
    for r in run_on_ranks(fabric_saves_wait_for_each_other, 2, str(tmp_path)):
        assert r["first"] == {"running": 1, "written": False}, r  # fabric.save returned while the files were written
        assert r["second"] == {"running": 1, "first_written": True}, r  # the second save waited for the first
        assert r["loaded_step"] == 2 and r["end"] == 0, r


def test_fabric_async_save_must_be_a_bool() -> None:
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    with pytest.raises(TypeError, match="async_save must be True or False, got 'yes'"):
        FabricShardStrategy(async_save="yes")  # type: ignore[arg-type]


def test_fabric_async_save_with_the_full_layout_is_refused_when_the_strategy_is_built() -> None:
    """Refused before any training is spent, as the Trainer refuses AsyncCheckpointIO with it at set-up."""
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    with pytest.raises(ValueError, match="async_save=True saves the sharded layout in the background"):
        FabricShardStrategy(async_save=True, state_dict_type="full")
    FabricShardStrategy(async_save=False, state_dict_type="full")
    FabricShardStrategy(async_save=True, state_dict_type="sharded")


def _run_exit_script(root: Path, *args: str) -> subprocess.CompletedProcess:
    script = Path(__file__).parent / "scripts" / "fabric_async_exit.py"
    return subprocess.run(
        [sys.executable, str(script), str(root / "last.ckpt"), *args], env=job_env(), capture_output=True, text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def exits(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor, tmp_path_factory: pytest.TempPathFactory
) -> dict[bool, Future[tuple[Path, subprocess.CompletedProcess]]]:
    """Both tests' jobs, started with the first, by whether rank 1's background save fails: its folder and its run."""

    def run(fail: bool) -> tuple[Path, subprocess.CompletedProcess]:
        root = tmp_path_factory.mktemp("exit")
        return root, _run_exit_script(root, *(["--fail-on-rank-1"] if fail else []))

    return start_jobs(request, background, lambda item: "failing" in item.originalname, run)


@pytest.mark.launch
def test_the_end_of_a_fabric_process_waits_for_the_last_background_save(exits: dict) -> None:
    tmp_path, done = exits[False].result()
    report = f"exit {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, report
    assert done.stdout.count("returned from save") == 2, report
    assert json.loads((tmp_path / "last.ckpt" / "trainer_state.json").read_text())["step"] == 1, report
    assert sorted(p.name for p in (tmp_path / "last.ckpt").glob("shard-*.safetensors")) == [
        "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"
    ], report


@pytest.mark.launch
def test_a_background_save_failing_at_the_end_of_a_fabric_process_fails_the_process(exits: dict) -> None:
    tmp_path, done = exits[True].result()
    report = f"exit {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode != 0, report
    assert "the last background checkpoint save failed" in done.stderr and "No space left on device" in done.stderr
    assert not (tmp_path / "last.ckpt").exists(), report
