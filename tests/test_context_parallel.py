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
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_shard import ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.context_parallel_models import Block, CausalLM, LitCausalLM, LitLlama, lm_loss, token_batches, token_loader
from tests.fits import trainer_for
from tests.test_context_parallel_engine import _whole
from tests.test_parity import assert_same_training

STEPS = 10


def fit(rank: int, world_size: int, engine: str, steps: int = STEPS, tensor_parallel: bool = False,
        save: str | None = None, resume: str | None = None, samples: int = 48, llama: bool = False,
        **strategy_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    L.seed_everything(0)
    module = LitLlama() if llama else LitCausalLM(tensor_parallel=tensor_parallel)
    if engine == "ddp":
        strategy: Any = DDPStrategy()
    else:
        unit = LlamaDecoderLayer if llama else Block
        strategy = ShardStrategy(auto_wrap_policy={unit}, **strategy_kwargs)
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
     (4, {"context_parallel_size": 2, "tensor_parallel_size": 2, "tensor_parallel": True}),
     (2, {"context_parallel_size": 2, "llama": True}), (4, {"context_parallel_size": 2, "llama": True})],
    ids=["context2", "data2-context2", "context2-tensor2", "llama-context2", "llama-data2-context2"],
)  # fmt: skip
def test_trainer_trains_as_ddp_on_the_global_batch(world_size: int, kwargs: dict[str, Any]) -> None:
    """Every rank's ``training_step`` returns its data-parallel rank's whole-sequence loss, DDP's on the same
    rank's batch, and the weights are DDP's after 10 steps."""
    data = world_size // (kwargs["context_parallel_size"] * kwargs.get("tensor_parallel_size", 1))
    ours = run_on_ranks(fit, world_size, "shard", **kwargs)
    reference = run_on_ranks(fit, data, "ddp", llama=kwargs.get("llama", False))
    block = world_size // data
    assert ours[0]["mesh"] == ("data_parallel", "context_parallel", "tensor_parallel")
    assert_same_training(ours, [reference[rank // block] for rank in range(world_size)])


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [((2, 2, 1), (1, 1, 1)), ((1, 1, 1), (2, 2, 1)), ((4, 2, 2), (2, 1, 2)), ((2, 1, 2), (4, 2, 2))],
    ids=["C2->C1", "C1->C2", "C2T2->T2", "T2->C2T2"],
)
def test_a_checkpoint_resumes_at_another_context_parallel_size(
    saved: tuple[int, int, int], resumed: tuple[int, int, int], tmp_path: Path
) -> None:
    """(world size, context_parallel_size, tensor_parallel_size): a save after 5 steps resumes at the other size and
    continues with the losses and weights of the uninterrupted run (one batch per epoch, so that the resumed fit sees
    what the uninterrupted one saw)."""
    path = str(tmp_path / "ckpt")

    def sizes(world: int, context: int, tensor: int) -> dict[str, Any]:
        extra = {"tensor_parallel_size": tensor, "tensor_parallel": True} if tensor > 1 else {}
        return {"context_parallel_size": context, **extra}

    run_on_ranks(fit, saved[0], "shard", steps=5, save=path, samples=2, **sizes(*saved))
    ours = run_on_ranks(fit, resumed[0], "shard", resume=path, samples=2, **sizes(*resumed))
    whole = run_on_ranks(fit, 1, "ddp", samples=2)[0]
    for rank, result in enumerate(ours):
        losses = torch.tensor(result["losses"])
        torch.testing.assert_close(losses, torch.tensor(whole["losses"][5:]), msg=f"rank {rank}")
        for name, value in whole["params"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")


class _LossOf(torch.nn.Module):
    """A module whose forward computes the loss, as Fabric users write one to have the whole sequence's."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, x, y, position_ids)


def fabric_steps(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world_size,
                      strategy=FabricShardStrategy(auto_wrap_policy={Block}, context_parallel_size=2))  # fmt: skip
    fabric.launch()
    torch.manual_seed(0)
    reference, model = CausalLM(), CausalLM()
    model.load_state_dict(reference.state_dict())
    wrapper = _LossOf(model)
    module = fabric.setup_module(wrapper)
    mesh = fabric.strategy.device_mesh
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    losses, ref_losses = [], []
    for x, y, pos in token_batches(3, 2):
        loss = module(x, y, pos)
        fabric.backward(loss)
        ref_loss = lm_loss(reference, x, y, pos)
        ref_loss.backward()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses, "params": _whole(wrapper),
            "mesh": mesh["context_parallel"].size(),
            "reference": {f"model.{n}": p.detach() for n, p in reference.named_parameters()}}  # fmt: skip


def test_fabric_trains_as_the_whole_model_when_the_forward_computes_the_loss() -> None:
    for rank, result in enumerate(run_on_ranks(fabric_steps, 2)):
        assert result["mesh"] == 2
        torch.testing.assert_close(result["losses"], result["ref_losses"], msg=f"losses, rank {rank}")
        for name, value in result["reference"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")


def test_sizes_that_do_not_fill_the_world_are_refused_before_any_process_group() -> None:
    from lightning_shard.common.distributed import ParallelSizeError, parallel_dims
    from lightning_shard.common.options import ShardOptions

    options = ShardOptions.parse(context_parallel_size=2, tensor_parallel_size=2)
    dims = parallel_dims(options, 1, 8, rank=0)
    assert (dims.data, dims.context, dims.tensor) == (2, 2, 2)
    with pytest.raises(ParallelSizeError, match="`context_parallel_size=2`"):
        parallel_dims(options, 1, 6, rank=0)


def test_activation_checkpointing_with_context_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="context_parallel_size=2 with activation checkpointing is not supported"):
        ShardStrategy(context_parallel_size=2, activation_checkpointing_policy={Block})
    with pytest.raises(ValueError, match="context_parallel_size must be"):
        ShardStrategy(context_parallel_size=0)
