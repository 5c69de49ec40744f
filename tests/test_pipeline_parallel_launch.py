"""Pipeline parallelism in fresh processes under Lightning's launcher (``tests/scripts/pipeline_parallel_fit.py``),
as users run it: two stages on two ranks train as the unsplit model, under the Trainer and under Fabric."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.jobs import free_port, job_env

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_parallel_fit.py"


def _launch(root: Path, role: str, devices: int) -> list[dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), "--role", role, "--devices", str(devices), "--root", str(root)],
                          capture_output=True, text=True, timeout=900,
                          env=job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))  # fmt: skip
    assert done.returncode == 0, f"{role}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    return [torch.load(root / f"{role}-{rank}.pt") for rank in range(devices)]


def _assert_same(ours: dict, expected: dict, what: str) -> None:
    torch.testing.assert_close(ours["losses"], expected["losses"], msg=f"{what} losses")
    assert ours["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        torch.testing.assert_close(ours["params"][name], value, msg=f"{what} {name}")


def test_two_stages_train_as_the_unsplit_model(tmp_path: Path) -> None:
    """The Trainer's two stages train as DDP on one rank; Fabric's as the plain model, in the same processes."""
    (reference,) = _launch(tmp_path, "reference", 1)
    for rank, result in enumerate(_launch(tmp_path, "pipeline", 2)):
        assert result["created"], "the process group existed before the strategy ran"
        _assert_same(result["trainer"], reference["trainer"], f"trainer, rank {rank}")
        _assert_same(result["fabric"], result["oracle"], f"fabric, rank {rank}")
