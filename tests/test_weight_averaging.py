"""Lightning's WeightAveraging callbacks under ShardStrategy: each rank averages its own rows, validation runs on the
averaged weights, the end of fit leaves them in the model, and checkpoints store the average sharded, resuming at
any world size. References: DDP with the same callback, and the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, WeightAveraging
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from lightning_shard import ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.fits import trainer_for
from tests.lightning_fits import Classifier
from tests.models import LitModel, MLPBlock, loader


def _full_weights(strategy: Any, module: L.LightningModule) -> dict[str, Tensor]:
    if isinstance(strategy, ShardStrategy):
        engine = strategy.engine
        return {fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params() for fqn in p.fqns}
    return {n: p.detach().clone() for n, p in module.named_parameters()}


class EveryThirdStep(WeightAveraging):
    """A user's subclass: the equal-weight (SWA) average of the weights after every third optimizer step."""

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx % 3 == 2


def averaged_fit(rank: int, world_size: int, use_ddp: bool, callback: str) -> dict[str, Any]:
    L.seed_everything(0)
    module = Classifier()
    averaging = EMAWeightAveraging(decay=0.8) if callback == "ema" else EveryThirdStep()
    strategy = DDPStrategy() if use_ddp else ShardStrategy(auto_wrap_policy={MLPBlock})
    trainer = trainer_for(strategy, world_size, steps=12, max_epochs=3, limit_val_batches=3, callbacks=[averaging])
    trainer.fit(module, train_dataloaders=loader("mlp"), val_dataloaders=loader("mlp"))
    return {"val_losses": module.val_losses, "losses": module.losses, "weights": _full_weights(strategy, module)}


@pytest.mark.parametrize("callback", ["ema", "subclass"])
def test_weight_averaging_matches_ddp(callback: str) -> None:
    ours = run_on_ranks(averaged_fit, 2, False, callback)
    ddp = run_on_ranks(averaged_fit, 2, True, callback)
    for mine, theirs in zip(ours, ddp):
        assert mine["val_losses"], "no validation ran"
        torch.testing.assert_close(mine["losses"], theirs["losses"])
        torch.testing.assert_close(mine["val_losses"], theirs["val_losses"])  # on the averaged weights
        torch.testing.assert_close(mine["weights"], theirs["weights"])  # the average, copied in at the end of fit


def resumable_fit(rank: int, world_size: int, directory: str, steps: int, resume: str | None) -> dict[str, Tensor]:
    """EMA over 12 steps; every rank sees the same batches (no distributed sampler), so the run does not depend on
    the world size. Without ``resume`` it saves a checkpoint after step 6 into ``directory``; with it, Lightning's
default checkpoint goes there too (not into the working directory)."""
    L.seed_everything(0)
    module = LitModel("mlp")
    callbacks: list[Any] = [EMAWeightAveraging(decay=0.8)]
    if resume is None:
        callbacks.append(ModelCheckpoint(dirpath=directory, filename="mid", every_n_train_steps=6, save_top_k=-1))
    strategy = ShardStrategy(auto_wrap_policy={MLPBlock})
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks,
        limit_train_batches=6,  # the save after step 6 ends an epoch: resuming starts the next one
        default_root_dir=directory,  # where Lightning's own checkpoint of a resumed run goes
    )
    trainer.fit(module, train_dataloaders=loader("mlp"), ckpt_path=resume)
    return _full_weights(strategy, module)


@pytest.fixture(scope="module")
def saved_mid_fit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Tensor]]:
    """A checkpoint saved on 2 ranks after step 6 of an EMA fit, and that 6-step run's final weights (the average
    after 6 steps, which the end of fit copies into the model)."""
    directory = tmp_path_factory.mktemp("saved")
    weights = run_on_ranks(resumable_fit, 2, str(directory), 6, None)[0]
    return directory / "mid.ckpt", weights


def test_average_is_saved_sharded_and_resumes_at_another_world_size(
    tmp_path: Path, saved_mid_fit: tuple[Path, dict[str, Tensor]]
) -> None:
    checkpoint, _ = saved_mid_fit
    uninterrupted = run_on_ranks(resumable_fit, 2, str(tmp_path / "full"), 12, None)[0]
    index = json.loads((checkpoint / "index.json").read_text())
    averaged = {k: v for k, v in index["tensors"].items() if k.startswith("average/")}
    model = {k.removeprefix("model/") for k in index["tensors"] if k.startswith("model/")}
    assert {k.removeprefix("average/") for k in averaged} == model
    model_entries = {k.removeprefix("model/"): v for k, v in index["tensors"].items() if k.startswith("model/")}
    for key, entry in averaged.items():  # in the shard files, laid out as the model's weights
        assert entry.get("split") or entry["file"] in index["shard_files"], key
        assert ("split" in entry) == ("split" in model_entries[key.removeprefix("average/")]), key
    resumed = run_on_ranks(resumable_fit, 3, str(tmp_path / "unused"), 12, str(checkpoint))
    for weights in resumed:
        torch.testing.assert_close(weights, uninterrupted)


def test_load_and_export_pick_the_averaged_or_the_current_weights(
    tmp_path: Path, saved_mid_fit: tuple[Path, dict[str, Tensor]]
) -> None:
    from safetensors.torch import load_file

    from lightning_shard import load_from_checkpoint
    from lightning_shard.checkpoint.interop.hf import export_hf

    checkpoint, average_after_6_steps = saved_mid_fit
    averaged = load_from_checkpoint(LitModel, checkpoint, weights="averaged", kind="mlp")
    torch.testing.assert_close(dict(averaged.named_parameters()), average_after_6_steps)
    current = load_from_checkpoint(LitModel, checkpoint, kind="mlp")  # default: the weights as trained
    assert not torch.equal(current.model.head.weight, averaged.model.head.weight)
    export_hf(checkpoint, tmp_path / "hf", prefix="model", weights="averaged")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    torch.testing.assert_close(exported, {k.removeprefix("model."): v for k, v in average_after_6_steps.items()})
