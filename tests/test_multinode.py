"""Multi-node: ``Trainer(num_nodes=2, devices=2)`` under two torchrun agents on this machine (two simulated nodes)
matches DDP at fp32 defaults, for FULL_SHARD and for HYBRID_SHARD with its default mesh (shard inside a node,
replicate across nodes)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.jobs import free_port, job_env

SCRIPT = Path(__file__).parent / "scripts" / "multinode_fit.py"
STRATEGIES = ("ddp", "FULL_SHARD", "HYBRID_SHARD")


def _two_agents() -> dict[str, list[dict]]:
    """What every rank saved, by strategy. An early check (see [Note: early checks] in tests/jobs.py), which both
    tests read: nothing here needs the rest of the session."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        port = free_port()
        logs = [root / f"agent-{node}.log" for node in (0, 1)]
        agents = [
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                 "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT),
                 "--root", str(root)],
                env=job_env(), cwd=root, stdout=logs[node].open("w"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            for node in (0, 1)
        ]
        try:
            for agent, log in zip(agents, logs):
                assert agent.wait(timeout=300) == 0, log.read_text()[-5000:]
        finally:
            for agent in agents:
                agent.kill()  # after a failure: no agent outlives the test
        return {strategy: [torch.load(root / f"{strategy}-{rank}.pt") for rank in range(4)] for strategy in STRATEGIES}


pytestmark = [pytest.mark.launch, pytest.mark.early(check=_two_agents)]


@pytest.mark.parametrize(("sharding", "mesh"), [("FULL_SHARD", (1, 4)), ("HYBRID_SHARD", (2, 2))])
def test_two_nodes_of_two_devices_match_ddp(early: dict[str, list[dict]], sharding: str, mesh: tuple[int, int]) -> None:
    ours, ddp = early[sharding], early["ddp"]
    assert [r["node"] for r in ours] == [0, 0, 1, 1]
    assert [r["mesh"] for r in ours] == [mesh] * 4  # HYBRID_SHARD by default: (num_nodes, devices)
    for rank, (a, b) in enumerate(zip(ours, ddp)):
        assert len(a["losses"]) == len(b["losses"]) == 10
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), msg=f"losses, rank {rank}")
        assert a["params"].keys() == b["params"].keys()
        for name, expected in b["params"].items():
            torch.testing.assert_close(a["params"][name], expected, msg=f"{name}, rank {rank}")
