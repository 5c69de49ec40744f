"""estimate_memory against what a trained sharded model actually holds: the same bytes, per rank."""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import lightning as L
import pytest
import torch

from lightning_shard import ShardPrecision, ShardStrategy, estimate_memory
from lightning_shard.testing import run_on_ranks
from tests.fits import trainer_for
from tests.jobs import run_early
from tests.models import GPTBlock, LitModel, TinyGPT, loader


def measured(
    rank: int, world_size: int, sharding: str, mesh: tuple[int, int] | None, precision: str
) -> dict[str, int]:
    """This rank's model state after two AdamW steps of the GPT, as ``memory_report`` counts the tensors that exist."""
    L.seed_everything(0)
    kwargs = {"sharding_strategy": sharding} | ({"device_mesh": mesh} if mesh else {})
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, **kwargs)
    plugin = ShardPrecision(precision)  # type: ignore[arg-type]
    trainer_for(strategy, world_size, steps=2, plugins=[plugin]).fit(LitModel("gpt"), train_dataloaders=loader("gpt"))
    report = strategy.memory_report().sharded
    return {"parameters": report.parameters, "gradients": report.gradients, "optimizer": report.optimizer_state}


@pytest.mark.parametrize(
    ("world_size", "sharding", "mesh", "precision"),
    [
        (1, "NO_SHARD", None, "32-true"),
        (2, "FULL_SHARD", None, "32-true"),
        (4, "FULL_SHARD", None, "32-true"),
        (4, "HYBRID_SHARD", (2, 2), "32-true"),
        (2, "NO_SHARD", None, "32-true"),
        (2, "FULL_SHARD", None, "bf16-mixed"),
        (2, "FULL_SHARD", None, "bf16-true"),
    ],
)
def test_estimate_equals_measured_model_state(
    world_size: int, sharding: str, mesh: tuple[int, int] | None, precision: str
) -> None:
    with torch.device("meta"):
        model = LitModel("gpt")
    estimate = estimate_memory(model, world_size, sharding, precision, auto_wrap_policy={GPTBlock}, device_mesh=mesh)
    ranks = run_on_ranks(measured, world_size, sharding, mesh, precision)
    for r in ranks:  # parameter and gradient shards are padded: every rank holds the same bytes
        assert (r["parameters"], r["gradients"]) == (estimate.parameters, estimate.gradients), r
    # Optimizer state has this rank's real rows only: the estimate is the largest, rank 0's (it holds the most rows).
    assert ranks[0]["optimizer"] == max(r["optimizer"] for r in ranks) == estimate.optimizer_state


def test_estimate_scales_with_world_size_and_precision() -> None:
    with torch.device("meta"):
        model = TinyGPT(d=64, depth=4)
    one = estimate_memory(model, 1, "NO_SHARD", auto_wrap_policy={GPTBlock})
    eight = estimate_memory(model, 8, auto_wrap_policy={GPTBlock})
    assert eight.model_state < one.model_state / 6  # ~1/8 plus padding
    bf16 = estimate_memory(model, 8, precision="bf16-mixed", auto_wrap_policy={GPTBlock})
    assert bf16.gathered_peak == eight.gathered_peak // 2 and bf16.model_state == eight.model_state


def _estimate_command(*options: str) -> subprocess.CompletedProcess:
    """``lightning-shard estimate`` of the test GPT on 4 ranks, as an early check (see [Note: early checks] in
    tests/jobs.py)."""
    return run_early([sys.executable, "-m", "lightning_shard.cli", "estimate", "tests.models:TinyGPT", "--world-size",
                      "4", "--wrap", "GPTBlock", *options])  # fmt: skip


@pytest.mark.early(check=_estimate_command)
def test_estimate_cli(early: subprocess.CompletedProcess) -> None:
    done = early
    assert done.returncode == 0, done.stderr
    assert "per rank: parameters" in done.stdout and "largest unit: blocks." in done.stdout


@pytest.mark.early(check=partial(_estimate_command, "--cpu-offload"))
def test_estimate_with_cpu_offload_counts_model_state_as_cpu_memory(early: subprocess.CompletedProcess) -> None:
    with torch.device("meta"):
        model = TinyGPT(d=64, depth=4)
    resident = estimate_memory(model, 4, auto_wrap_policy={GPTBlock})
    offloaded = estimate_memory(model, 4, auto_wrap_policy={GPTBlock}, cpu_offload=True)
    assert offloaded.model_state == resident.model_state
    assert offloaded.host_total == resident.model_state and resident.host_total == 0
    assert offloaded.device_total == resident.step_buffers and resident.device_total == resident.total
    # On one rank nothing is gathered, but an offloaded unit is still uploaded to the device to compute.
    assert estimate_memory(model, 1, "NO_SHARD", auto_wrap_policy={GPTBlock}).gathered_peak == 0
    assert estimate_memory(model, 1, "NO_SHARD", auto_wrap_policy={GPTBlock}, cpu_offload=True).gathered_peak > 0
    done = early
    assert done.returncode == 0, done.stderr
    assert "in CPU memory" in done.stdout


def test_estimate_refuses_an_unknown_precision_string() -> None:
    with torch.device("meta"):
        model = TinyGPT()
    with pytest.raises(ValueError, match="precision='bf16'.*bf16-mixed"):
        estimate_memory(model, 2, precision="bf16")
