"""On a CUDA device: NCCL at world size 1 against plain single-device training, and where CPU offload puts each tensor
(skipped without CUDA; tests/test_offload.py checks the offload path's values on CPU)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_shard import ShardStrategy
from tests.models import GPTBlock, LitModel, loader


def _fit(strategy: object, precision: str, **trainer_kwargs: Any) -> list[float]:
    L.seed_everything(0)
    module = LitModel("gpt")
    _train(module, strategy, precision, **trainer_kwargs)
    return module.losses


def _train(module: LitModel, strategy: object, precision: str, **trainer_kwargs: Any) -> None:
    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=10, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )
    trainer.fit(module, train_dataloaders=loader("gpt"))
    if isinstance(strategy, ShardStrategy):
        assert strategy.process_group_backend == "nccl"
        assert all(u.flat_sharded.is_cuda != strategy.offloads for u in strategy.engine.units)


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


class PlacementProbe(LitModel):
    """Records, while training, where each kind of tensor is: the weights that the blocks and the final norm compute
    with (in their forward), and the shards, their gradients and the optimizer state (just before each optimizer
    step)."""

    def __init__(self) -> None:
        super().__init__("gpt")
        self.computed_with: list[tuple[str, str]] = []  # (name, device type)
        self.shards: list[tuple[str, str, bool]] = []  # (name, device type, pinned)
        self.grads: list[tuple[str, str]] = []
        self.optimizer_state: list[tuple[str, str]] = []

    def on_train_start(self) -> None:
        # Registered after the strategy's own hooks, so they run once the module's weights are gathered.
        for module in (*self.model.blocks, self.model.ln_f):
            module.register_forward_pre_hook(self._record_weights)

    def _record_weights(self, module: nn.Module, args: tuple) -> None:
        self.computed_with += [(n, p.device.type) for n, p in module.named_parameters()]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = self.trainer.strategy
        assert isinstance(strategy, ShardStrategy)
        for p in strategy.engine.sharded_params():
            shard = p.sharded
            self.shards.append((p.fqn, shard.device.type, shard.is_pinned()))
            if shard.grad is not None:
                self.grads.append((p.fqn, shard.grad.device.type))
            for key, value in optimizer.state.get(shard, {}).items():
                if isinstance(value, Tensor):
                    self.optimizer_state.append((f"{p.fqn}.{key}", value.device.type))


@pytest.mark.cuda
def test_cpu_offload_keeps_shards_grads_and_optimizer_state_in_cpu_memory_and_computes_on_the_gpu() -> None:
    module = PlacementProbe()
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, cpu_offload=True)
    _train(module, strategy, "32-true")
    assert strategy.offloads
    # Shards: pinned CPU memory (each face is a view of its unit's pinned flat buffer), so uploads can be
    # asynchronous. Gradients and optimizer state: CPU tensors, where the optimizer steps (see [Note: CPU offload]).
    assert module.shards and all(device == "cpu" and pinned for _, device, pinned in module.shards), module.shards
    assert all(u.flat_sharded.device.type == "cpu" and u.flat_sharded.is_pinned() for u in strategy.engine.units)
    trainable = {p.fqn for p in strategy.engine.sharded_params() if p.requires_grad}
    assert {name for name, _ in module.grads} == trainable
    assert all(device == "cpu" for _, device in module.grads), module.grads
    assert module.optimizer_state and all(device == "cpu" for _, device in module.optimizer_state)
    # The gathered weights the modules compute with: on the GPU, in each unit's unsharded buffer.
    assert module.computed_with and all(device == "cuda" for _, device in module.computed_with), module.computed_with
    assert all(u.flat_unsharded.is_cuda for u in strategy.engine.units)


@pytest.mark.cuda
def test_cpu_offload_trains_as_resident_shards_with_norm_clipping() -> None:
    """The norm is computed from CPU gradients on the GPU and the clip applied back on the CPU."""
    offloaded = _fit(ShardStrategy(auto_wrap_policy={GPTBlock}, cpu_offload=True), "32-true", gradient_clip_val=0.05)
    resident = _fit(ShardStrategy(auto_wrap_policy={GPTBlock}), "32-true", gradient_clip_val=0.05)
    torch.testing.assert_close(torch.tensor(offloaded), torch.tensor(resident))
