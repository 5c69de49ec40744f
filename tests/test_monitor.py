"""ShardMonitor logs per-rank memory and per-step communication to the Trainer's logger: the bytes in closed form from
the parameters' shapes, each rank's memory reading under that rank's name."""

from __future__ import annotations

import csv
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_shard import ShardMonitor, ShardStrategy, monitor
from lightning_shard.testing import run_on_ranks
from tests.lightning_fits import reduce_bytes, step_gathers, units_of
from tests.models import GPTBlock, LitModel, TinyGPT, loader


def reading(rank: int, call: int) -> list[float]:
    """What rank ``rank``'s memory reader returns at its ``call``-th call (from 0): [current, peak] MiB, made unique."""
    return [1000.0 * (rank + 1) + call, 100000.0 * (rank + 1) + call]


def monitored_fit(rank: int, world_size: int, log_dir: str, accumulate: int) -> float:
    """Four optimizer steps of the GPT with the ShardMonitor, each rank's memory reader replaced by ``reading``;
    returns what the progress bar shows as this rank's memory."""
    calls = iter(range(10**6))
    L.seed_everything(0)
    module = LitModel("gpt")
    strategy = ShardStrategy(auto_wrap_policy={"GPTBlock"})
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=4, log_every_n_steps=1,
                        accumulate_grad_batches=accumulate,
                        logger=CSVLogger(log_dir, name="run"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[ShardMonitor()])
    with mock.patch.object(monitor, "_memory_mb", lambda device: reading(rank, next(calls))):
        trainer.fit(module, train_dataloaders=loader("gpt"))
    return float(trainer.progress_bar_metrics["mem_mb"])


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[list[dict[str, Any]], list[float]]]:
    """For accumulate_grad_batches 1 and 2 (one fit on 2 ranks each): the monitor's rows and each rank's progress
    bar memory."""
    out = {}
    for accumulate in (1, 2):
        log_dir = tmp_path_factory.mktemp(f"accumulate{accumulate}")
        progress = run_on_ranks(monitored_fit, 2, str(log_dir), accumulate)
        rows = list(csv.DictReader(open(next(log_dir.rglob("metrics.csv")))))
        out[accumulate] = ([r for r in rows if r.get("shard/all_gather_mb")], progress)
    return out


def gpt_units() -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    with torch.device("meta"):
        return units_of(TinyGPT(), GPTBlock)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_monitor_logs_one_row_per_optimizer_step(logged: dict, accumulate: int) -> None:
    rows, _ = logged[accumulate]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_monitor_logs_the_all_gather_bytes_of_every_micro_batch_of_the_step(logged: dict, accumulate: int) -> None:
    # Each micro-batch: every unit (fp32, padded to ceil(rows / 2) rows a rank) in forward, every block but the last
    # again in backward.
    expected = accumulate * sum(step_gathers(gpt_units(), 2, lambda name: 4))
    rows, _ = logged[accumulate]
    assert [float(r["shard/all_gather_mb"]) * 2**20 for r in rows] == [expected] * 4


@pytest.mark.parametrize("accumulate", [1, 2])
def test_monitor_logs_the_reduced_bytes_of_every_micro_batch_of_the_step(logged: dict, accumulate: int) -> None:
    # Each micro-batch: one fp32 reduction per unit with trainable parameters (their padded gradient chunks and one
    # "was used" flag each); the frozen wpe and blocks.0.qkv are not reduced.
    expected = accumulate * sum(reduce_bytes(params, 2) for params in gpt_units().values())
    rows, _ = logged[accumulate]
    assert [float(r["shard/reduce_mb"]) * 2**20 for r in rows] == [expected] * 4
    assert all(float(r["shard/comm_seconds"]) > 0 for r in rows)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_monitor_logs_each_ranks_memory_under_its_rank(logged: dict, accumulate: int) -> None:
    # The reader runs once per micro-batch; a step's row holds each rank's reading at the step's last micro-batch,
    # the current figure (on CPU there is no peak column).
    rows, progress = logged[accumulate]
    for row in rows:
        last_call = int(row["step"]) * accumulate - 1
        for rank in (0, 1):
            assert float(row[f"shard/memory_mb/rank{rank}"]) == reading(rank, last_call)[0]
        assert not any(key.startswith("shard/peak_memory_mb") for key, value in row.items() if value)
    assert progress == [reading(rank, 4 * accumulate - 1)[0] for rank in (0, 1)]  # the progress bar: this rank's


def test_memory_reading_on_cpu_is_the_resident_set_size_in_mib() -> None:
    current, peak = monitor._memory_mb(torch.device("cpu"))
    with open("/proc/self/status") as f:
        vm_rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert current == peak
    assert abs(current - vm_rss_kib / 1024) < 1.0  # read a moment apart: within a MiB
