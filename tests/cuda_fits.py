"""Fits for tests/test_cuda.py that run on a CUDA device: at world size 1 in the test process, and on two rank
workers that share the one GPU (gloo on CUDA tensors, as NCCL refuses two ranks on one device)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_shard import ShardStrategy
from lightning_shard.engine.grad_scaler import ShardedGradScaler
from lightning_shard.trainer.precision import ShardPrecision
from tests.checkpoint_fits import Snapshots
from tests.fits import full_params_shard
from tests.lightning_fits import ScaleRecorder
from tests.models import GPTBlock, LitModel, loader, make_dataset


def gpu_trainer(strategy: Any, precision: str | None = "32-true", steps: int = 10, **kwargs: Any) -> L.Trainer:
    """A Trainer on the one GPU; ``kwargs`` go to the Trainer (``num_nodes``, callbacks, ...). The batches come in
    the loader's order, as a single-device Trainer takes them (a distributed one shuffles by default), unless
    ``use_distributed_sampler=True``."""
    defaults: dict[str, Any] = {
        "max_steps": steps, "logger": False, "enable_checkpointing": False, "use_distributed_sampler": False,
    }
    return L.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision=precision, enable_progress_bar=False,
        enable_model_summary=False, **(defaults | kwargs),
    )


class OverflowAt(LitModel):
    """The GPT test model whose loss is multiplied by infinity at step ``step``: every gradient of that step
    overflows, so a loss scaler must skip it."""

    def __init__(self, step: int) -> None:
        super().__init__("gpt")
        self.step = step
        self.weights: list[Tensor] = []  # a weight after every step

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == self.step else loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.weights.append(self.model.blocks[1].fc.weight.detach().float().cpu().clone())


def fit_16_mixed(sharded: bool, overflow_at: int) -> dict[str, Any]:
    """The GPT in 16-mixed on the GPU for 10 steps, under ShardStrategy or single-device, with a loss scaler that
    starts at 1024 and doubles after every 3 steps without overflow; step ``overflow_at`` overflows. Per-step losses,
    loss scales and one weight (in full at world size 1) after every step."""
    L.seed_everything(0)
    module = OverflowAt(overflow_at)
    recorder = ScaleRecorder()
    scaling = {"init_scale": 1024.0, "growth_interval": 3}
    plugin: Any = (
        ShardPrecision("16-mixed", scaler=ShardedGradScaler("cuda", **scaling))
        if sharded
        else MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", **scaling))
    )
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}) if sharded else "auto"
    gpu_trainer(strategy, None, callbacks=[recorder], plugins=[plugin]).fit(module, loader("gpt"))
    return {"losses": module.losses, "scales": recorder.scales, "weights": module.weights}


def fit_saving(ckpt_dir: str, epochs: int, resume: str | None, ranks: int, rank_device: str) -> dict[str, Any]:
    """``tests.checkpoint_fits.fit`` on the GPU (``rank_device="gpu"``, one rank) or on CPU ranks: the GPT trained
    with a global batch of 12 for ``epochs`` epochs, ``last.ckpt`` saved in ``ckpt_dir``, resumed from ``resume``;
    the full model and optimizer state at the start (after the restore) and at the end, on the CPU."""
    L.seed_everything(0)
    module = Snapshots("gpt")
    trainer = L.Trainer(
        accelerator=rank_device, devices=ranks, strategy=ShardStrategy(auto_wrap_policy={GPTBlock}),
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)],
    )
    data = DataLoader(make_dataset("gpt"), batch_size=12 // ranks, shuffle=False)
    trainer.fit(module, train_dataloaders=data, ckpt_path=resume)
    return {
        "losses": module.losses,
        "start": _on_cpu(getattr(module, "start", None)),
        "end": _on_cpu(module.end),
        "devices": {t.device.type for t in module.model.parameters()},
    }


def fit_saving_on_cpu_ranks(
    rank: int, world_size: int, ckpt_dir: str, epochs: int, resume: str | None
) -> dict[str, Any]:
    """``fit_saving`` as one of ``world_size`` CPU ranks (a rank worker)."""
    return fit_saving(ckpt_dir, epochs, resume, world_size, "cpu")


@contextmanager
def _one_gpu_per_node() -> Iterator[None]:
    """This rank worker as the only process of node ``rank`` (``LOCAL_RANK=0``), so that every rank's Trainer
    takes ``cuda:0``: two ranks share the one GPU as two single-GPU nodes would."""
    saved = {k: os.environ[k] for k in ("LOCAL_RANK", "NODE_RANK")}
    os.environ.update(NODE_RANK=os.environ["RANK"], LOCAL_RANK="0")
    try:
        yield
    finally:
        os.environ.update(saved)


def fit_sharing_the_gpu(rank: int, world_size: int, sharded: bool) -> dict[str, Any]:
    """The GPT on ``cuda:0`` in every rank (a rank worker; gloo on CUDA tensors), under ShardStrategy or DDP:
    per-step losses and the full parameters after 10 steps, on the CPU."""
    L.seed_everything(0)
    module = LitModel("gpt")
    strategy = (
        ShardStrategy(auto_wrap_policy={GPTBlock}, process_group_backend="gloo")
        if sharded
        else DDPStrategy(process_group_backend="gloo")
    )
    with _one_gpu_per_node():
        trainer = gpu_trainer(strategy, num_nodes=world_size, use_distributed_sampler=True)
        trainer.fit(module, train_dataloaders=loader("gpt", batch_size=2))
        assert trainer.strategy.root_device == torch.device("cuda", 0)
    if sharded:
        assert isinstance(strategy, ShardStrategy)
        assert all(u.flat_sharded.is_cuda for u in strategy.engine.units)
        params = full_params_shard(strategy)
    else:
        params = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "params": _on_cpu(params)}


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value
