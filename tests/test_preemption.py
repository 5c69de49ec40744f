"""Preemption: a signal on any rank stops every rank at the next step boundary, after one complete ``last.ckpt``,
and ``fit(ckpt_path="last")`` trains exactly the remaining steps with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_shard import ShardStrategy
from lightning_shard.common import preemption
from lightning_shard.common.preemption import PreemptionState, PreemptionWatcher, preemption_signals
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy
from lightning_shard.testing import run_on_ranks
from lightning_shard.trainer.preemption import Preempted, PreemptionCheckpoint, attach_preemption, detach_preemption
from tests.jobs import job_env
from tests.models import MLPBlock, lit_model, loader
from tests.scripts.preempt_fit import uninterrupted_losses

SCRIPT = Path(__file__).parent / "scripts" / "preempt_fit.py"
MAX_STEPS = 10


def _command(root: Path, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--root", str(root), "--max-steps", str(MAX_STEPS), *args]


def _start(command: list[str]) -> subprocess.Popen:
    """A job in its own process group, so that ``_stop`` can end every rank of it."""
    return subprocess.Popen(
        command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _stop(job: subprocess.Popen) -> None:
    """After a failure (a hang, say): no rank of the job outlives the test."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def _run(command: list[str]) -> tuple[int, str, str]:
    job = _start(command)
    try:
        out, err = job.communicate(timeout=240)
    finally:
        _stop(job)
    return job.returncode, out, err


def _losses(path: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads(path.read_text()).items()}


@pytest.mark.launch
def test_sigterm_to_one_rank_saves_last_on_every_rank_and_resume_trains_the_remaining_steps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    fit = _start(_command(root, "--step-sleep", "0.3"))
    try:
        pid_file = root / "pid-1"  # the launcher's child: rank 1
        while not pid_file.exists() and fit.poll() is None:
            time.sleep(0.05)
        time.sleep(1.0)  # a few steps in
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        out, err = fit.communicate(timeout=60)  # every rank stops (a hang fails here)
    finally:
        _stop(fit)
    report = f"stdout:\n{out[-2000:]}\nstderr:\n{err[-3000:]}"
    last = root / "checkpoints" / "last.ckpt"
    assert fit.returncode == 128 + signal.SIGTERM, report
    for rank in (0, 1):
        assert f"rank {rank} preempted: saved {last}, exit status 143 at step" in out, report
    saved_step = int(re.search(r"rank 0 preempted: .*? at step (\d+)", out).group(1))  # type: ignore[union-attr]
    assert 0 < saved_step < MAX_STEPS, report
    assert (last / "index.json").is_file() and not [p for p in last.parent.iterdir() if p.name.startswith(".")]

    code, _, err = _run(_command(root, "--resume"))
    assert code == 0, err[-3000:]
    # Never interrupted, on the pooled ranks (the same fit, seeds and data order).
    reference = run_on_ranks(uninterrupted_losses, 2, str(tmp_path / "reference"), MAX_STEPS)
    for rank in (0, 1):  # at the same world size the interrupted run is the uninterrupted one, bit for bit
        uninterrupted = reference[rank]
        assert sorted(uninterrupted) == list(range(MAX_STEPS))
        assert _losses(root / f"losses-{rank}.json") == {s: v for s, v in uninterrupted.items() if s < saved_step}
        assert _losses(root / f"losses-{rank}-resumed.json") == {
            s: v for s, v in uninterrupted.items() if s >= saved_step
        }


def agree_on_ranks(rank: int, world_size: int, signalled_rank: int) -> tuple[bool, str, int | None]:
    watcher = PreemptionWatcher([signal.SIGTERM])
    if rank == signalled_rank:
        watcher._on_signal(signal.SIGTERM, None)  # what the installed handler does on a signal
    agreed = watcher.agree(torch.device("cpu"))
    return agreed, watcher.state.value, watcher.exit_code if agreed else None


@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_a_signal_on_one_rank_is_agreed_by_every_rank(signalled_rank: int) -> None:
    results = run_on_ranks(agree_on_ranks, 2, signalled_rank)
    assert results == [(True, "agreed", 143)] * 2


def test_without_a_signal_no_rank_stops() -> None:
    results = run_on_ranks(agree_on_ranks, 2, -1)
    assert results == [(False, "watching", None)] * 2


def test_the_handler_only_records_and_restore_puts_the_previous_handler_back() -> None:
    def previous(signum: int, frame: object) -> None:
        raise AssertionError("the previous handler ran")

    before = signal.signal(signal.SIGUSR2, previous)
    try:
        watcher = PreemptionWatcher([signal.SIGUSR2])
        watcher.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert watcher.state is PreemptionState.SIGNALLED
        watcher.restore()
        assert signal.getsignal(signal.SIGUSR2) is previous
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_slurm_auto_requeue_adds_its_requeue_signal() -> None:
    assert preemption_signals(LightningEnvironment()) == ([signal.SIGTERM], None)
    assert preemption_signals(SLURMEnvironment(auto_requeue=False)) == ([signal.SIGTERM], None)
    assert preemption_signals(SLURMEnvironment()) == ([signal.SIGTERM, signal.SIGUSR1], signal.SIGUSR1)
    custom = SLURMEnvironment(requeue_signal=signal.SIGHUP)
    assert preemption_signals(custom) == ([signal.SIGTERM, signal.SIGHUP], signal.SIGHUP)


