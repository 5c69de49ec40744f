"""PyTorch's own FSDP2 (``torch.distributed.fsdp.fully_shard``) as a reference for ``ShardStrategy``.

The same model, initialisation, optimizer and per-rank data are trained once through the Trainer
with ``ShardStrategy`` (FULL_SHARD) and once by hand with ``fully_shard`` applied to every block
and then to the network; per-step losses and final full parameters must agree on every rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import lightning as L
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard.testing import run_on_ranks
from tests.fits import fit_shard
from tests.models import LitModel, block_class, make_dataset


def fit_fully_shard(rank: int, world_size: int, kind: str, steps: int = 10) -> dict:
    """What ``fit_shard`` does through the Trainer, by hand on FSDP2."""
    L.seed_everything(0)
    module = LitModel(kind)
    mesh = init_device_mesh("cpu", (world_size,))
    for sub in module.model.modules():
        if isinstance(sub, block_class(kind)):
            fully_shard(sub, mesh=mesh)
    fully_shard(module.model, mesh=mesh)  # the root last: it takes what no block claims (the tied wte/lm_head)
    optimizer = module.configure_optimizers()

    # The Trainer replaces the loader's sampler with a DistributedSampler that always shuffles a training
    # loader (even one built with shuffle=False), seeded with the global seed and re-seeded each epoch.
    dataset = make_dataset(kind)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    data = DataLoader(dataset, batch_size=4, sampler=sampler)
    module.train()
    for i, batch in zip(range(steps), _epochs(data, sampler)):
        loss = module.training_step(batch, i)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    params = {name: p.full_tensor().detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "params": params}


def _epochs(data: DataLoader, sampler: DistributedSampler) -> Iterator:
    """The batches of epoch 0, 1, 2, ... as the Trainer draws them (``set_epoch`` before each)."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from data


def check_same_fit(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]))
    assert a["params"].keys() == b["params"].keys()
    for name, value in a["params"].items():
        torch.testing.assert_close(value, b["params"][name], msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_shard_strategy_matches_fully_shard(kind: str, world_size: int) -> None:
    ours = run_on_ranks(fit_shard, world_size, kind)
    reference = run_on_ranks(fit_fully_shard, world_size, kind)
    for rank, (a, b) in enumerate(zip(ours, reference)):
        assert len(a["losses"]) == 10, f"rank {rank}"
        check_same_fit(a, b)
    if kind == "gpt":  # the frozen parameters kept their initial values under both
        with torch.random.fork_rng():
            torch.manual_seed(0)
            init = dict(LitModel(kind).named_parameters())
        for name in ("model.wpe.weight", "model.blocks.0.qkv.weight"):
            torch.testing.assert_close(reference[0]["params"][name], init[name].detach(), rtol=0, atol=0)


def check_fully_shard_layout(rank: int, world_size: int) -> dict:
    """The reference really shards: every parameter a DTensor with this rank's rows, ties and frozen flags kept."""
    L.seed_everything(0)
    module = LitModel("gpt")
    mesh = init_device_mesh("cpu", (world_size,))
    for block in module.model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module.model, mesh=mesh)
    model = module.model
    return {
        "tied": model.lm_head.weight is model.wte.weight,
        "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
        "local_rows": model.wte.weight.to_local().shape[0],
        "global_rows": model.wte.weight.shape[0],
    }


def test_reference_is_sharded_with_ties_and_frozen_params() -> None:
    for info in run_on_ranks(check_fully_shard_layout, 2):
        assert info["tied"]
        assert info["frozen"] == ["blocks.0.qkv.weight", "wpe.weight"]
        assert info["global_rows"] == 37
        assert info["local_rows"] in (18, 19)
