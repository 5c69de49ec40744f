"""A Trainer fit under torchrun that resumes from its newest ``last.ckpt`` whenever torchrun (re)starts it, at any
world size, with the same global batch:

    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        --rdzv-id demo tests/scripts/elastic_fit.py --root /tmp/elastic

Global rank 0 appends one JSON line per step to ``<root>/losses.jsonl``: the step, the loss averaged over all ranks
(the loss of the global batch), the world size and torchrun's restart count. Each worker writes its process id to
``<root>/worker-<agent pid>-<local rank>`` when training starts, for the test to take a node down. ``uninterrupted``
runs the same fit on ``run_on_ranks``' ranks: the reference.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard import GlobalBatchLoader, ShardStrategy  # noqa: E402
from tests.models import LitModel, MLPBlock, make_dataset  # noqa: E402

GLOBAL_BATCH = 8  # samples per optimizer step, whatever the world size


class ElasticModel(LitModel):
    def __init__(self, root: Path, step_sleep: float) -> None:
        super().__init__("mlp")
        self.root, self.step_sleep = root, step_sleep

    def train_dataloader(self) -> GlobalBatchLoader:
        # The same samples at every step at any world size; its position comes back with the checkpoint.
        return GlobalBatchLoader(make_dataset("mlp"), global_batch_size=GLOBAL_BATCH, seed=0)

    def on_train_start(self) -> None:
        (self.root / f"worker-{os.getppid()}-{self.local_rank}").write_text(str(os.getpid()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        global_loss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        if self.global_rank == 0:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            world_size = self.trainer.world_size
            record = {"step": self.trainer.global_step, "loss": global_loss.item(), "world_size": world_size,
                      "restart": restart}
            with open(self.root / "losses.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        time.sleep(self.step_sleep)  # leaves the test time to take a node down mid-fit
        return loss


def fit(root: Path, max_steps: int, step_sleep: float, devices: int, num_nodes: int) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    root.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=ShardStrategy(auto_wrap_policy={MLPBlock}),
        max_steps=max_steps,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=2, save_top_k=0, save_last=True)],
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ElasticModel(root, step_sleep), ckpt_path="last")  # the newest complete checkpoint, if any
    return trainer


def uninterrupted(rank: int, world_size: int, root: str, max_steps: int) -> None:
    """The same fit on ``run_on_ranks``' ranks, never interrupted: the reference ``<root>/losses.jsonl``."""
    fit(Path(root), max_steps, 0.0, devices=world_size, num_nodes=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = int(os.environ["WORLD_SIZE"]) // local_world_size  # as many nodes as this (re)start has
    trainer = fit(args.root, args.max_steps, args.step_sleep, local_world_size, nodes)
    print(f"rank {trainer.global_rank} of {trainer.world_size} finished at step {trainer.global_step}", flush=True)
