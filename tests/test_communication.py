"""The communication pattern of each sharding strategy during one training step, counted where the engine issues
every collective (``lightning_shard.engine.collectives``), against closed-form expectations from the parameter shapes.

The model is a chain of ``nn.Linear`` units whose row counts do not divide by the shard size, so padding shows; the
root holds no parameters. The step counted is the second one: the first records the forward order that the
second prefetches along. Both ways the engine can communicate are counted: the point-to-point exchanges it uses on
gloo with CPU tensors, and the flat collectives it uses on NCCL (run here on gloo).
"""

from __future__ import annotations

import functools
import math
import unittest.mock
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shard.engine import collectives
from lightning_shard.engine.mesh import build_shard_mesh
from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.engine.sharded_module import ShardedModule, shard_module
from lightning_shard.engine.unit import UnitState
from lightning_shard.testing import run_on_ranks

SHAPES = [(3, 4), (4, 5), (5, 5), (5, 3)]  # (in, out) of each Linear: rows that divide by 2 and rows that do not
FLAG_BYTES = 4  # each rank's part of a gradient reduction ends with one fp32 "was used" flag per trainable parameter


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(i, o) for i, o in SHAPES])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


# (world size, strategy, device_mesh): every strategy, HYBRID_SHARD as 2 replicas of 2-rank shard groups.
CASES = {
    "FULL_SHARD": (2, "FULL_SHARD", None),
    "SHARD_GRAD_OP": (2, "SHARD_GRAD_OP", None),
    "NO_SHARD": (2, "NO_SHARD", None),
    "HYBRID_SHARD": (4, "HYBRID_SHARD", (2, 2)),
}
PATHS = ["point_to_point", "flat"]
GATHERS = {"point_to_point": "all_gather_pieces", "flat": "all_gather_flat"}
REDUCE_SCATTERS = {"point_to_point": "reduce_scatter_exchange", "flat": "reduce_scatter_sum"}
COUNTED = ["all_gather_pieces", "all_gather_flat", "reduce_scatter_exchange", "reduce_scatter_sum", "all_reduce_sum"]


@dataclass
class Call:
    """One collective the engine issued."""

    name: str
    phase: str  # "forward" or "backward"
    group: list[int]  # global ranks of the group it ran on
    nbytes: int  # all-gather: its output; reduce-scatter: its input; all-reduce: the tensor
    sent: int  # bytes this rank sent to peers (point-to-point calls only)
    gathered: list[str] = field(default_factory=list)  # units (with parameters) not SHARDED as it was issued


