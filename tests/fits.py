"""Fits run inside the rank workers: the same model and data under ShardStrategy, DDP and fully_shard."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_shard import ShardStrategy
from lightning_shard.engine import ShardedModule
from tests.models import LitModel, block_class, lit_model, loader


def trainer_for(strategy: Any, world_size: int, steps: int, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def cli_with_strategy_args(tmp_path: Any, init_args: dict[str, Any]) -> Any:
    """A LightningCLI (not run) for the GPT test model on 2 CPU processes, configured from a YAML file whose
    ``ShardStrategy`` takes ``init_args``."""
    import yaml
    from lightning.pytorch.cli import LightningCLI

    config = {
        "trainer": {
            "accelerator": "cpu", "devices": 2, "logger": False,
            "strategy": {"class_path": "lightning_shard.ShardStrategy", "init_args": init_args},
        },
        "model": {"kind": "gpt"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return LightningCLI(LitModel, run=False, args=["--config", str(path)], save_config_callback=None)


def full_params(engine: ShardedModule) -> dict[str, torch.Tensor]:
    """Every parameter in full under each of its names (tied weights: gathered once, listed under every name)."""
    full = {p.fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params()}
    return {fqn: full[p.fqn] for p in engine.sharded_params() for fqn in p.fqns}


def full_params_shard(strategy: ShardStrategy) -> dict[str, torch.Tensor]:
    """``full_params`` of the Trainer strategy's model (collective)."""
    return full_params(strategy.engine)


def fit_shard(
    rank: int, world_size: int, kind: str, steps: int = 10, trainer_kwargs: dict | None = None, **strategy_kwargs: Any
) -> dict:
    L.seed_everything(0)
    module = lit_model(kind)
    strategy = ShardStrategy(auto_wrap_policy={block_class(kind)}, **strategy_kwargs)
    trainer = trainer_for(strategy, world_size, steps, **(trainer_kwargs or {}))
    trainer.fit(module, train_dataloaders=loader(kind))
    return {"losses": module.losses, "params": full_params_shard(strategy)}


def fit_ddp(rank: int, world_size: int, kind: str, steps: int = 10, trainer_kwargs: dict | None = None) -> dict:
    L.seed_everything(0)
    module = lit_model(kind)
    trainer = trainer_for(DDPStrategy(), world_size, steps, **(trainer_kwargs or {}))
    trainer.fit(module, train_dataloaders=loader(kind))
    params = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "params": params}
