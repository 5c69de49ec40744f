"""A Hugging Face ``transformers`` GPT-2 (tied LM head, built from a config: no download) trained
under ``ShardStrategy`` with its blocks named by class name must follow DDP step for step.

``transformers`` is a test dependency (the ``[test]`` extra), imported unconditionally: without it this file
fails to collect instead of being skipped."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import transformers
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.fits import full_params_shard, trainer_for
from tests.test_parity import assert_same_training

STEPS = 10


def gpt2_config() -> Any:
    return transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


class LitGPT2(L.LightningModule):
    """GPT-2 language modelling on its own inputs; records this rank's loss at every training step."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = transformers.GPT2LMHeadModel(gpt2_config())
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def gpt2_loader(n: int = 64, seq: int = 16, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(4321)
    tokens = torch.randint(0, 64, (n, seq), generator=g)
    return DataLoader(TensorDataset(tokens), batch_size=batch_size, shuffle=False)


def fit_gpt2_shard(rank: int, world_size: int, steps: int = STEPS) -> dict:
    L.seed_everything(0)
    module = LitGPT2()
    strategy = ShardStrategy(auto_wrap_policy={"GPT2Block"})
    trainer = trainer_for(strategy, world_size, steps)
    trainer.fit(module, train_dataloaders=gpt2_loader())
    engine = strategy.engine
    return {
        "losses": module.losses,
        "params": full_params_shard(strategy),
        "units": [unit.name for unit in engine.units],
        "tied": [sorted(p.fqns) for p in engine.sharded_params() if len(p.fqns) > 1],
        "sharded": all(p.sharded.numel() < p.global_shape.numel() for p in engine.sharded_params()),
    }


def fit_gpt2_ddp(rank: int, world_size: int, steps: int = STEPS) -> dict:
    L.seed_everything(0)
    module = LitGPT2()
    trainer = trainer_for(DDPStrategy(), world_size, steps)
    trainer.fit(module, train_dataloaders=gpt2_loader())
    params = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "params": params}


def test_gpt2_shard_matches_ddp() -> None:
    sharded = run_on_ranks(fit_gpt2_shard, 2)
    replicated = run_on_ranks(fit_gpt2_ddp, 2)
    for rank, a in enumerate(sharded):
        assert a["units"] == ["", "model.transformer.h.0", "model.transformer.h.1"], f"rank {rank}"
        assert a["tied"] == [["model.lm_head.weight", "model.transformer.wte.weight"]], f"rank {rank}"
        assert a["sharded"], f"rank {rank}"
        assert len(a["losses"]) == STEPS, f"rank {rank}"
    assert_same_training(sharded, replicated)
