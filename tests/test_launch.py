"""Process-level behaviour under Lightning's own launcher: a failing rank ends the job, teardown cleans up."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.jobs import job_env, param, start_jobs

pytestmark = pytest.mark.launch  # every test here starts whole jobs

SCRIPT = Path(__file__).parent / "scripts" / "launch_fit.py"


def _launch(raise_on_rank: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", "2", "--raise-on-rank", str(raise_on_rank)], env=job_env(),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.fixture(scope="module")
def jobs(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor
) -> dict[int, Future[subprocess.CompletedProcess]]:
    """Each test's job by the rank that raises in it (-1: none), all started with the first test."""
    return start_jobs(request, background, lambda item: param(item, "failing_rank", -1), _launch)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_that_raises_ends_the_job_with_its_error(jobs: dict, failing_rank: int) -> None:
    # A hang would exceed the subprocess timeout and fail this test.
    done = jobs[failing_rank].result()
    assert done.returncode != 0
    assert f"boom on rank {failing_rank}" in done.stderr
    assert "finished" not in done.stdout


def test_the_process_group_outlives_fit_and_the_program_exits_cleanly(jobs: dict) -> None:
    done = jobs[-1].result()
    report = f"exit {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report  # the group is destroyed at exit, without an abort
    for rank in (0, 1):
        assert f"rank {rank} finished; process group initialized after fit: True; all_reduce after fit: 2" in (
            done.stdout
        ), report
