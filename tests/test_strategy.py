"""ShardStrategy inside the Trainer: loops, metrics, optimizers, configure_model, memory, errors, registry, CLI."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_shard import ShardingStrategy, ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.lightning_fits import (
    ddp_from_weights,
    loops_and_metrics,
    memory_after_step,
    meta_configure_model,
    raising_mesh,
    raising_wrap_policy,
    two_optimizers,
)


def test_validation_test_predict_and_synced_metric_match_ddp() -> None:
    ours = run_on_ranks(loops_and_metrics, 2, False)
    ddp = run_on_ranks(loops_and_metrics, 2, True)
    for a, b in zip(ours, ddp):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]))
        assert len(a["val_losses"]) == len(b["val_losses"]) > 0
        torch.testing.assert_close(torch.tensor(a["val_losses"]), torch.tensor(b["val_losses"]))
        torch.testing.assert_close(torch.tensor(a["val_acc"]), torch.tensor(b["val_acc"]))
        torch.testing.assert_close(torch.tensor(a["test_loss"]), torch.tensor(b["test_loss"]))
        torch.testing.assert_close(a["predictions"], b["predictions"])
    assert ours[0]["val_acc"] == ours[1]["val_acc"]  # synced: every rank logs the global value


def test_multiple_optimizers_with_manual_optimization_match_ddp() -> None:
    ours = run_on_ranks(two_optimizers, 2, False)
    ddp = run_on_ranks(two_optimizers, 2, True)
    for a, b in zip(ours, ddp):
        assert len(a) == len(b) >= 8
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b))


def test_configure_model_on_meta_device_trains_without_materialising_the_model() -> None:
    results = run_on_ranks(meta_configure_model, 2)
    for r in results:
        assert r["built_on_meta"] and r["tied"]
        assert r["largest_unit_bytes"] < r["model_bytes"]  # gathered one unit at a time, never the whole model
    for name, t in results[0]["initial"].items():
        torch.testing.assert_close(t, results[1]["initial"][name])  # every rank initialised the same full tensor
    # From the weights reset_parameters() gave, training matches DDP step for step.
    ddp = run_on_ranks(ddp_from_weights, 2, results[0]["initial"])
    for ours, ref in zip(results, ddp):
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]))
        for name, t in ref["full"].items():
            torch.testing.assert_close(ours["full"][name], t, msg=name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_state_per_rank_is_a_1_over_n_share(world_size: int) -> None:
    for r in run_on_ranks(memory_after_step, world_size):
        report = r["report"]
        assert r["unsharded_alive"] == 0  # between steps no gathered weights remain
        bound = 1.02 * report.replicated.total / world_size + r["padding"]
        assert report.sharded.total <= bound, (report, r["padding"])
        assert report.sharded.gradients > 0 and report.sharded.optimizer_state > 0


def test_unknown_wrap_class_fails_on_every_rank_with_the_classes_present() -> None:
    for message in run_on_ranks(raising_wrap_policy, 2):
        assert "NoSuchBlock" in message and "GPTBlock" in message
        assert "MLPBlock" in message and "Module classes present" in message


def test_mesh_that_does_not_cover_the_world_fails_on_every_rank() -> None:
    for message in run_on_ranks(raising_mesh, 2):
        assert "(3, 2)" in message and "world size is 2" in message


def test_unknown_sharding_strategy_names_the_valid_values() -> None:
    with pytest.raises(ValueError, match="FULL_SHARD.*SHARD_GRAD_OP.*NO_SHARD.*HYBRID_SHARD"):
        ShardStrategy(sharding_strategy="ZERO4")


@pytest.mark.parametrize(
    ("name", "expected"),
    [("shard", "FULL_SHARD"), ("shard_grad_op", "SHARD_GRAD_OP"), ("shard_hybrid", "HYBRID_SHARD")],
)
def test_registered_names(name: str, expected: str) -> None:
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ShardStrategy)
    assert trainer.strategy.sharding_strategy is ShardingStrategy[expected]


def fit_with_swa(rank: int, world_size: int) -> str:
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from tests.fits import trainer_for
    from tests.models import lit_model, loader

    trainer = trainer_for(ShardStrategy(), world_size, 2, callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)])
    with pytest.raises(ValueError) as raised:
        trainer.fit(lit_model("gpt"), train_dataloaders=loader("gpt"))
    return str(raised.value)


def test_stochastic_weight_averaging_is_refused_on_every_rank_before_training() -> None:
    for message in run_on_ranks(fit_with_swa, 2):
        assert message.startswith("StochasticWeightAveraging does not work with ShardStrategy"), message


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_weights_only_false_is_refused_saying_no_pickle_runs(front_end: str, tmp_path: object) -> None:
    """``weights_only=False`` asks a load to run the checkpoint's pickle; the strategy never does, so it says so
    instead of reading as if it had been left unset."""
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    strategy = ShardStrategy() if front_end == "trainer" else FabricShardStrategy()
    with pytest.raises(ValueError, match=r"weights_only=False asks to run the checkpoint.s pickle"):
        strategy.load_checkpoint(str(tmp_path), weights_only=False)
