"""A fit launched the way users launch it (Lightning's subprocess launcher), for the process-level tests.

    python tests/scripts/launch_fit.py --devices 2 --raise-on-rank 1
"""

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard import ShardStrategy  # noqa: E402
from tests.models import LitModel, MLPBlock, loader  # noqa: E402


class RaisingModel(LitModel):
    def __init__(self, raise_on_rank: int) -> None:
        super().__init__("mlp")
        self.raise_on_rank = raise_on_rank

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if batch_idx == 3 and self.global_rank == self.raise_on_rank:
            raise RuntimeError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--raise-on-rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ShardStrategy(auto_wrap_policy={MLPBlock}),
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RaisingModel(args.raise_on_rank), train_dataloaders=loader("mlp"))
    initialized = dist.is_initialized()
    total = torch.ones(1)
    if initialized:  # still usable after fit, as for sampling with the trained model
        dist.all_reduce(total)
    print(f"rank {trainer.global_rank} finished; process group initialized after fit: {initialized}; all_reduce"
          f" after fit: {total.item():.0f}", flush=True)