def _tensors_bytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _recorder(calls: list[Call], phase: list[str], engine: ShardedModule) -> Callable[[str], Callable[..., Any]]:
    def gathered_units() -> list[str]:
        return [u.name for u in engine.units if u.params and u.state is not UnitState.SHARDED]

    def record(name: str) -> Callable[..., Any]:
        original = getattr(collectives, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rank = dist.get_rank()
            match name:
                case "all_gather_flat":
                    output, _, group = args[:3]
                    nbytes, sent = _tensors_bytes([output]), 0
                case "all_gather_pieces":
                    outputs, inputs, group = args[:3]
                    nbytes, sent = _tensors_bytes(outputs), _tensors_bytes(inputs) * (group.size() - 1)
                case "reduce_scatter_sum":
                    full, group = args[:2]
                    nbytes, sent = _tensors_bytes([full]), 0
                case "reduce_scatter_exchange":
                    outgoing, _, group = args[:3]
                    nbytes = -1  # not a tensor argument: only what is sent is measured
                    sent = sum(_tensors_bytes(ts) for q, ts in enumerate(outgoing) if q != group.rank())
                case "all_reduce_sum":
                    tensor, group = args[:2]
                    nbytes, sent = _tensors_bytes([tensor]), 0
                case _:
                    raise AssertionError(name)
            ranks = dist.get_process_group_ranks(group)
            assert rank in ranks
            calls.append(Call(name, phase[0], ranks, nbytes, sent, gathered_units()))
            return original(*args, **kwargs)

        return wrapper

    return record


def one_step(rank: int, world_size: int, strategy: str, mesh: tuple[int, int] | None, path: str) -> dict:
    torch.manual_seed(0)
    model = Chain()
    parsed = ShardingStrategy.parse(strategy)
    engine = shard_module(model, build_shard_mesh(parsed, mesh), parsed, resolve_wrap_policy({nn.Linear}),
                          torch.device("cpu"))
    x = torch.randn(4, SHAPES[0][0], generator=torch.Generator().manual_seed(rank))
    calls: list[Call] = []
    phase = ["forward"]
    record = _recorder(calls, phase, engine)
    patches: dict[str, Any] = {name: record(name) for name in COUNTED}
    if path == "flat":
        patches["exchanges_point_to_point"] = lambda backend, device: False
    with unittest.mock.patch.multiple(collectives, **patches):
        model(x).square().mean().backward()  # records the forward order
        calls.clear()
        before = collectives.STATS.snapshot()
        out = model(x).square().mean()
        phase[0] = "backward"
        out.backward()
        after = collectives.STATS.snapshot()
    return {"calls": calls, "stats_gather": after.all_gather_bytes - before.all_gather_bytes,
            "stats_reduce": after.reduce_bytes - before.reduce_bytes}


@functools.cache
def step(case: str, path: str) -> list[dict]:
    """Every rank's record of the second step (one run per case and path, shared by the tests)."""
    world_size, strategy, mesh = CASES[case]
    return run_on_ranks(one_step, world_size, strategy, mesh, path)


def _count(calls: list[Call], name: str, phase: str | None = None) -> int:
    return sum(c.name == name and (phase is None or c.phase == phase) for c in calls)


# --------------------------------------------------------------------------------------------------
# What each strategy issues
# --------------------------------------------------------------------------------------------------

UNITS = len(SHAPES)


@pytest.mark.parametrize("path", PATHS)
def test_full_shard_gathers_every_unit_in_forward_and_all_but_the_last_again_in_backward(path: str) -> None:
    for record in step("FULL_SHARD", path):
        calls = record["calls"]
        assert _count(calls, GATHERS[path], "forward") == UNITS
        assert _count(calls, GATHERS[path], "backward") == UNITS - 1  # the last unit of forward stays gathered
        assert _count(calls, REDUCE_SCATTERS[path], "backward") == UNITS
        assert len(calls) == 3 * UNITS - 1, [c.name for c in calls]  # nothing else: no all-reduce, no other path


@pytest.mark.parametrize("path", PATHS)
def test_shard_grad_op_gathers_once_per_step_and_never_in_backward(path: str) -> None:
    for record in step("SHARD_GRAD_OP", path):
        calls = record["calls"]
        assert _count(calls, GATHERS[path], "forward") == UNITS
        assert _count(calls, GATHERS[path], "backward") == 0
        assert _count(calls, REDUCE_SCATTERS[path], "backward") == UNITS
        assert len(calls) == 2 * UNITS, [c.name for c in calls]


@pytest.mark.parametrize("path", PATHS)
def test_no_shard_never_gathers_and_all_reduces_each_units_gradients(path: str) -> None:
    for record in step("NO_SHARD", path):
        calls = record["calls"]
        assert _count(calls, "all_reduce_sum", "backward") == UNITS
        assert len(calls) == UNITS, [c.name for c in calls]  # no gathers, no reduce-scatters
        assert all(c.group == [0, 1] for c in calls)


@pytest.mark.parametrize("path", PATHS)
def test_hybrid_shard_reduce_scatters_in_the_shard_group_and_all_reduces_across_replicas(path: str) -> None:
    for rank, record in enumerate(step("HYBRID_SHARD", path)):
        calls = record["calls"]
        shard_group = [rank // 2 * 2, rank // 2 * 2 + 1]  # mesh (2, 2): rows {0, 1}, {2, 3}
        replica_group = [rank % 2, rank % 2 + 2]  # columns {0, 2}, {1, 3}
        assert _count(calls, GATHERS[path], "forward") == UNITS
        assert _count(calls, GATHERS[path], "backward") == UNITS - 1
        assert _count(calls, REDUCE_SCATTERS[path], "backward") == UNITS
        assert _count(calls, "all_reduce_sum", "backward") == UNITS
        assert len(calls) == 4 * UNITS - 1, [c.name for c in calls]
        for c in calls:
            assert c.group == (replica_group if c.name == "all_reduce_sum" else shard_group), (c.name, c.group)
        # a unit's all-reduce sums what its reduce-scatter gave: never more all-reduces than reduce-scatters so far
        reductions = [c.name for c in calls if c.name != GATHERS[path]]
        for i in range(len(reductions)):
            assert reductions[:i].count("all_reduce_sum") <= reductions[:i].count(REDUCE_SCATTERS[path]), reductions


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["FULL_SHARD", "HYBRID_SHARD"])
def test_at_most_two_units_are_gathered_or_gathering_at_any_gather(case: str, path: str) -> None:
    for record in step(case, path):
        gathers = [c for c in record["calls"] if c.name == GATHERS[path]]
        assert gathers
        for c in gathers:
            assert len(c.gathered) <= 2, (c.phase, c.gathered)
        assert any(len(c.gathered) == 2 for c in gathers)  # prefetching did happen


# --------------------------------------------------------------------------------------------------
# Bytes per step, from the shapes: ceil(rows / N) rows per rank, padding included
# --------------------------------------------------------------------------------------------------


def _padded_numel(shard_size: int) -> list[int]:
    """Each unit's elements in one rank's padded chunk: ceil(out / N) rows of the weight (each ``in`` wide) and of
    the bias."""
    return [math.ceil(o / shard_size) * (i + 1) for i, o in SHAPES]


def _shard_size(case: str) -> int:
    world_size, _, mesh = CASES[case]
    return 1 if case == "NO_SHARD" else mesh[1] if mesh is not None else world_size


def _gathers_per_unit(case: str) -> list[int]:
    """All-gathers of each unit in one step: forward, and backward for all but the last unit of forward under the
    strategies that reshard after forward; none without a shard group."""
    match case:
        case "NO_SHARD":
            return [0] * UNITS
        case "SHARD_GRAD_OP":
            return [1] * UNITS
    return [2] * (UNITS - 1) + [1]


def _expected_bytes(case: str) -> dict[str, int]:
    """One step's bytes per kind of collective, from the shapes alone (fp32): all-gather outputs and reduce-scatter
    inputs are N padded chunks; an all-reduce is one rank's reduced chunk."""
    n = _shard_size(case)
    chunks = [4 * s for s in _padded_numel(n)]
    reduced = [c + 2 * FLAG_BYTES for c in chunks]  # weight and bias flags
    return {
        "gather": n * sum(g * c for g, c in zip(_gathers_per_unit(case), chunks)),
        "reduce_scatter": n * sum(reduced) if n > 1 else 0,
        "all_reduce": sum(reduced) if case in ("NO_SHARD", "HYBRID_SHARD") else 0,
    }


@pytest.mark.parametrize("case", list(CASES))
def test_flat_collectives_move_the_padded_parameter_bytes(case: str) -> None:
    expected = _expected_bytes(case)
    for record in step(case, "flat"):
        calls = record["calls"]
        assert sum(c.nbytes for c in calls if c.name == "all_gather_flat") == expected["gather"]
        assert sum(c.nbytes for c in calls if c.name == "reduce_scatter_sum") == expected["reduce_scatter"]
        assert sum(c.nbytes for c in calls if c.name == "all_reduce_sum") == expected["all_reduce"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_collective_stats_count_the_padded_parameter_bytes(case: str, path: str) -> None:
    """What ``collectives.STATS`` (and so ``ShardMonitor``) reports is the same on both paths."""
    expected = _expected_bytes(case)
    for record in step(case, path):
        assert record["stats_gather"] == expected["gather"]
        assert record["stats_reduce"] == expected["reduce_scatter"] + expected["all_reduce"]


def _rows_held(rows: int, shard_rank: int, shard_size: int) -> int:
    per_rank = math.ceil(rows / shard_size)
    return max(0, min(per_rank, rows - shard_rank * per_rank))


@pytest.mark.parametrize("case", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"])
def test_point_to_point_exchanges_send_each_peer_only_its_own_rows(case: str) -> None:
    """Gathers send this rank's padded chunk to every peer; reductions send each peer the real rows it holds (no
    padding) and the flags."""
    n = _shard_size(case)  # 2: one peer
    chunks = [4 * s for s in _padded_numel(n)]
    for rank, record in enumerate(step(case, "point_to_point")):
        calls = record["calls"]
        peer = 1 - rank % 2
        sent_gather = (n - 1) * sum(g * c for g, c in zip(_gathers_per_unit(case), chunks))
        sent_reduce = sum(4 * _rows_held(o, peer, n) * (i + 1) + 2 * FLAG_BYTES for i, o in SHAPES)
        assert sum(c.sent for c in calls if c.name == "all_gather_pieces") == sent_gather
        assert sum(c.sent for c in calls if c.name == "reduce_scatter_exchange") == sent_reduce
