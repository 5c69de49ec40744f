"""PyTorch's own FSDP2 (``torch.distributed.fsdp.fully_shard``) as a reference for ``ShardStrategy``.

The same model, initialisation, optimizer and per-rank data are trained once through the Trainer
with ``ShardStrategy`` and once by hand with ``fully_shard`` applied to every block and then to the
network; per-step losses and final full parameters must agree on every rank. ``fit_fully_shard``
also takes the sharding strategy and the Trainer precision, translated into what FSDP2 calls them
(see its docstring); ``tests/test_precision.py`` compares the precisions with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard.testing import run_on_ranks
from tests.fits import fit_shard
from tests.models import LitModel, block_class, lit_model, make_dataset

_HALF = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16}


def fit_fully_shard(
    rank: int,
    world_size: int,
    kind: str,
    steps: int = 10,
    precision: str = "32-true",
    sharding: str = "FULL_SHARD",
    device_mesh: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """What ``fit_shard`` does through the Trainer, by hand on FSDP2.

    ``sharding`` as FSDP2 spells it: ``SHARD_GRAD_OP`` is ``reshard_after_forward=False``, ``NO_SHARD``
    a ``(world_size, 1)`` mesh (replicate everywhere, shard over one rank) and ``HYBRID_SHARD`` the
    ``(replicas, shard_size)`` mesh ``device_mesh``, whose rows shard and whose columns replicate, as ours.
    ``precision`` as the Trainer's plugin applies it: the ``*-mixed`` ones gather and compute in half
    precision (``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)``) with the forward and the
    loss under autocast, and inputs left as they are (autocast casts them); ``"16-mixed"`` scales the loss
    with PyTorch's ``ShardedGradScaler``; ``"bf16-true"`` casts the model to bf16 and computes in it.
    Records ``scales``: the loss scale at the start of every step (empty without a scaler).
    """
    L.seed_everything(0)
    module = lit_model(kind)
    half = _HALF.get(precision)
    if precision == "bf16-true":
        module.to(torch.bfloat16)
    policy = MixedPrecisionPolicy()
    if precision.endswith("-mixed"):
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mesh = _fully_shard_mesh(world_size, sharding, device_mesh)
    reshard = False if sharding == "SHARD_GRAD_OP" else None  # None: FSDP2's default (the root stays gathered)
    for sub in module.model.modules():
        if isinstance(sub, block_class(kind)):
            fully_shard(sub, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    # The root last: it takes what no block claims (the tied wte/lm_head).
    fully_shard(module.model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    optimizer = module.configure_optimizers()
    scaler = ShardedGradScaler("cpu") if precision == "16-mixed" else None

    # The Trainer replaces the loader's sampler with a DistributedSampler that always shuffles a training
    # loader (even one built with shuffle=False), seeded with the global seed and re-seeded each epoch.
    dataset = make_dataset(kind)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    data = DataLoader(dataset, batch_size=4, sampler=sampler)
    module.train()
    scales: list[float] = []
    for i, batch in zip(range(steps), _epochs(data, sampler)):
        with _forward_precision(precision):
            if precision == "bf16-true":
                batch = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in batch]
            loss = module.training_step(batch, i)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()

    params = {name: p.full_tensor().detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "params": params, "scales": scales}


def _fully_shard_mesh(world_size: int, sharding: str, device_mesh: tuple[int, int] | None) -> DeviceMesh:
    match sharding:
        case "FULL_SHARD" | "SHARD_GRAD_OP":
            return init_device_mesh("cpu", (world_size,))
        case "NO_SHARD":
            return init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
        case "HYBRID_SHARD":
            assert device_mesh is not None
            return init_device_mesh("cpu", device_mesh, mesh_dim_names=("replicate", "shard"))
    raise ValueError(f"Unknown sharding {sharding!r}")


@contextmanager
def _forward_precision(precision: str) -> Generator[None, None, None]:
    """Autocast for the ``*-mixed`` precisions; bf16 as the default dtype for ``"bf16-true"``."""
    half = _HALF.get(precision)
    if half is None:
        yield
    elif precision.endswith("-mixed"):
        with torch.autocast("cpu", dtype=half, cache_enabled=False):
            yield
    else:
        default = torch.get_default_dtype()
        torch.set_default_dtype(half)
        try:
            yield
        finally:
            torch.set_default_dtype(default)


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
