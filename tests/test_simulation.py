"""One rank of a large world, simulated in this process (``lightning_shard.testing.simulate_rank``): what a rank holds
and how much Python work its step does at 1024 ranks, against closed forms and against smaller worlds."""

from __future__ import annotations

import unittest.mock
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shard import estimate_memory
from lightning_shard.engine import collectives, shard_model
from lightning_shard.engine.memory import memory_report
from lightning_shard.engine.sharded_module import ShardedModule
from lightning_shard.testing import count_python_calls, simulate_rank
from tests.models import GPTBlock, TinyGPT


class Wide(nn.Module):
    """Three Linear units whose rows all divide by 1024: no padding at 1024 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 1024), nn.Linear(1024, 2048), nn.Linear(2048, 1024)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Callable[[], Tensor], steps: int) -> None:
    for _ in range(steps):
        model(batch()).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _tokens() -> Tensor:
    return torch.randint(0, 37, (2, 8))


# Model state #


def test_a_rank_of_1024_holds_16_bytes_a_parameter_over_the_world_with_adam() -> None:
    """fp32 Adam: parameters, gradients and two moments, each 4 bytes a parameter, sharded over 1024 ranks. Beside
    them, each parameter has one "was used" flag with its gradient memory and one step count in Adam's state."""
    with simulate_rank(1024, 0):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Wide()
        engine = shard_model(model, auto_wrap_policy={nn.Linear}, device="cpu")
        optimizer = torch.optim.Adam(model.parameters())
        _train(model, optimizer, lambda: torch.randn(2, 4), steps=2)  # ends with zero_grad(): .grad is None
        report = memory_report(engine, [optimizer], rank=0).sharded
    psi = sum(p.numel for p in engine.sharded_params())
    count = len(list(engine.sharded_params()))
    assert report.gradients == 4 * psi // 1024 + 4 * count  # the kept gradient memory counts after zero_grad()
    assert report.total == 16 * psi // 1024 + 8 * count


def test_the_estimate_is_what_a_simulated_rank_of_1024_holds() -> None:
    """Padding, tied and frozen parameters at 1024 ranks, where every row count is below the world size."""
    with torch.device("meta"):
        estimate = estimate_memory(TinyGPT(), 1024, auto_wrap_policy={GPTBlock})
    with simulate_rank(1024, 0):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = TinyGPT()
        engine = shard_model(model, auto_wrap_policy={GPTBlock}, device="cpu")
        optimizer = torch.optim.AdamW(model.parameters())
        _train(model, optimizer, _tokens, steps=1)
        report = memory_report(engine, [optimizer], rank=0).sharded
    assert (report.parameters, report.gradients, report.optimizer_state) == (
        estimate.parameters, estimate.gradients, estimate.optimizer_state
    )


# Python work per step #


def _python_calls_of_a_step(world_size: int, backend: str) -> int:
    with simulate_rank(world_size, 0, backend=backend):  # type: ignore[arg-type]
        torch.manual_seed(0)
        with torch.device("meta"):
            model = TinyGPT()
        shard_model(model, auto_wrap_policy={GPTBlock}, device="cpu")
        optimizer = torch.optim.AdamW(model.parameters())
        _train(model, optimizer, _tokens, steps=2)  # the first step records the prefetch order
        return count_python_calls(lambda: _train(model, optimizer, _tokens, steps=1))


def test_a_steps_python_work_does_not_grow_with_the_world_on_gloos_paths() -> None:
    """Above ``POINT_TO_POINT_MAX_RANKS`` (8) gloo's collectives are one call each, whatever the world size; the
    point-to-point exchanges up to it do at most what they do at 8 ranks."""
    at_8, at_16, at_1024 = (_python_calls_of_a_step(w, "gloo") for w in (8, 16, 1024))
    assert at_1024 == at_16 <= at_8


def test_a_steps_python_work_does_not_grow_with_the_world_on_the_flat_path() -> None:
    assert _python_calls_of_a_step(8, "nccl") == _python_calls_of_a_step(1024, "nccl")


def test_gloo_takes_the_all_to_all_path_above_the_threshold() -> None:
    with simulate_rank(1024, 5):
        assert dist.get_world_size() == 1024 and dist.get_rank() == 5
        torch.manual_seed(0)
        with torch.device("meta"):
            model = TinyGPT()
        engine = shard_model(model, auto_wrap_policy={GPTBlock}, device="cpu")
        calls: list[str] = []
        with unittest.mock.patch.object(
            collectives, "reduce_scatter_all_to_all", _recording(calls, collectives.reduce_scatter_all_to_all)
        ):
            model(_tokens()).sum().backward()
    assert calls == ["reduce_scatter_all_to_all"] * len(engine.units)


def _recording(calls: list[str], fn: Callable[..., collectives.Pending]) -> Callable[..., collectives.Pending]:
    def wrapper(*args: object, **kwargs: object) -> collectives.Pending:
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    return wrapper


# Set-up #


def test_setting_up_1024_ranks_broadcasts_no_parameter() -> None:
    """Ranks whose initial values agree (here: one simulated rank) check them with one all-reduce of checksums
    per unit and broadcast nothing (see [Note: initial values agree with rank 0])."""
    broadcasts: list[str] = []
    agreements: list[str] = []
    with simulate_rank(1024, 0), unittest.mock.patch.multiple(
        collectives,
        broadcast_from_rank0=_recording(broadcasts, collectives.broadcast_from_rank0),  # type: ignore[arg-type]
        all_reduce_max=_recording(agreements, collectives.all_reduce_max),  # type: ignore[arg-type]
    ):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = TinyGPT()
        engine: ShardedModule = shard_model(model, auto_wrap_policy={GPTBlock}, device="cpu")
    assert broadcasts == [] and len(agreements) == len(engine.units)


# The simulation itself #


def test_object_collectives_act_as_if_every_rank_passed_this_ranks_objects() -> None:
    with simulate_rank(8, 3):
        box = [{"step": 7}]
        dist.broadcast_object_list(box, src=0)
        assert box == [{"step": 7}]
        gathered: list[object] = [None] * 8
        dist.all_gather_object(gathered, {"rank": 3})
        assert gathered == [{"rank": 3}] * 8
        with pytest.raises(RuntimeError, match="scatter_object_list.*simulated rank 3.*rank 0"):
            dist.scatter_object_list([None], None, src=0)
    assert not dist.is_initialized()
    assert dist.broadcast_object_list.__module__ == "torch.distributed.distributed_c10d"  # the real one is back


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "positive int"),
        ({"world_size": 4, "rank": 4}, r"rank=.*\[0, 4\)"),
        ({"world_size": 4, "backend": "mpi"}, "backend=.*'gloo', 'nccl'"),
    ],
)
def test_simulate_rank_refuses_what_it_cannot_simulate(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match), simulate_rank(**kwargs):
        pass
    assert not dist.is_initialized()


def test_simulate_rank_refuses_to_replace_an_existing_process_group() -> None:
    with simulate_rank(4, 0):
        with pytest.raises(RuntimeError, match="already exists"), simulate_rank(4, 1):
            pass
        assert dist.get_rank() == 0  # the outer simulation is untouched
