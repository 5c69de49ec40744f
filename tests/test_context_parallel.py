"""``ShardStrategy(context_parallel_size=C)`` under the Trainer and Fabric, on pooled gloo ranks: the losses
``training_step`` returns and the trained weights equal DDP's on the same global batch (C=2 on 2 ranks, 2 data x 2
context on 4, and with a tensor-parallel plan on 4), checkpoints resume across context-parallel sizes, and bad
configurations are refused. In fresh processes under Lightning's launcher: tests/test_context_parallel_launch.py."""

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
from tests.fits import trainer_for
from tests.test_context_parallel_engine import _whole
from tests.test_parity import assert_same_training

STEPS = 10


def fit(rank: int, world_size: int, engine: str, steps: int = STEPS, tensor_parallel: bool = False,
        save: str | None = None, resume: str | None = None, samples: int = 48,
        **strategy_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    L.seed_everything(0)
    module = LitCausalLM(tensor_parallel=tensor_parallel)
    if engine == "ddp":
        strategy: Any = DDPStrategy()
    else:
        strategy = ShardStrategy(auto_wrap_policy={Block}, **strategy_kwargs)
    trainer = trainer_for(strategy, world_size, steps)
    trainer.fit(module, train_dataloaders=token_loader(samples=samples), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    if engine == "ddp":
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    else:
        params = _whole(module)
    mesh = None if engine == "ddp" else strategy.device_mesh.mesh_dim_names
    return {"losses": module.losses, "params": params, "mesh": mesh}


@pytest.mark.parametrize(
    ("world_size", "kwargs"),
    [(2, {"context_parallel_size": 2}), (4, {"context_parallel_size": 2}),
     (4, {"context_parallel_size": 2, "tensor_parallel_size": 2, "tensor_parallel": True})],
    ids=["context2", "data2-context2", "context2-tensor2"],
)  # fmt: skip
def test_trainer_trains_as_ddp_on_the_global_batch(world_size: int, kwargs: dict[str, Any]) -> None:
    """Every rank's ``training_step`` returns its data-parallel rank's whole-sequence loss, DDP's on the same
    rank's batch, and the weights are DDP's after 10 steps."""
    data = world_size // (kwargs["context_parallel_size"] * kwargs.get("tensor_parallel_size", 1))
    ours = run_on_ranks(fit, world_size, "shard", **kwargs)
    reference = run_on_ranks(fit, data, "ddp")
    block = world_size // data
    assert ours[0]["mesh"] == ("data_parallel", "context_parallel", "tensor_parallel")
    assert_same_training(ours, [reference[rank // block] for rank in range(world_size)])


@pytest.mark.parametrize(("saved", "resumed"), [((2, 2), (1, 1)), ((1, 1), (2, 2))], ids=["C2->C1", "C1->C2"])
def test_a_checkpoint_resumes_at_another_context_parallel_size(
    saved: tuple[int, int], resumed: tuple[int, int], tmp_path: Path
) -> None:
    """(world size, context_parallel_size): a save after 5 steps resumes at the other size and continues with the
    losses and weights of the uninterrupted run (one batch per epoch, so that the resumed fit sees what the
    uninterrupted one saw)."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(fit, saved[0], "shard", steps=5, save=path, samples=2, context_parallel_size=saved[1])
    ours = run_on_ranks(fit, resumed[0], "shard", resume=path, samples=2, context_parallel_size=resumed[1])
    whole = run_on_ranks(fit, 1, "ddp", samples=2)[0]
    for rank, result in enumerate(ours):
        losses = torch.tensor(result["losses"])
        torch.testing.assert_close(losses, torch.tensor(whole["losses"][5:]), msg=f"rank {rank}")
        for name, value in whole["params"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")
