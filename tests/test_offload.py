"""CPU offload: the registry name, the no-op (with a warning) on CPU devices, and the offload data path.

The offload data path (shards in CPU memory, uploads before each gather, gradients downloaded after each
reduction, collectives and full-tensor gathers on the compute device) is exercised here with the compute
device ``cpu:0``, which the engine treats as distinct from the shards' ``cpu``: every staging copy the GPU
path makes is made, between two CPU buffers, and training must match resident shards exactly. Where tensors
end up cannot be told apart on CPU (both are ``cpu``); tests/test_cuda.py checks that on a GPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from lightning_shard import MixedPrecision, ShardingStrategy, ShardStrategy
from lightning_shard.clipping import clip_grad_norm_
from lightning_shard.engine import shard_module
from lightning_shard.mesh import build_shard_mesh
from lightning_shard.policies import resolve_wrap_policy
from lightning_shard.testing import run_on_ranks
from tests.fits import cli_with_strategy_args, fit_shard
from tests.models import GPTBlock, TinyGPT


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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit_shard(rank, world_size, "gpt", 4, cpu_offload=True)
    result["warnings"] = [str(w.message) for w in caught]
    return result


def test_cpu_offload_on_cpu_warns_and_trains_as_without() -> None:
    offloaded = run_on_ranks(fit_recording_warnings, 2)
    resident = run_on_ranks(fit_shard, 2, "gpt", 4)
    assert any("cpu_offload=True) has no effect on a CPU device" in w for w in offloaded[0]["warnings"])
    for a, b in zip(offloaded, resident):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]))
        for name in b["params"]:
            torch.testing.assert_close(a["params"][name], b["params"][name], msg=name)


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
def test_offloaded_shards_train_exactly_as_resident_ones(sharding: str, world_size: int, precision: str) -> None:
    offloaded = run_on_ranks(train_engine, world_size, sharding, True, precision)
    resident = run_on_ranks(train_engine, world_size, sharding, False, precision)
    for a, b in zip(offloaded, resident):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        for key in ("params", "state"):
            for name in b[key]:
                torch.testing.assert_close(a[key][name], b[key][name], rtol=0, atol=0, msg=name)


def test_cpu_offload_from_lightning_cli_yaml(tmp_path: Path) -> None:
    cli = cli_with_strategy_args(tmp_path, {"auto_wrap_policy": ["GPTBlock"], "cpu_offload": True})
    assert isinstance(cli.trainer.strategy, ShardStrategy) and cli.trainer.strategy.cpu_offload
