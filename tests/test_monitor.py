"""ShardMonitor logs per-rank memory and per-step communication to the Trainer's logger."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_shard import ShardMonitor, ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.models import LitModel, loader


def monitored_fit(rank: int, world_size: int, log_dir: str, accumulate: int) -> dict:
    L.seed_everything(0)
    module = LitModel("gpt")
    strategy = ShardStrategy(auto_wrap_policy={"GPTBlock"})
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=4, log_every_n_steps=1,
                        accumulate_grad_batches=accumulate,
                        logger=CSVLogger(log_dir, name="run"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[ShardMonitor()])
    trainer.fit(module, train_dataloaders=loader("gpt"))
    model_bytes = sum(p.numel * 4 for p in strategy.engine.sharded_params())
    return {"model_mb": model_bytes / 2**20, "prog": float(trainer.progress_bar_metrics.get("mem_mb", 0.0))}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_monitor_logs_memory_per_rank_and_bytes_per_step(tmp_path: Path, accumulate: int) -> None:
    results = run_on_ranks(monitored_fit, 2, str(tmp_path), accumulate)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    steps = [r for r in rows if r.get("shard/all_gather_mb")]
    assert len(steps) >= 3
    model_mb = results[0]["model_mb"]
    assert len({r["step"] for r in steps}) == len(steps)  # one row per optimizer step, not per micro-batch
    for row in steps[1:]:  # from the second step on every unit is gathered in forward and (but one) in backward
        # ... once per micro-batch: the figures cover the whole optimizer step
        assert accumulate * model_mb <= float(row["shard/all_gather_mb"]) <= accumulate * 2.2 * model_mb
        assert float(row["shard/reduce_mb"]) > accumulate * 0.5 * model_mb
        assert float(row["shard/comm_seconds"]) > 0
        assert float(row["shard/memory_mb/rank0"]) > 50 and float(row["shard/memory_mb/rank1"]) > 50
    assert all(r["prog"] > 50 for r in results)  # the progress bar shows this rank's memory
