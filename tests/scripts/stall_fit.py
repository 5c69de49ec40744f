"""A fit where one rank stops answering mid-step (it suspends itself with SIGSTOP between its forward and its
backward), launched the way users launch it (Lightning's subprocess launcher), for tests/test_stall.py.

    python tests/scripts/stall_fit.py --front trainer --stop-rank 1 --timeout 4

The other rank must raise StalledRanksError naming the stopped rank and exit non-zero. The script prints
"rank R pid P" for every rank first, so that the caller can clean up the stopped process.
"""

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard import ShardStrategy  # noqa: E402
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy  # noqa: E402
from tests.models import LitModel, MLPBlock, loader, make_model  # noqa: E402

STOP_AT_BATCH = 3


def _stop_if(rank: int, stop_rank: int, batch_idx: int) -> None:
    if batch_idx == STOP_AT_BATCH and rank == stop_rank:
        print(f"rank {rank} stops at batch {batch_idx}", flush=True)
        time.sleep(1.0)  # slow first (as a stuck data loader is), so its last progress is published
        os.kill(os.getpid(), signal.SIGSTOP)


class StoppingModel(LitModel):
    def __init__(self, stop_rank: int) -> None:
        super().__init__("mlp")
        self.stop_rank = stop_rank

    def on_fit_start(self) -> None:
        print(f"rank {self.global_rank} pid {os.getpid()}", flush=True)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = super().training_step(batch, batch_idx)
        _stop_if(self.global_rank, self.stop_rank, batch_idx)  # after forward: the peers wait in backward
        return loss


def fit_trainer(stop_rank: int, timeout: timedelta) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardStrategy(auto_wrap_policy={MLPBlock}, timeout=timeout),
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(StoppingModel(stop_rank), train_dataloaders=loader("mlp"))


def fit_fabric(stop_rank: int, timeout: timedelta) -> None:
    fabric = L.Fabric(
        accelerator="cpu", devices=2, strategy=FabricShardStrategy(auto_wrap_policy={MLPBlock}, timeout=timeout)
    )
    fabric.launch()
    print(f"rank {fabric.global_rank} pid {os.getpid()}", flush=True)
    model = fabric.setup_module(make_model("mlp"))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for batch_idx, (x, y) in enumerate(fabric.setup_dataloaders(loader("mlp"))):
        loss = F.cross_entropy(model(x), y)
        _stop_if(fabric.global_rank, stop_rank, batch_idx)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", choices=["trainer", "fabric"], default="trainer")
    parser.add_argument("--stop-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=4.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = fit_trainer if args.front == "trainer" else fit_fabric
    run(args.stop_rank, timedelta(seconds=args.timeout))
    print("finished", flush=True)
