"""The path gloo takes for shard groups above ``POINT_TO_POINT_MAX_RANKS`` (a flat all-gather with one copy, and the
reduction as one ``all_to_all`` whose received rows each rank sums in rank order): DDP's training, step for step.

Real groups that large do not fit a test machine, so the threshold is lowered to 1 inside the rank workers, which
makes 2, 3 and 4 gloo ranks take that path; ``tests/test_simulation.py`` checks that 1024 simulated ranks do.
"""

from __future__ import annotations

import unittest.mock
from typing import Any

import pytest
import torch

from lightning_shard.engine import collectives
from lightning_shard.testing import run_on_ranks
from tests.fits import fit_shard
from tests.test_parity import assert_same_training, ddp_reference


def fit_on_all_to_all_path(rank: int, world_size: int, kind: str, **strategy_kwargs: Any) -> dict:
    """``fit_shard`` with every shard group above the point-to-point threshold; also counts the reductions."""
    calls = {"reduce_scatter_all_to_all": 0, "reduce_scatter_exchange": 0}
    original = collectives.reduce_scatter_all_to_all

    def counted(*args: Any, **kwargs: Any) -> collectives.Pending:
        calls["reduce_scatter_all_to_all"] += 1
        return original(*args, **kwargs)

    def exchange(*args: Any, **kwargs: Any) -> collectives.Pending:
        calls["reduce_scatter_exchange"] += 1
        raise AssertionError("the point-to-point exchange ran above the threshold")

    with unittest.mock.patch.multiple(
        collectives, POINT_TO_POINT_MAX_RANKS=1, reduce_scatter_all_to_all=counted, reduce_scatter_exchange=exchange
    ):
        result = fit_shard(rank, world_size, kind, **strategy_kwargs)
    return result | {"calls": calls}


@pytest.mark.parametrize(
    ("kind", "world_size", "sharding", "mesh"),
    [
        ("gpt", 2, "FULL_SHARD", None),
        ("uneven", 3, "FULL_SHARD", None),  # no parameter's rows divide by 3: padding in every chunk
        ("gpt", 4, "FULL_SHARD", None),
        ("gpt", 4, "HYBRID_SHARD", (2, 2)),
    ],
)
def test_the_large_group_gloo_path_matches_ddp(kind: str, world_size: int, sharding: str, mesh: Any) -> None:
    kwargs = {"sharding_strategy": sharding} | ({"device_mesh": mesh} if mesh else {})
    ours = run_on_ranks(fit_on_all_to_all_path, world_size, kind, **kwargs)
    for result in ours:
        assert result["calls"]["reduce_scatter_all_to_all"] > 0 and result["calls"]["reduce_scatter_exchange"] == 0
    assert_same_training(ours, ddp_reference(kind, world_size))


def test_the_path_follows_the_backend_the_device_and_the_group_size() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    limit = collectives.POINT_TO_POINT_MAX_RANKS
    assert collectives.collective_path("gloo", cpu, 2) is collectives.CollectivePath.POINT_TO_POINT
    assert collectives.collective_path("gloo", cpu, limit) is collectives.CollectivePath.POINT_TO_POINT
    assert collectives.collective_path("gloo", cpu, limit + 1) is collectives.CollectivePath.ALL_TO_ALL
    assert collectives.collective_path("gloo", cuda, 2) is collectives.CollectivePath.FLAT
    assert collectives.collective_path("nccl", cuda, 1024) is collectives.CollectivePath.FLAT
