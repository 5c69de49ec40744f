"""Pipeline parallelism in fresh processes under Lightning's launcher (``tests/scripts/pipeline_parallel_fit.py``),
as users run it: two stages on two ranks train as the unsplit model, under the Trainer and under Fabric."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.jobs import launch_role

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_parallel_fit.py"


def _launch(root: Path, role: str, devices: int) -> list[dict]:
    return launch_role(SCRIPT, root, role, devices)


def _assert_same(ours: dict, expected: dict, what: str) -> None:
    losses = [torch.tensor(run["losses"]) for run in (ours, expected)]  # float32 values, compared as float32
    torch.testing.assert_close(*losses, msg=f"{what} losses")
    assert ours["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        torch.testing.assert_close(ours["params"][name], value, msg=f"{what} {name}")


def test_two_stages_train_as_the_unsplit_model_and_their_save_resumes_without_pipeline(tmp_path: Path) -> None:
    """The Trainer's two stages train as DDP on one rank; Fabric's as the plain model, in the same processes. Their
    save loads in a fresh process at pipeline_parallel_size=1 with the trained weights."""
    (reference,) = _launch(tmp_path, "reference", 1)
    for rank, result in enumerate(_launch(tmp_path, "pipeline", 2)):
        assert result["created"], "the process group existed before the strategy ran"
        _assert_same(result["trainer"], reference["trainer"], f"trainer, rank {rank}")
        _assert_same(result["fabric"], result["oracle"], f"fabric, rank {rank}")
    (resumed,) = _launch(tmp_path, "resume", 1)
    assert resumed["trainer"]["losses"] == []  # the save's step is max_steps: nothing left to train
    for name, value in reference["trainer"]["params"].items():
        torch.testing.assert_close(resumed["trainer"]["params"][name], value, msg=f"resumed {name}")
