"""A fit that a preemption signal can interrupt, and its resumption, under Lightning's subprocess launcher.

    python tests/scripts/preempt_fit.py --root /tmp/run --max-steps 10             # runs until SIGTERM, or to the end
    python tests/scripts/preempt_fit.py --root /tmp/run --max-steps 10 --resume    # fit(ckpt_path="last")

``uninterrupted_losses`` runs the same fit on ``run_on_ranks``' ranks, never signalled: the reference.

Each rank writes ``pid-<rank>`` under ``--root`` once training runs (for the test to signal it), and
``losses-<rank>.json``: the loss of every global step this process trained. The data order is restorable: the
``GlobalBatchLoader``'s position is saved in the checkpoint and restored by ``fit(ckpt_path="last")``.
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
from lightning_shard.trainer.preemption import Preempted  # noqa: E402
from tests.models import LitModel, MLPBlock, make_dataset  # noqa: E402

GLOBAL_BATCH = 8  # 4 samples per rank on the 2 ranks


class PreemptibleModel(LitModel):
    def __init__(self, root: Path, step_sleep: float) -> None:
        super().__init__("mlp")
        self.root, self.step_sleep = root, step_sleep
        self.step_losses: dict[int, float] = {}

    def train_dataloader(self) -> GlobalBatchLoader:
        return GlobalBatchLoader(make_dataset("mlp"), global_batch_size=GLOBAL_BATCH, seed=0)

    def on_train_start(self) -> None:
        (self.root / f"pid-{self.global_rank}").write_text(str(os.getpid()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.step_losses[self.trainer.global_step] = self.losses[-1]
        time.sleep(self.step_sleep)  # leaves the test time to signal mid-fit
        return loss


def trainer_and_model(root: Path, max_steps: int, step_sleep: float = 0.0) -> tuple[L.Trainer, PreemptibleModel]:
    L.seed_everything(0, verbose=False)
    root.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardStrategy(auto_wrap_policy={MLPBlock}),
        max_steps=max_steps,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints")],
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return trainer, PreemptibleModel(root, step_sleep)


def uninterrupted_losses(rank: int, world_size: int, root: str, max_steps: int) -> dict[int, float]:
    """The same fit, never signalled, on ``run_on_ranks``' two ranks: the loss of every global step."""
    trainer, model = trainer_and_model(Path(root), max_steps)
    trainer.fit(model)
    return model.step_losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer, model = trainer_and_model(args.root, args.max_steps, args.step_sleep)
    status = "finished"
    try:
        trainer.fit(model, ckpt_path="last" if args.resume else None)
    except Preempted as stop:
        status = f"preempted: saved {stop.checkpoint_path}, exit status {stop.code}"
        raise
    finally:
        losses = args.root / f"losses-{trainer.global_rank}{'-resumed' if args.resume else ''}.json"
        losses.write_text(json.dumps(model.step_losses))
        # One write per line: the ranks share stdout, and print() writes the text and its newline separately.
        sys.stdout.write(f"rank {trainer.global_rank} {status} at step {trainer.global_step}\n")
        sys.stdout.flush()
