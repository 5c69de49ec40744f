"""A rank that stops answering is named: the others raise StalledRanksError within the timeout, saying what they
waited for and which rank had not arrived, instead of hanging (or failing with the backend's bare timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import unittest.mock
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_shard.engine.progress import Activity, PeerRecord
from lightning_shard.engine.stall import StalledRanksError, _diagnosis, is_timeout
from tests.jobs import job_env

SCRIPT = Path(__file__).parent / "scripts" / "stall_fit.py"
TIMEOUT_S = "4"  # the strategy's timeout in these runs: short, so that the tests stay fast


class _Run:
    """The script launched the way users launch it, its output in files (a suspended rank keeps pipes open)."""

    def __init__(self, tmp_path: Path, front: str, stop_rank: int) -> None:
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), "--front", front, "--stop-rank", str(stop_rank), "--timeout", TIMEOUT_S],
                env=job_env(),
                stdout=out,
                stderr=err,
            )

    def stall_error(self, within_s: float = 180) -> str:
        """The first StalledRanksError line any rank wrote ("" if none within ``within_s``)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            found = [line for line in self.err.read_text().splitlines() if "StalledRanksError: " in line]
            if found or self.proc.poll() is not None:
                return found[0] if found else ""
            time.sleep(0.5)
        return ""

    def end(self) -> None:
        """Kill whatever is left: the launching process, the suspended rank."""
        for pid in [self.proc.pid, *_pids(self.out.read_text()).values()]:
            try:
                os.kill(pid, signal.SIGKILL)  # a SIGSTOPped process still takes SIGKILL
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def report(self) -> str:
        return f"stdout:\n{self.out.read_text()[-2000:]}\nstderr:\n{self.err.read_text()[-6000:]}"


def _pids(stdout: str) -> dict[int, int]:
    """``{rank: pid}`` from the script's "rank R pid P" lines."""
    found = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) == 4 and words[0] == "rank" and words[2] == "pid":
            found[int(words[1])] = int(words[3])
    return found


@pytest.mark.launch
@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_the_rank_left_waiting_names_the_rank_that_stopped(tmp_path: Path, front: str) -> None:
    # Rank 1 (the launcher's child) suspends itself between its forward and its backward; rank 0 must give up in
    # backward and exit non-zero. A hang would exceed the waits below and fail the test.
    run = _Run(tmp_path, front, stop_rank=1)
    try:
        error = run.stall_error()
        returncode = run.proc.wait(timeout=60)
    finally:
        run.end()
    assert returncode != 0, run.report()
    assert "StalledRanksError: Rank 0 waited for the" in error, run.report()
    assert "Ranks that had not arrived: 1." in error, error
    assert " in backward" in error and "of unit " in error, error
    assert f"within the timeout of {TIMEOUT_S} s" in error, error
    assert "finished" not in run.out.read_text()


@pytest.mark.launch
def test_a_stopped_rank_0_is_named_although_the_store_it_serves_stops_with_it(tmp_path: Path) -> None:
    run = _Run(tmp_path, "trainer", stop_rank=0)  # rank 0 is the launching process: the test ends it
    try:
        error = run.stall_error()
    finally:
        run.end()
    assert "StalledRanksError: Rank 1 waited for the" in error, run.report()
    assert "the progress of rank 0 is unknown" in error, error
    assert "likely the rank that stopped" in error, error


# The diagnosis from the ranks' records, without processes #

WAITED = Activity(index=10, op="all-gather", unit="blocks.3", in_backward=True, step=1520)


def test_the_description_names_operation_unit_phase_and_step() -> None:
    assert WAITED.describe() == "all-gather of unit blocks.3 in backward, step 1520"
    assert Activity(3, "barrier", None, False, None).describe() == "barrier"
    assert Activity(4, "all-gather", "", False, None).describe() == "all-gather of unit <root> in forward"


def test_ranks_behind_the_collective_are_named_and_ranks_at_it_are_not() -> None:
    now = time.time()
    records = {
        0: PeerRecord(0, 10, WAITED.describe(), now),
        1: PeerRecord(1, 7, "reduce-scatter of unit blocks.0 in backward, step 1519", now - 2),
        2: PeerRecord(2, 11, "all-gather of unit blocks.2 in backward, step 1520", now),
    }
    error = _diagnosis(WAITED, 0, 4, timedelta(seconds=30), records, True, RuntimeError("Timed out waiting"))
    assert isinstance(error, StalledRanksError)
    assert error.missing_ranks == [1]
    text = str(error)
    assert "Rank 0 waited for the all-gather of unit blocks.3 in backward, step 1520 (collective #10)" in text
    assert "within the timeout of 30 s" in text
    assert "Ranks that had not arrived: 1." in text
    assert "Rank 1's last collective: #7, the reduce-scatter of unit blocks.0 in backward, step 1519" in text
    assert "No progress published by rank 3." in text
    assert "Arrived and waiting too: rank 2." in text


def test_an_unanswering_store_points_at_rank_0() -> None:
    error = _diagnosis(WAITED, 1, 2, timedelta(seconds=30), {}, False, RuntimeError("Timed out waiting"))
    assert error.missing_ranks == [0]
    assert "the progress of rank 0 is unknown" in str(error)


def test_only_backend_timeouts_become_stall_errors() -> None:
    assert is_timeout(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv"))
    assert not is_timeout(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not is_timeout(ValueError("timed out"))


def test_stopping_publication_waits_for_the_thread_to_leave_the_store() -> None:
    # A daemon thread still inside a store call when the interpreter finalises aborts the process ("terminate called
    # without an active exception"), so stopping must wait for it: before the group is destroyed and at exit.
    import threading
    import time

    from lightning_shard.engine import progress

    class SlowStore:
        def __init__(self) -> None:
            self.calls = 0

        def set(self, key: str, value: str) -> None:
            self.calls += 1
            time.sleep(0.3)

    store = SlowStore()
    progress.start_publishing(store, 0, 2, None)
    progress.RECORD.enter("all-gather")  # something new to publish
    deadline = time.monotonic() + 5
    while store.calls < 2 and time.monotonic() < deadline:  # the thread is now inside set()
        time.sleep(0.01)
    progress.stop_publishing()
    running = [t for t in threading.enumerate() if t.name == "lightning_shard-progress"]
    assert store.calls >= 2 and not running, (store.calls, running)


class _RecordingWork:
    def __init__(self) -> None:
        self.waited_with: list[tuple] = []

    def wait(self, *timeout: timedelta) -> bool:
        self.waited_with.append(timeout)
        return True


def test_every_wait_of_the_engines_collectives_passes_the_strategys_timeout() -> None:
    """NCCL's works keep the timeout their group was created with (at least the rendezvous's 10 minutes): a
    strategy's shorter timeout bounds a wait only when passed to it (docs/testing.md, "On a GPU")."""
    import torch.distributed as dist

    from lightning_shard.engine import collectives

    timeout = timedelta(seconds=7)
    works = [_RecordingWork() for _ in range(3)]
    with unittest.mock.patch.object(collectives, "wait_timeout", return_value=timeout), \
            unittest.mock.patch.object(dist, "all_reduce", side_effect=works[1:]):
        collectives.Pending(works[0], lambda: None).wait()
        collectives.all_reduce_sum(torch.ones(1), None)  # type: ignore[arg-type]
        collectives.all_reduce_max(torch.ones(1), None)
    assert [w.waited_with for w in works] == [[(timeout,)]] * 3
