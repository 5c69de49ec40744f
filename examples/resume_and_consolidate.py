"""Train on 2 processes, resume on 3, then consolidate the checkpoint into one safetensors file.

Run from the repository root, one command after the other:

    python examples/resume_and_consolidate.py --devices 2 --max-steps 20 --out /tmp/gpt_run
    python examples/resume_and_consolidate.py --devices 3 --max-steps 40 --out /tmp/gpt_run --resume
    lightning-shard inspect /tmp/gpt_run/last.ckpt
    lightning-shard consolidate /tmp/gpt_run/last.ckpt /tmp/gpt_run/model.safetensors

The checkpoint is a directory of safetensors shards and JSON written by every rank; it loads on any
number of processes, each reading only the rows it needs. The data comes from a ``GlobalBatchLoader``:
every step trains on the same 48 sequences whatever the number of processes (24 per process on 2, 16 on
3), and its position in the epoch is saved with the checkpoint, so the resumed run trains on exactly the
batches an uninterrupted one would have. The last command writes the whole model as one file that
``safetensors.torch.load_file`` reads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from train_gpt import DATA_PATH, Block, CharDataset, CharGPT

from lightning_shard import GlobalBatchLoader, ShardStrategy

GLOBAL_BATCH = 48
SAVE_EVERY = 4  # optimizer steps between checkpoints; the commands above stop at multiples of it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--out", default="/tmp/gpt_run")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last.ckpt")
    args = parser.parse_args()
    if GLOBAL_BATCH % args.devices:
        raise SystemExit(f"--devices must divide the global batch of {GLOBAL_BATCH}")
    torch.set_num_threads(1)
    L.seed_everything(1337)

    dataset = CharDataset(DATA_PATH.read_text(encoding="utf-8"), block_size=64)
    model = CharGPT(vocab_size=dataset.vocab_size, n_layer=2, n_embd=64, n_head=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ShardStrategy(auto_wrap_policy={Block}),  # state_dict_type="sharded" (the default)
        max_steps=args.max_steps,
        # Saved at the end of a step, which resumes mid-epoch; the save that ends a fit stopped by max_steps would
        # have the resumed fit start a new epoch.
        callbacks=[
            ModelCheckpoint(dirpath=args.out, save_last=True, save_top_k=0, every_n_train_steps=SAVE_EVERY),
            ReportStart(),
        ],
        logger=False,
        enable_progress_bar=False,
    )
    # Built here, at the top level of a script that Lightning's launcher starts once per process, so the rank is
    # given; inside LightningModule.train_dataloader() the loader would take it from the process group.
    loader = GlobalBatchLoader(
        dataset, global_batch_size=GLOBAL_BATCH, seed=1337, num_replicas=trainer.world_size, rank=trainer.global_rank
    )
    resume = str(Path(args.out) / "last.ckpt") if args.resume else None
    trainer.fit(model, train_dataloaders=loader, ckpt_path=resume)
    if trainer.is_global_zero:
        print(f"step {trainer.global_step}: loss {trainer.callback_metrics['train_loss']:.3f};"
              f" checkpoint in {Path(args.out) / 'last.ckpt'}")


class ReportStart(L.Callback):
    """Print the step training starts from: 0, or where the checkpoint left off."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            print(f"starting at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
