"""``ShardStrategy(pipeline_parallel_size=P)`` under the Trainer and Fabric, on pooled gloo ranks: the losses
``training_step`` returns and the trained weights equal DDP's on the same global batch (P=2 on 2 ranks, 2 stages x
2 data-parallel ranks on 4, for every schedule), checkpoints resume across pipeline sizes, and what cannot be split
is refused. In fresh processes under Lightning's launcher: tests/test_pipeline_parallel_launch.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_shard import ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.context_parallel_models import Block, LitCausalLM, token_loader
from tests.fits import full_params, trainer_for
from tests.test_parity import assert_same_training

STEPS = 10


def fit(rank: int, world_size: int, engine: str, steps: int = STEPS, save: str | None = None,
        resume: str | None = None, samples: int = 48, trainer_kwargs: dict | None = None,
        **strategy_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """Train the causal LM on 4 sequences per data-parallel rank; return this rank's losses, and the whole model's
    weights (every stage's, gathered)."""
    L.seed_everything(0)
    module = LitCausalLM()
    strategy = DDPStrategy() if engine == "ddp" else ShardStrategy(auto_wrap_policy={Block}, **strategy_kwargs)
    trainer = trainer_for(strategy, world_size, steps, **(trainer_kwargs or {}))
    trainer.fit(module, train_dataloaders=token_loader(batch=4, samples=samples), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    if engine == "ddp":
        return {"losses": module.losses, "params": {n: p.detach().clone() for n, p in module.named_parameters()}}
    stage = full_params(strategy.engine)
    everything: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(everything, stage)
    params = {name: value for part in everything for name, value in part.items()}
    return {"losses": module.losses, "params": params, "mesh": strategy.device_mesh.mesh_dim_names}


@pytest.mark.parametrize("schedule", ["gpipe", "1F1B"])
@pytest.mark.parametrize("world_size", [2, 4], ids=["pipeline2", "pipeline2-data2"])
def test_trainer_trains_as_ddp_on_the_global_batch(world_size: int, schedule: str) -> None:
    """Every rank's ``training_step`` returns its data-parallel rank's loss, DDP's on the same batch, and the
    weights are DDP's after the steps."""
    data = world_size // 2
    ours = run_on_ranks(fit, world_size, "shard", pipeline_parallel_size=2, pipeline_schedule=schedule,
                        microbatches=2)  # fmt: skip
    reference = run_on_ranks(fit, data, "ddp")
    assert ours[0]["mesh"] == ("pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel")
    assert_same_training(ours, [reference[rank % data] for rank in range(world_size)])


def test_a_checkpoint_saved_without_pipeline_resumes_at_two_stages(tmp_path: Path) -> None:
    """A save after 5 steps at P=1 resumes at P=2 (each stage reading its own parameters' rows and optimizer state)
    and continues with the losses and weights of the uninterrupted run (one batch per epoch, so that the resumed fit
    sees what the uninterrupted one saw)."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(fit, 1, "shard", steps=5, save=path, samples=4)
    ours = run_on_ranks(fit, 2, "shard", resume=path, samples=4, pipeline_parallel_size=2)
    whole = run_on_ranks(fit, 1, "ddp", samples=4)[0]
    for rank, result in enumerate(ours):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(whole["losses"][5:]),
                                   msg=f"rank {rank}")  # fmt: skip
        assert result["params"].keys() == whole["params"].keys()
        for name, value in whole["params"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")
