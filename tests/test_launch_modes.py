"""Every user-facing mode the way users run it: each front end (Trainer, Fabric) under each launcher (Lightning's own,
from a script; torchrun), in fresh processes where ``ShardStrategy`` itself creates the process group, against DDP at
fp32 ``assert_close`` defaults.

HYBRID_SHARD runs with its default mesh (two simulated nodes of two ranks: shard inside a node, replicate across)
and with an explicit ``device_mesh=(2, 2)`` on one node of four; the other sharding strategies run on two ranks. Two
nodes under Lightning's launcher are two launches of the script with ``NODE_RANK`` set, as on a cluster without a
scheduler; under torchrun, two agents.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.jobs import free_port, job_env, param, start_jobs

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).parent / "scripts" / "mode_fit.py"

# (sharding strategy, mesh argument, nodes, devices per node, the mesh it must train on)
MODES = {
    "hybrid-default-mesh": ("HYBRID_SHARD", "default", 2, 2, (2, 2)),
    "hybrid-explicit-mesh": ("HYBRID_SHARD", "2,2", 1, 4, (2, 2)),
    "full-shard": ("FULL_SHARD", "default", 1, 2, (1, 2)),
    "shard-grad-op": ("SHARD_GRAD_OP", "default", 1, 2, (1, 2)),
    "no-shard": ("NO_SHARD", "default", 1, 2, (2, 1)),
}
# Each non-hybrid strategy runs under one front end and launcher (FULL_SHARD also in tests/test_launch.py and
# tests/test_multinode.py). The HYBRID_SHARD cases are pairwise: each front end under each launcher, each mesh under
# each front end and under each launcher.
CASES = [
    ("trainer", "lightning", "hybrid-default-mesh"),
    ("fabric", "torchrun", "hybrid-default-mesh"),
    ("trainer", "torchrun", "hybrid-explicit-mesh"),
    ("fabric", "lightning", "hybrid-explicit-mesh"),
    ("fabric", "lightning", "full-shard"),
    ("trainer", "torchrun", "shard-grad-op"),
    ("fabric", "torchrun", "no-shard"),
]  # fmt: skip


def _commands(front: str, launcher: str, mode: str, root: Path) -> list[tuple[list[str], dict[str, str]]]:
    sharding, mesh, nodes, devices, _ = MODES[mode]
    script = [str(SCRIPT), "--front", front, "--sharding", sharding, "--mesh", mesh, "--devices", str(devices),
              "--num-nodes", str(nodes), "--root", str(root)]  # fmt: skip
    port = str(free_port())
    if launcher == "torchrun":
        return [
            ([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(devices),
              "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port, *script], job_env())
            for node in range(nodes)
        ]  # fmt: skip
    return [
        ([sys.executable, *script], job_env(NODE_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for node in range(nodes)
    ]


def _mode_job(front: str, launcher: str, mode: str, root: Path) -> None:
    logs = [root / f"node-{i}.log" for i in range(MODES[mode][2])]
    jobs = [
        subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        for (command, env), log in zip(_commands(front, launcher, mode, root), logs)
    ]
    try:
        for job, log in zip(jobs, logs):
            assert job.wait(timeout=300) == 0, log.read_text()[-6000:]
    finally:
        for job in jobs:
            job.kill()  # after a failure: no job outlives the test


@pytest.fixture(scope="module")
def jobs(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, ...] | None, Future[Path]]:
    """Each test's jobs, all started with the first test: a case's by ``(front, launcher, mode)``, the Fabric resume's
    two (one after the other) by None. Each writes to a folder of its own, which its future gives."""

    def run(case: tuple[str, ...] | None) -> Path:
        root = tmp_path_factory.mktemp("-".join(case) if case else "fabric-resume")
        if case:
            _mode_job(*case, root)
        else:
            _fabric_jobs(root)
        return root

    def case(item: pytest.Item) -> tuple[str, ...] | None:
        names = ("front", "launcher", "mode")
        return tuple(param(item, name) for name in names) if param(item, "mode") else None

    return start_jobs(request, background, case, run)


@pytest.mark.parametrize(("front", "launcher", "mode"), CASES, ids=["-".join(case) for case in CASES])
def test_a_fresh_job_matches_ddp(jobs: dict, front: str, launcher: str, mode: str) -> None:
    root = jobs[front, launcher, mode].result()
    world_size = MODES[mode][2] * MODES[mode][3]
    for rank in range(world_size):
        ours, ddp = torch.load(root / f"shard-{rank}.pt"), torch.load(root / f"ddp-{rank}.pt")
        assert ours["created"], "the process group existed before the strategy ran: not a fresh process"
        assert ours["mesh"] == MODES[mode][4]
        assert len(ours["losses"]) == len(ddp["losses"]) == 4
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), msg=f"rank {rank}")
        assert ours["params"].keys() >= ddp["params"].keys()
        for name, expected in ddp["params"].items():
            torch.testing.assert_close(ours["params"][name], expected, msg=f"{name}, rank {rank}")


RESUME_SCRIPT = Path(__file__).parent / "scripts" / "fabric_resume.py"


def _fabric_job(*args: str) -> None:
    done = subprocess.run([sys.executable, str(RESUME_SCRIPT), *args], env=job_env(MASTER_PORT=str(free_port())),
                          capture_output=True, text=True, timeout=240)
    report = f"exit {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, report


def _fabric_jobs(root: Path) -> None:
    _fabric_job(str(root / "uninterrupted"), "--steps", "3", "--save-first", str(root / "first"))
    _fabric_job(str(root / "resumed"), "--steps", "3", "--resume", str(root / "first"))


def test_a_fabric_job_resumed_with_fabric_load_in_fresh_processes_ends_where_the_uninterrupted_one_does(
    jobs: dict,
) -> None:
    """``fabric.load`` reads the model's and the optimizer's rows in one pass; a resume that missed either (other
    seed: every weight and moment must come from the checkpoint) would end elsewhere. The uninterrupted job saves
    after its first step too: the checkpoint the other job resumes from."""
    from safetensors.torch import load_file

    from lightning_shard import consolidate

    root = jobs[None].result()
    ends = {}
    for run in ("uninterrupted", "resumed"):
        ends[run] = load_file(str(consolidate(root / run, root / f"{run}.safetensors")))
    assert ends["resumed"].keys() == ends["uninterrupted"].keys()
    for name, value in ends["uninterrupted"].items():
        assert torch.equal(ends["resumed"][name], value), name
