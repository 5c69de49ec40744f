"""Pipeline parallelism in fresh processes under Lightning's launcher (``tests/scripts/pipeline_parallel_fit.py``),
as users run it: two stages on two ranks train as the unsplit model, under the Trainer and under Fabric."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_shard.testing import run_on_ranks
from tests.jobs import job_env, launch_role

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


def _reference(rank: int, world_size: int, root: str) -> dict:
    """The script's DDP oracle on one pooled rank (the oracle needs no fresh process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline_parallel_fit", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return {"trainer": script.trainer_fit("reference", 1, Path(root))}


def test_two_stages_train_as_the_unsplit_model_and_their_save_resumes_without_pipeline(tmp_path: Path) -> None:
    """The Trainer's two stages train as DDP on one rank; Fabric's as the plain model, in the same processes. Their
    save loads in a fresh process at pipeline_parallel_size=1 with the trained weights."""
    (reference,) = run_on_ranks(_reference, 1, str(tmp_path))
    for rank, result in enumerate(_launch(tmp_path, "pipeline", 2)):
        assert result["created"], "the process group existed before the strategy ran"
        _assert_same(result["trainer"], reference["trainer"], f"trainer, rank {rank}")
        _assert_same(result["fabric"], result["oracle"], f"fabric, rank {rank}")
    (resumed,) = _launch(tmp_path, "resume", 1)
    assert resumed["trainer"]["losses"] == []  # the save's step is max_steps: nothing left to train
    for name, value in reference["trainer"]["params"].items():
        torch.testing.assert_close(resumed["trainer"]["params"][name], value, msg=f"resumed {name}")


def test_the_guides_trainer_script_runs_as_written(tmp_path: Path) -> None:
    """docs/pipeline_parallel.md's first block, saved as a script and run with ``python``: 2 stages x 2 data-parallel
    ranks, the tied model, 10 steps."""
    guide = (Path(__file__).parents[1] / "docs" / "pipeline_parallel.md").read_text()
    script = tmp_path / "train_lm.py"
    script.write_text(re.search(r"^```python\n(.*?)^```", guide, re.S | re.M).group(1))  # type: ignore[union-attr]
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=job_env(), capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "`max_steps=10` reached" in result.stdout + result.stderr
