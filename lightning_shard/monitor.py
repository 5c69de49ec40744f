"""``ShardMonitor``: a callback that logs what sharded training costs, per rank and per step.

    trainer = L.Trainer(strategy=ShardStrategy(...), callbacks=[ShardMonitor()])

Logged at every ``log_every_n_steps`` training step (to the Trainer's logger, from rank 0):

- ``shard/memory_mb/rank{r}``: each rank's memory: CUDA memory allocated on a GPU, resident set size on CPU;
  on a GPU also ``shard/peak_memory_mb/rank{r}`` (the step's peak);
- ``shard/all_gather_mb`` and ``shard/reduce_mb``: bytes this rank's collectives moved in the step (with
  ``accumulate_grad_batches``, over all micro-batches of the optimizer step);
- ``shard/comm_seconds``: time this rank spent issuing collectives and waiting for them in the step.

The progress bar shows this rank's memory as ``mem_mb``.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_shard.engine import collectives


class ShardMonitor(L.Callback):
    """Log per-rank memory and per-step communication of ``ShardStrategy`` (see the module docstring)."""

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = prog_bar
        self._before = collectives.STATS.snapshot()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches != 0:  # inside an optimizer step: keep counting
            return
        self._before = collectives.STATS.snapshot()
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = collectives.STATS
        memory = _memory_mb(pl_module.device)
        pl_module.log("mem_mb", memory[0], prog_bar=self.prog_bar, logger=False, rank_zero_only=False)
        last_micro_batch = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if not last_micro_batch or trainer.global_step % getattr(trainer, "log_every_n_steps", 50) != 0:
            return
        # (world, 2): every rank's figures reach rank 0's logger
        per_rank = trainer.strategy.all_gather(torch.tensor(memory, device=pl_module.device))
        if per_rank.dim() == 1:
            per_rank = per_rank.unsqueeze(0)
        metrics = {
            "shard/all_gather_mb": (now.all_gather_bytes - self._before.all_gather_bytes) / 2**20,
            "shard/reduce_mb": (now.reduce_bytes - self._before.reduce_bytes) / 2**20,
            "shard/comm_seconds": now.seconds - self._before.seconds,
        }
        for rank, (current, peak) in enumerate(per_rank.tolist()):
            metrics[f"shard/memory_mb/rank{rank}"] = current
            if pl_module.device.type == "cuda":
                metrics[f"shard/peak_memory_mb/rank{rank}"] = peak
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(metrics, step=trainer.global_step)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})


def _memory_mb(device: torch.device) -> list[float]:
    """[current, peak] in MiB: CUDA allocator figures on a GPU, resident set size (twice) on CPU."""
    if device.type == "cuda":
        return [torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20]
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return [rss, rss]
