"""``run_on_ranks`` accounts for every rank: results in rank order, a raising rank's own traceback, a rank that
never reports named as such within the grace period, a worker that died named with its exit code, and fresh
workers for the next call."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_shard.testing import RankFailure, RankStatus, run_on_ranks


def rank_and_sum(rank: int, world_size: int, scale: int) -> tuple[int, int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank * scale, os.getpid(), t.item()


def raise_on_rank_0_and_block_rank_1_in_a_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        raise ValueError("rank 0 gives up before the all-reduce")
    dist.all_reduce(torch.ones(1))  # waits for rank 0, which never joins; gloo's own timeout is 30 minutes


def exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def sleep_on_every_rank(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_results_come_back_in_rank_order_from_the_same_workers() -> None:
    first = run_on_ranks(rank_and_sum, 2, 10)
    second = run_on_ranks(rank_and_sum, 2, scale=100)
    assert [(r, total) for r, _, total in first] == [(0, 1.0), (10, 1.0)]
    assert [(r, total) for r, _, total in second] == [(0, 1.0), (100, 1.0)]
    assert [pid for _, pid, _ in second] == [pid for _, pid, _ in first]  # the workers are kept between calls


def test_a_rank_blocked_after_its_peer_raised_is_named_as_not_reporting() -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(raise_on_rank_0_and_block_rank_1_in_a_collective, 2, grace=2.0)
    outcomes = failure.value.outcomes
    assert outcomes[0].status is RankStatus.RAISED
    assert outcomes[0].error == "ValueError: rank 0 gives up before the all-reduce"
    assert "raise_on_rank_0_and_block_rank_1_in_a_collective" in outcomes[0].traceback
    assert outcomes[1].status is RankStatus.DID_NOT_REPORT
    assert outcomes[1].error == "did not report within 2 s after rank 0 failed"
    assert "--- rank 1: did not report ---\ndid not report within 2 s after rank 0 failed" in str(failure.value)


def test_a_worker_that_exits_is_named_with_its_exit_code() -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(exit_on_rank_1, 2, grace=2.0)
    outcomes = failure.value.outcomes
    assert outcomes[0].status is RankStatus.RETURNED and outcomes[0].result == 0
    assert outcomes[1].status is RankStatus.DIED and outcomes[1].error == "died with exit code 3"
    assert failure.value.failed_ranks == [1]


def test_every_rank_still_running_at_the_timeout_is_named() -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(sleep_on_every_rank, 2, timeout=2.0)
    assert {r: o.error for r, o in failure.value.outcomes.items()} == {
        0: "did not report within 2 s", 1: "did not report within 2 s"
    }


def test_an_unpicklable_result_is_reported_by_its_rank() -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(return_a_lambda_on_rank_0, 2, grace=2.0)
    outcomes = failure.value.outcomes
    assert outcomes[0].status is RankStatus.RAISED and "pickle" in outcomes[0].error.lower()
    assert outcomes[1].status is RankStatus.RETURNED


def return_a_lambda_on_rank_0(rank: int, world_size: int) -> object:
    return (lambda: None) if rank == 0 else rank


def test_the_next_call_after_a_failure_runs_on_fresh_workers() -> None:
    with pytest.raises(RankFailure):
        run_on_ranks(exit_on_rank_1, 2, grace=2.0)
    assert [r for r, _, _ in run_on_ranks(rank_and_sum, 2, 1)] == [0, 1]
