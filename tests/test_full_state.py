"""Lightning checkpoints under ShardStrategy hold the full model and optimizer state: resume is exact and a
checkpoint saved by N ranks loads on M."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.models import GPTBlock, LitModel, loader


class CapturingModel(LitModel):
    """Records the full parameters and Adam state as they are when training starts (after any restore)."""

    def on_train_start(self) -> None:
        engine = self.trainer.strategy.engine
        self.start_params = {fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params() for fqn in p.fqns}
        # deepcopy: like Optimizer.state_dict(), it refers to live scalar tensors (Adam's step) that keep counting
        self.start_optimizer = copy.deepcopy(self.trainer.strategy.optimizer_state(self.trainer.optimizers[0]))


def fit_epochs(rank: int, world_size: int, ckpt_dir: str, epochs: int, resume: str | None) -> dict[str, Any]:
    L.seed_everything(0)
    module = CapturingModel("gpt")
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ShardStrategy(auto_wrap_policy={GPTBlock}),
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)],
    )
    trainer.fit(module, train_dataloaders=loader("gpt"), ckpt_path=resume)
    return {"losses": module.losses, "start_params": module.start_params, "start_optimizer": module.start_optimizer}


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = run_on_ranks(fit_epochs, 2, str(tmp_path / "a"), 2, None)
    first = run_on_ranks(fit_epochs, 2, str(tmp_path / "b"), 1, None)
    resumed = run_on_ranks(fit_epochs, 2, str(tmp_path / "c"), 2, str(tmp_path / "b" / "last.ckpt"))
    for full, part1, part2 in zip(uninterrupted, first, resumed):
        steps = len(part1["losses"])
        assert steps > 0 and len(full["losses"]) == 2 * steps
        torch.testing.assert_close(torch.tensor(part1["losses"] + part2["losses"]), torch.tensor(full["losses"]))


def test_checkpoint_saved_on_two_ranks_loads_on_four_and_one(tmp_path: Path) -> None:
    run_on_ranks(fit_epochs, 2, str(tmp_path / "saved"), 1, None)
    ckpt = tmp_path / "saved" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    assert saved["state_dict"]["model.wte.weight"].shape == (37, 16)  # full tensors, not shards
    for world_size in (4, 1):
        loaded = run_on_ranks(fit_epochs, world_size, str(tmp_path / f"out{world_size}"), 2, str(ckpt))
        for rank_result in loaded:
            for name, t in saved["state_dict"].items():
                torch.testing.assert_close(rank_result["start_params"][name], t, msg=name)
            state = rank_result["start_optimizer"]["state"]
            for index, param_state in saved["optimizer_states"][0]["state"].items():
                for key, value in param_state.items():
                    torch.testing.assert_close(state[index][key], value, msg=lambda m, i=index, k=key: f"{i}.{k}: {m}")
