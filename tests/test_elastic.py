"""Elastic restarts under torchrun: a 4-rank job over two simulated nodes (two torchrun agents on 127.0.0.1, 2
processes each) loses one node; torchrun restarts it on the 2 ranks left, which resume from the newest complete
checkpoint and finish with the losses of a run that was never interrupted (same global batch; run on the pooled
ranks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_shard.testing import run_on_ranks
from tests.jobs import free_port, job_env
from tests.scripts.elastic_fit import uninterrupted

SCRIPT = Path(__file__).parent / "scripts" / "elastic_fit.py"
MAX_STEPS = 12
# Fast failure detection for the test; see docs/operations.md for production values.
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2"

pytestmark = pytest.mark.launch


def _env() -> dict[str, str]:
    return job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # see "Elastic restarts" in docs/operations.md




def _agent(root: Path, port: int, hosts_store: bool, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-id", "elastic-test",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1",
        "--rdzv-conf", f"is_host={int(hosts_store)},{RDZV_CONF}", str(SCRIPT), "--root", str(root), *extra,
    ]  # fmt: skip
    log = root.parent / f"agent-{'survivor' if hosts_store else 'lost'}.log"
    return subprocess.Popen(command, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def _records(root: Path) -> list[dict]:
    path = root / "losses.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]  # a node lost mid-write leaves a partial line


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))


def _take_node_down(agent: subprocess.Popen, root: Path) -> None:
    """What losing a machine looks like to the survivors: its agent and its workers vanish at once."""
    workers = [int(p.read_text()) for p in root.glob(f"worker-{agent.pid}-*")]
    for pid in [agent.pid, *workers]:
        os.kill(pid, signal.SIGKILL)
    agent.wait()


def test_a_job_that_loses_a_node_restarts_on_the_ranks_left_with_the_losses_of_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    reference_root, root = tmp_path / "reference", tmp_path / "elastic"
    port = free_port()
    survivor = _agent(root, port, True, "--step-sleep", "0.3")
    lost = _agent(root, port, False, "--step-sleep", "0.3")
    try:
        deadline = time.monotonic() + 240
        while not any(r["step"] >= 3 for r in _records(root)):  # a checkpoint (every 2 steps) exists, and more steps
            assert lost.poll() is None and survivor.poll() is None, _logs(tmp_path)
            assert time.monotonic() < deadline, "the job did not reach step 3"
            time.sleep(0.05)
        lost_workers = len(list(root.glob(f"worker-{lost.pid}-*")))
        _take_node_down(lost, root)
        assert survivor.wait(timeout=240) == 0, _logs(tmp_path)
    finally:
        for agent in (survivor, lost):
            agent.kill()  # after a failure: no agent outlives the test
    assert lost_workers == 2
    run_on_ranks(uninterrupted, 2, str(reference_root), MAX_STEPS)  # the same fit, never interrupted, on 2 ranks

    records = _records(root)
    first, restarted = [r for r in records if r["restart"] == 0], [r for r in records if r["restart"] == 1]
    assert {r["world_size"] for r in first} == {4} and {r["world_size"] for r in restarted} == {2}, records
    resumed_at = restarted[0]["step"]
    assert resumed_at > 0 and resumed_at % 2 == 0, records  # from a saved step (every 2), not from scratch
    assert [r["step"] for r in restarted] == list(range(resumed_at, MAX_STEPS))  # exactly the remaining steps
    final = {r["step"]: r["loss"] for r in records}  # a step redone after the restart replaces the lost one
    expected = {r["step"]: r["loss"] for r in _records(reference_root)}
    assert sorted(final) == sorted(expected) == list(range(MAX_STEPS))
    torch.testing.assert_close(torch.tensor([final[s] for s in range(MAX_STEPS)]),
                               torch.tensor([expected[s] for s in range(MAX_STEPS)]))  # fmt: skip
