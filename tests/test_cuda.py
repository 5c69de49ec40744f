"""On a CUDA device (skipped without one): NCCL at world size 1 against plain single-device training in every
precision, where CPU offload puts each tensor, meta-device initialisation, checkpoints saved from CUDA tensors and
resumed on the GPU and on CPU ranks (and the reverse), two ranks sharing the GPU against DDP, the stall diagnosis on
NCCL, and the GPU example. tests/test_offload.py checks the offload path's values on CPU; docs/testing.md has the last
run's summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_shard import ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.cuda_fits import fit_16_mixed, fit_saving, fit_saving_on_cpu_ranks, fit_sharing_the_gpu, gpu_trainer
from tests.jobs import job_env
from tests.lightning_fits import MetaGPT
from tests.models import GPTBlock, LitModel, loader

ROOT = Path(__file__).resolve().parents[1]


def _fit(strategy: object, precision: str, **trainer_kwargs: Any) -> list[float]:
    L.seed_everything(0)
    module = LitModel("gpt")
    _train(module, strategy, precision, **trainer_kwargs)
    return module.losses


def _train(module: LitModel, strategy: object, precision: str, **trainer_kwargs: Any) -> None:
    gpu_trainer(strategy, precision, **trainer_kwargs).fit(module, train_dataloaders=loader("gpt"))
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


@pytest.mark.cuda
def test_nccl_world_size_one_bf16_true_within_bf16_tolerance() -> None:
    ours = _fit(ShardStrategy(auto_wrap_policy={GPTBlock}), "bf16-true")
    reference = _fit("auto", "bf16-true")
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=1.6e-2, atol=2e-2)


@pytest.mark.cuda
def test_nccl_world_size_one_16_mixed_scales_the_loss_as_single_device_training_does() -> None:
    """fp16 on the device with a loss scaler: the same scale at every step as Lightning's own 16-mixed (growth after
    3 clean steps; the step whose gradients overflow skipped on both sides, the weights left as they were, the scale
    halved), and losses within fp16 rounding. Our compute weights are fp16 (as FSDP's param_dtype), the reference
    autocasts fp32 weights: only the rounding differs."""
    ours = fit_16_mixed(sharded=True, overflow_at=4)
    reference = fit_16_mixed(sharded=False, overflow_at=4)
    assert ours["scales"] == reference["scales"] == [1024.0] * 3 + [2048.0] * 2 + [1024.0] * 3 + [2048.0] * 2
    for run in (ours, reference):
        torch.testing.assert_close(run["weights"][4], run["weights"][3], rtol=0, atol=0)  # the overflow: no step
        assert not torch.equal(run["weights"][5], run["weights"][4])
    finite = [i for i in range(10) if i != 4]
    torch.testing.assert_close(
        torch.tensor(ours["losses"])[finite], torch.tensor(reference["losses"])[finite], rtol=1e-2, atol=1e-2
    )


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


@pytest.mark.cuda
def test_meta_device_init_on_the_gpu_then_training_matches_single_device_training_from_the_same_weights() -> None:
    L.seed_everything(0)
    module = MetaGPT()
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock})
    gpu_trainer(strategy).fit(module, train_dataloaders=loader("gpt"))
    assert module.built_on_meta
    assert all(u.flat_sharded.is_cuda for u in strategy.engine.units)
    initial = {name: t.cpu() for name, t in module.initial.items()}
    assert all(t.isfinite().all() for t in initial.values())
    assert initial["model.blocks.0.ln1.weight"].eq(1).all()  # reset_parameters ran (LayerNorm: ones)
    assert initial["model.blocks.0.fc.weight"].std() > 0
    L.seed_everything(0)
    reference = LitModel("gpt")
    reference.load_state_dict(initial)
    gpu_trainer("auto").fit(reference, train_dataloaders=loader("gpt"))
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(reference.losses))


@pytest.mark.cuda
def test_a_checkpoint_saved_from_cuda_tensors_resumes_on_the_gpu_as_the_uninterrupted_fit(tmp_path: Path) -> None:
    whole = fit_saving(str(tmp_path / "whole"), 2, None, 1, "gpu")
    first = fit_saving(str(tmp_path / "run"), 1, None, 1, "gpu")
    resumed = fit_saving(str(tmp_path / "run"), 2, str(tmp_path / "run" / "last.ckpt"), 1, "gpu")
    assert resumed["devices"] == {"cuda"}
    _assert_state_equal(resumed["start"], first["end"])
    torch.testing.assert_close(torch.tensor(first["losses"] + resumed["losses"]), torch.tensor(whole["losses"]))
    _assert_state_equal(resumed["end"], whole["end"])


@pytest.mark.cuda
def test_a_gpu_checkpoint_resumes_on_two_cpu_ranks_and_a_cpu_checkpoint_on_the_gpu(tmp_path: Path) -> None:
    on_gpu = fit_saving(str(tmp_path / "gpu"), 1, None, 1, "gpu")
    on_cpu = run_on_ranks(fit_saving_on_cpu_ranks, 2, str(tmp_path / "gpu"), 2, str(tmp_path / "gpu" / "last.ckpt"))
    for rank in on_cpu:
        _assert_state_equal(rank["start"], on_gpu["end"])
    saved_on_cpu = run_on_ranks(fit_saving_on_cpu_ranks, 2, str(tmp_path / "cpu"), 1, None)
    back_on_gpu = fit_saving(str(tmp_path / "cpu"), 2, str(tmp_path / "cpu" / "last.ckpt"), 1, "gpu")
    assert back_on_gpu["devices"] == {"cuda"}
    _assert_state_equal(back_on_gpu["start"], saved_on_cpu[0]["end"])


def _assert_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for part in ("params", "optimizer"):
        assert actual[part].keys() == expected[part].keys()
        for name, value in expected[part].items():
            torch.testing.assert_close(actual[part][name], value, msg=name)


@pytest.mark.cuda
def test_two_ranks_sharing_the_gpu_match_ddp() -> None:
    """Two processes on the one GPU (gloo on CUDA tensors): the engine's device code meets a real peer."""
    ours = run_on_ranks(fit_sharing_the_gpu, 2, True)
    ddp = run_on_ranks(fit_sharing_the_gpu, 2, False)
    for rank, (a, b) in enumerate(zip(ours, ddp)):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), msg=f"rank {rank}")
        for name, value in b["params"].items():
            torch.testing.assert_close(a["params"][name], value, msg=f"rank {rank}: {name}")


@pytest.mark.cuda
@pytest.mark.launch
def test_a_stalled_nccl_collective_is_named_with_blocking_waits() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "nccl_stall_fit.py"), "--timeout", "3"],
        env=job_env(TORCH_NCCL_BLOCKING_WAIT="1"), capture_output=True, text=True, timeout=300,
    )
    report = f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert done.returncode != 0, report
    assert "all-reduce issued behind the busy GPU" in done.stdout, report
    assert "all-reduce completed" not in done.stdout and "finished" not in done.stdout, report
    errors = [line for line in done.stderr.splitlines() if "StalledRanksError: " in line]
    assert errors, report
    assert "Rank 0 waited for the all-reduce" in errors[0], errors[0]
    assert "within the timeout of 3 s" in errors[0], errors[0]


@pytest.mark.cuda
@pytest.mark.launch
@pytest.mark.parametrize("flags", [[], ["--precision", "bf16-mixed", "--cpu-offload"]])
def test_the_gpu_example_trains_and_samples(flags: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--accelerator", "gpu", "--devices", "1", "--max-steps", "5",
         "--sample-chars", "20", *flags],
        cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "rank 0: final loss" in done.stdout, done.stdout[-2000:]
