"""Worker functions for the checkpoint tests: fits that save and resume, and full-state snapshots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_shard import ShardStrategy
from lightning_shard.engine import sharded_module_of
from tests.fits import full_params
from tests.models import LitModel, make_dataset


def module_full_state(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """Every parameter (tied ones under each of their names) and per-parameter optimizer tensor of a sharded
    ``module`` in full, by name (collective)."""
    engine = sharded_module_of(module)
    assert engine is not None
    params = full_params(engine)
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    optim: dict[str, torch.Tensor] = {}
    for i, optimizer in enumerate(optimizers):
        for q, state in optimizer.state.items():
            p = by_shard[id(q)]
            for name, value in state.items():
                full = engine.gather_full(p, value) if value.dim() > 0 else value.clone()
                optim[f"{i}/{p.fqn}/{name}"] = full
    return {"params": params, "optimizer": optim}


def full_state(strategy: ShardStrategy) -> dict[str, Any]:
    """``module_full_state`` of the Trainer's model and optimizers (collective)."""
    assert strategy.lightning_module is not None
    return module_full_state(strategy.lightning_module, strategy.optimizers)


class Snapshots(LitModel):
    """Full model and optimizer state when training starts (after a restore) and ends."""

    def on_train_start(self) -> None:
        self.start = full_state(self.trainer.strategy)

    def on_train_end(self) -> None:
        self.end = full_state(self.trainer.strategy)


def fit(
    rank: int,
    world_size: int,
    ckpt_dir: str,
    epochs: int,
    resume: str | None = None,
    global_batch: int = 12,
    strategy_kwargs: dict | None = None,
    trainer_kwargs: dict | None = None,
) -> dict[str, Any]:
    L.seed_everything(0)
    module = Snapshots("gpt")
    strategy_kwargs = {"auto_wrap_policy": {"GPTBlock"}} | (strategy_kwargs or {})
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ShardStrategy(**strategy_kwargs), max_epochs=epochs,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)], **(trainer_kwargs or {}),
    )
    data = DataLoader(make_dataset("gpt"), batch_size=global_batch // world_size, shuffle=False)
    trainer.fit(module, train_dataloaders=data, ckpt_path=resume)
    return {"losses": module.losses, "start": getattr(module, "start", None), "end": module.end}


def global_losses(results: list[dict[str, Any]]) -> torch.Tensor:
    """The loss of the global batch at each step: the mean of the ranks' losses (equal local batch sizes)."""
    return torch.tensor([r["losses"] for r in results]).mean(0)
