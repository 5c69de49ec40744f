"""On a CUDA device: NCCL at world size 1 against plain single-device training, and CPU offload (skipped without
CUDA)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_shard import ShardStrategy
from tests.models import GPTBlock, LitModel, loader


def _fit(strategy: object, precision: str) -> list[float]:
    L.seed_everything(0)
    module = LitModel("gpt")
    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=10, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader("gpt"))
    if isinstance(strategy, ShardStrategy):
        assert strategy.process_group_backend == "nccl"
        assert all(u.flat_sharded.is_cuda != strategy.offloads for u in strategy.engine.units)
    return module.losses


@pytest.mark.cuda
def test_nccl_world_size_one_matches_single_device_fp32() -> None:
    ours = _fit(ShardStrategy(auto_wrap_policy={GPTBlock}), "32-true")
    reference = _fit("auto", "32-true")
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference))


@pytest.mark.cuda
def test_nccl_world_size_one_bf16_mixed_within_bf16_tolerance() -> None:
    ours = _fit(ShardStrategy(auto_wrap_policy={GPTBlock}), "bf16-mixed")
    reference = _fit("auto", "bf16-mixed")
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=1.6e-2, atol=2e-2)


@pytest.mark.cuda
def test_cpu_offload_keeps_model_state_in_cpu_memory_and_trains_as_without() -> None:
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, cpu_offload=True)
    offloaded = _fit(strategy, "32-true")
    assert strategy.offloads
    for unit in strategy.engine.units:
        assert unit.flat_sharded.device.type == "cpu" and unit.flat_sharded.is_pinned()
        assert unit.flat_unsharded.is_cuda
    optimizer = strategy.optimizers[0]
    for p in strategy.lightning_module.parameters():
        assert p.device.type == "cpu"
        assert all(t.device.type == "cpu" for t in optimizer.state[p].values() if isinstance(t, torch.Tensor))
    resident = _fit(ShardStrategy(auto_wrap_policy={GPTBlock}), "32-true")
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(resident))
