"""CPU offload on a CPU-only machine: the registry name, the flag being a no-op (with a warning) on a CPU device,
and the values the offload data path computes.

What these tests can see is values, not placement. With the compute device ``cpu:0``, which the engine
treats as distinct from the shards' ``cpu``, units take the offload branches of the GPU path: a full-weight
buffer of their own, this rank's chunk copied into a send buffer before each gather (the upload), and the
reduced rows handed to the shards' gradients through the download branch (no copy here: both sides are
``cpu``). Training must give the same bits as shards that live where the model computes. Where tensors end
up (pinned CPU memory for the shards, the GPU for the gathered weights) cannot be told apart here, since
every tensor is ``cpu``: tests/test_cuda.py checks placement on a GPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from lightning_shard import MixedPrecision, ShardingStrategy, ShardStrategy
from lightning_shard.engine.clipping import clip_grad_norm_
from lightning_shard.engine.mesh import build_shard_mesh
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.engine.sharded_module import shard_module
from lightning_shard.testing import run_on_ranks
from tests.fits import cli_with_strategy_args, trainer_for
from tests.models import GPTBlock, LitModel, TinyGPT, loader


def test_shard_offload_is_registered() -> None:
    trainer = Trainer(strategy="shard_offload", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ShardStrategy)
    assert trainer.strategy.cpu_offload
    assert trainer.strategy.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert not trainer.strategy.offloads  # CPU device: nothing to offload from


def test_cpu_offload_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="cpu_offload must be True or False"):
        ShardStrategy(cpu_offload="yes")  # type: ignore[arg-type]


def fit_recording_warnings(rank: int, world_size: int) -> dict:
    L.seed_everything(0)
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, cpu_offload=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_for(strategy, world_size, steps=1).fit(LitModel("gpt"), train_dataloaders=loader("gpt"))
    return {
        "warnings": [str(w.message) for w in caught],
        "offloads": strategy.offloads,
    }


def test_cpu_offload_on_a_cpu_device_warns_that_it_has_no_effect() -> None:
    results = run_on_ranks(fit_recording_warnings, 2)
    warned = results[0]["warnings"]  # a rank-zero warning
    assert any("cpu_offload=True) has no effect on a CPU device" in w for w in warned), warned
    assert not any(r["offloads"] for r in results)


def train_engine(rank: int, world_size: int, sharding: str, offload: bool, precision: str) -> dict:
    torch.manual_seed(0)
    model = TinyGPT()
    strategy = ShardingStrategy.parse(sharding)
    mixed = MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32") if precision == "bf16" else None
    compute = torch.device("cpu", 0)  # distinct from the shards' torch.device("cpu"): the offload path runs
    engine = shard_module(
        model, build_shard_mesh(strategy, None), strategy, resolve_wrap_policy({GPTBlock}), compute, mixed,
        cpu_offload=offload,
    )
    if offload:
        assert all(u.offloaded and u.materializes for u in engine.units)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(4):
        idx = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        logits = model(idx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), engine.mesh, compute, max_norm=0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    full = {p.fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params()}
    state = {
        f"{p.fqn}.exp_avg": engine.gather_full(p, optimizer.state[p.sharded]["exp_avg"])
        for p in engine.sharded_params()
        if p.requires_grad
    }
    return {"losses": losses, "norms": norms, "params": full, "state": state}


@pytest.mark.parametrize(
    ("sharding", "world_size", "precision"),
    [("FULL_SHARD", 2, "32"), ("FULL_SHARD", 2, "bf16"), ("NO_SHARD", 2, "32"), ("FULL_SHARD", 1, "32")],
)
def test_offload_data_path_on_cpu_trains_to_the_same_bits_as_resident_shards(
    sharding: str, world_size: int, precision: str
) -> None:
    """Values only: both runs keep every tensor in CPU memory (see the module docstring)."""
    offloaded = run_on_ranks(train_engine, world_size, sharding, True, precision)
    resident = run_on_ranks(train_engine, world_size, sharding, False, precision)
    for a, b in zip(offloaded, resident):
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        assert a["norms"] == b["norms"], (a["norms"], b["norms"])
        for key in ("params", "state"):
            for name in b[key]:
                torch.testing.assert_close(a[key][name], b[key][name], rtol=0, atol=0, msg=name)


def test_cpu_offload_from_lightning_cli_yaml(tmp_path: Path) -> None:
    cli = cli_with_strategy_args(tmp_path, {"auto_wrap_policy": ["GPTBlock"], "cpu_offload": True})
    assert isinstance(cli.trainer.strategy, ShardStrategy) and cli.trainer.strategy.cpu_offload
