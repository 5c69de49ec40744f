"""Freezing and unfreezing parameters after the model is sharded (see [Note: requires_grad changed after sharding]):
training follows the new flags exactly as a replicated model does, under the engine's own API and under the Trainer
with Lightning's ``BaseFinetuning``; a change inside a ``grad_sync="step"`` window is refused on every rank.

The reference is a full replica on every rank whose gradients are all-reduced by hand, whatever requires gradient
at that step: DDP itself is not one, since its reducer only ever covers the parameters that required gradients when
it was built."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import BaseFinetuning

from lightning_shard import ShardStrategy
from lightning_shard.engine import shard_model, sharded_module_of
from lightning_shard.testing import run_on_ranks
from tests.checkpoint_fits import module_full_state
from tests.fits import full_params_shard, trainer_for
from tests.models import GPTBlock, TinyGPT, lit_model, loader, make_dataset

STEPS = 8
FREEZE_AT, UNFREEZE_AT = 2, 5  # the blocks are frozen for steps 2-4; unfreezing makes every block weight trainable


def _set_blocks_trainable(model: torch.nn.Module, trainable: bool) -> None:
    for p in model.blocks.parameters():  # unfreezing includes the weight TinyGPT builds frozen (blocks.0.qkv.weight)
        p.requires_grad_(trainable)


def freeze_and_unfreeze(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    reference, model = TinyGPT(), TinyGPT()
    model.load_state_dict(reference.state_dict())
    shard_model(model, auto_wrap_policy={GPTBlock})
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = make_dataset("gpt")
    losses, ref_losses, trainable_counts = [], [], []
    for step in range(STEPS):
        if step in (FREEZE_AT, UNFREEZE_AT):
            _set_blocks_trainable(reference, step == UNFREEZE_AT)
            _set_blocks_trainable(model, step == UNFREEZE_AT)
        x, y = data[(step * world_size + rank) * 3 : (step * world_size + rank) * 3 + 3]
        for net, opt, record in ((reference, ref_optimizer, ref_losses), (model, optimizer, losses)):
            opt.zero_grad()
            loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            loss.backward()
            record.append(loss.item())
            if net is reference:
                for p in reference.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(world_size)
            opt.step()
        trainable_counts.append(sum(p.grad is not None for p in model.parameters()))
    return {
        "losses": losses, "ref_losses": ref_losses, "trainable": trainable_counts,
        "full": module_full_state(model, [])["params"],
        "ref": {n: p.detach().clone() for n, p in reference.named_parameters()},
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_freezing_and_unfreezing_blocks_after_sharding_trains_like_the_replicated_model(world_size: int) -> None:
    for rank, run in enumerate(run_on_ranks(freeze_and_unfreeze, world_size)):
        torch.testing.assert_close(
            torch.tensor(run["losses"]), torch.tensor(run["ref_losses"]), msg=lambda m, r=rank: f"rank {r}: {m}"
        )
        for name, expected in run["ref"].items():
            torch.testing.assert_close(run["full"][name], expected, msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")
        counts = run["trainable"]  # shards with a gradient after each step
        assert counts[FREEZE_AT] < counts[0] < counts[UNFREEZE_AT], counts


def change_inside_an_accumulation_window(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = TinyGPT()
    shard_model(model, auto_wrap_policy={GPTBlock})
    engine = sharded_module_of(model)
    assert engine is not None
    x, y = make_dataset("gpt")[rank * 3 : rank * 3 + 3]
    engine.hold_gradients(True)  # what grad_sync="step" does inside an accumulation window
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    _set_blocks_trainable(model, False)
    with pytest.raises(RuntimeError) as raised:
        model(x)
    return str(raised.value)


def test_a_change_while_gradients_are_held_unreduced_is_refused_on_every_rank() -> None:
    for message in run_on_ranks(change_inside_an_accumulation_window, 2):
        assert "requires_grad of blocks.0." in message, message
        assert "holds gradients that are not reduced yet" in message, message
        assert "after the optimizer step that ends the window" in message, message


class FreezeBlocksUntilEpoch1(BaseFinetuning):
    """Lightning's fine-tuning callback pattern: the blocks frozen before training, unfrozen at epoch 1."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.model.blocks)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.blocks, optimizer, lr=1e-2)


def fit_with_base_finetuning(rank: int, world_size: int) -> dict[str, Any]:
    L.seed_everything(0)
    module = lit_model("gpt")
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock})
    snapshots: list[dict[str, torch.Tensor]] = []

    class Snapshot(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            snapshots.append(full_params_shard(strategy))

    batches_per_epoch = len(loader("gpt")) // world_size
    callbacks = [FreezeBlocksUntilEpoch1(), Snapshot()]
    trainer = trainer_for(strategy, world_size, 2 * batches_per_epoch, callbacks=callbacks)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer.fit(module, train_dataloaders=loader("gpt"))
    return {"initial": initial, "after_epoch": snapshots}


def test_base_finetuning_trains_the_blocks_only_after_unfreezing_them() -> None:
    run = run_on_ranks(fit_with_base_finetuning, 2)[0]
    first, second = run["after_epoch"]
    blocks = [n for n in run["initial"] if ".blocks." in n or n.startswith("blocks.")]
    assert blocks
    for name in blocks:
        torch.testing.assert_close(first[name], run["initial"][name], rtol=0, atol=0, msg=name)  # frozen in epoch 0
        assert not torch.equal(second[name], first[name]), f"{name} did not train after unfreezing"
