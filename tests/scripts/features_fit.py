"""The fine-tuning and storage features in one job, run the way a user runs it: a fresh script under Lightning's own
launcher, where ``ShardStrategy`` creates the process group, then the same fit under DDP in the same process.

    python tests/scripts/features_fit.py --devices 2 --steps 4 --url s3://bucket/run --root /tmp/features
    python tests/scripts/features_fit.py --devices 3 --steps 8 --url s3://bucket/run --root /tmp/features --resume

Ours trains the test GPT, its embeddings frozen, with ``EMAWeightAveraging``, a ``GlobalBatchLoader`` (global batch
12) and a ``ModelCheckpoint`` on the object-store URL (``--url``; credentials and endpoint from the environment) under
``save_trainable_only=True`` (the frozen embeddings are left out: the seeded build restores them), resuming with
``ckpt_path="last"`` (as the preemption message says) with ``--resume``. At the end it samples with
``lightning_shard.generate``: each rank a different number of tokens with the weights kept sharded, then inside
``summon_full_params``. The DDP reference trains ``--steps`` steps from scratch with the same callback and loader and
samples from its model. Each rank saves ``<root>/<shard|ddp>-<devices>-<rank>.pt``: its losses, the final weights, the
sampled tokens.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard import GlobalBatchLoader, ShardStrategy, generate, summon_full_params  # noqa: E402
from tests.fits import full_params  # noqa: E402
from tests.models import LitModel, make_dataset  # noqa: E402

PROMPT = torch.tensor([[1, 2, 3]])


class Sample(Callback):
    """After the average is copied into the model (EMA's own on_train_end runs first): sampled tokens."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        rank = trainer.global_rank

        def sample(model: torch.nn.Module, n: int) -> list[int]:
            g = torch.Generator().manual_seed(7 + rank)
            return generate(model, PROMPT, n, temperature=2.0, top_k=5, generator=g)[0].tolist()

        self.tokens["own_length"] = sample(module.model, 3 + rank)  # ranks stop at different lengths
        if isinstance(trainer.strategy, ShardStrategy):
            with summon_full_params(module):
                self.tokens["full_weights"] = sample(module.model, 3 + rank)


def fit(args: argparse.Namespace, ours: bool) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = LitModel("gpt")
    module.model.wte.requires_grad_(False)  # with the test GPT's own frozen weights: a part that stays frozen
    sample = Sample()
    callbacks: list[Callback] = [EMAWeightAveraging(decay=0.8), sample]
    if ours:
        strategy: Any = ShardStrategy(auto_wrap_policy={"GPTBlock"}, save_trainable_only=True)
        callbacks.append(ModelCheckpoint(dirpath=args.url, every_n_train_steps=4, save_top_k=0, save_last=True))
    else:
        strategy = "ddp"
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=ours, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    created = not dist.is_initialized()
    loader = GlobalBatchLoader(
        make_dataset("gpt"), 12, num_replicas=trainer.world_size, rank=trainer.global_rank
    )  # before fit, under Lightning's launcher
    trainer.fit(module, train_dataloaders=loader, ckpt_path="last" if ours and args.resume else None)
    if ours:
        weights = full_params(strategy.engine)
    else:
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"losses": module.losses, "weights": weights, "tokens": sample.tokens, "created": created}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ours = fit(args, ours=True)  # first: the strategy creates the process group
    reference = fit(args, ours=False)
    rank = dist.get_rank()
    torch.save(ours, args.root / f"shard-{args.devices}-{rank}.pt")
    torch.save(reference, args.root / f"ddp-{args.devices}-{rank}.pt")