@pytest.mark.parametrize(("agreed", "rank", "requeued"), [
    (signal.SIGUSR1, 0, True), (signal.SIGUSR1, 1, False), (signal.SIGTERM, 0, False),
])
def test_global_rank_0_requeues_the_slurm_job_after_the_requeue_signal(
    monkeypatch: pytest.MonkeyPatch, agreed: signal.Signals, rank: int, requeued: bool
) -> None:
    calls = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setattr(preemption.subprocess, "run", lambda cmd, check: calls.append(cmd) or _Done())
    watcher = PreemptionWatcher([signal.SIGTERM, signal.SIGUSR1], requeue_signal=signal.SIGUSR1)
    watcher._on_signal(agreed, None)
    assert watcher.agree(torch.device("cpu"))
    watcher.requeue_if_asked(rank)
    assert calls == ([["scontrol", "requeue", "4242"]] if requeued else [])


class _Done:
    returncode = 0


def test_the_strategy_replaces_lightnings_sigterm_handler_for_fit_and_puts_it_back(tmp_path: Path) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ShardStrategy(), default_root_dir=tmp_path, logger=False)
    lightning_connector = trainer._signal_connector
    before = signal.getsignal(signal.SIGTERM)
    callback = attach_preemption(trainer, finish_saves=lambda: None)
    try:
        trainer._signal_connector.register_signal_handlers()  # as Trainer._run does after strategy.setup
        assert signal.getsignal(signal.SIGTERM) == callback.watcher._on_signal
        assert [cb for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)] == [callback]
    finally:
        detach_preemption(trainer)
    assert signal.getsignal(signal.SIGTERM) == before
    assert trainer._signal_connector is lightning_connector
    assert not [cb for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)]


def fabric_loop_with_a_signal(rank: int, world_size: int, signalled_rank: int, at_step: int) -> tuple:
    """A Fabric loop that checks for preemption after each step; ``signalled_rank`` gets SIGTERM at ``at_step``."""
    sigterm_handler = signal.getsignal(signal.SIGTERM)
    try:
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=FabricShardStrategy())
        fabric.launch()
        model = fabric.setup_module(nn.Linear(4, 4))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(6):
            fabric.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
            if rank == signalled_rank and step == at_step:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, between two collectives
            if fabric.strategy.preemption_requested():
                try:
                    fabric.strategy.exit_for_preemption()
                except SystemExit as stop:
                    return step, stop.code
        return None, None
    finally:
        signal.signal(signal.SIGTERM, sigterm_handler)


def test_a_fabric_loop_learns_of_a_signal_on_any_rank_at_the_same_step_and_exits_with_143() -> None:
    assert run_on_ranks(fabric_loop_with_a_signal, 2, 1, 2) == [(2, 143), (2, 143)]


class SignalAt(L.Callback):
    """Sends this process SIGTERM when ``rank`` starts batch ``batch_idx``, as a scheduler would mid-fit."""

    def __init__(self, rank: int, batch_idx: int) -> None:
        self.rank, self.batch_idx = rank, batch_idx

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, i: int) -> None:
        if trainer.global_rank == self.rank and i == self.batch_idx:
            os.kill(os.getpid(), signal.SIGTERM)


def preempted_fit(rank: int, world_size: int, root: str, checkpoints: bool, accumulate: int, batch_idx: int) -> tuple:
    """A fit whose rank 1 gets SIGTERM at ``batch_idx``: (exit status, checkpoint path, step, files next to it)."""
    callbacks: list[L.Callback] = [SignalAt(1, batch_idx)]
    if checkpoints:
        callbacks.append(ModelCheckpoint(dirpath=Path(root, "ckpts"), every_n_train_steps=2, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ShardStrategy(auto_wrap_policy={MLPBlock}), max_steps=8,
        accumulate_grad_batches=accumulate, callbacks=callbacks, enable_checkpointing=checkpoints,
        default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(lit_model("mlp"), train_dataloaders=loader("mlp"))
    except Preempted as stop:
        path = Path(stop.checkpoint_path)
        complete = (path / "index.json").is_file()
        return stop.code, str(path.relative_to(root)), trainer.global_step, complete, sorted(os.listdir(path.parent))
    return None, None, trainer.global_step, False, []


def test_the_preemption_checkpoint_is_the_model_checkpoints_last_even_when_it_saved_at_that_step(
    tmp_path: Path,
) -> None:
    # The signal arrives at batch 3; step 4 ends with ModelCheckpoint's own save (every 2 steps), then ours.
    results = run_on_ranks(preempted_fit, 2, str(tmp_path), True, 1, 3)
    listing = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert results == [(143, "ckpts/last.ckpt", 4, True, listing)] * 2


def test_without_a_model_checkpoint_the_preemption_checkpoint_goes_under_default_root_dir(tmp_path: Path) -> None:
    results = run_on_ranks(preempted_fit, 2, str(tmp_path), False, 1, 3)
    assert results == [(143, "last.ckpt", 4, True, ["last.ckpt"])] * 2


def test_with_gradient_accumulation_the_ranks_stop_only_at_an_optimizer_step(tmp_path: Path) -> None:
    # Batches 2 and 3 make step 2: a signal at batch 2 is acted on once batch 3 has stepped, never mid-window.
    results = run_on_ranks(preempted_fit, 2, str(tmp_path), False, 2, 2)
    assert results == [(143, "last.ckpt", 2, True, ["last.ckpt"])] * 2
