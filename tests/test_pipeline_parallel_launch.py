"""Pipeline parallelism in fresh processes under Lightning's launcher (``tests/scripts/pipeline_parallel_fit.py``),
as users run it: two stages on two ranks train as the unsplit model, under the Trainer and under Fabric."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_shard.testing import run_on_ranks
from tests.jobs import job_env, launch_role, script_function, start_jobs

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_parallel_fit.py"


def _assert_same(ours: dict, expected: dict, what: str) -> None:
    losses = [torch.tensor(run["losses"]) for run in (ours, expected)]  # float32 values, compared as float32
    torch.testing.assert_close(*losses, msg=f"{what} losses")
    assert ours["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        torch.testing.assert_close(ours["params"][name], value, msg=f"{what} {name}")


def _stages_then_resume(root: Path) -> tuple[list[dict], list[dict]]:
    return launch_role(SCRIPT, root, "pipeline", 2), launch_role(SCRIPT, root, "resume", 1)


def _guide_script(root: Path) -> subprocess.CompletedProcess:
    """docs/pipeline_parallel.md's first block, saved as a script and run with ``python``."""
    guide = (Path(__file__).parents[1] / "docs" / "pipeline_parallel.md").read_text()
    script = root / "train_lm.py"
    script.write_text(re.search(r"^```python\n(.*?)^```", guide, re.S | re.M).group(1))  # type: ignore[union-attr]
    return subprocess.run([sys.executable, str(script)], cwd=root, env=job_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def jobs(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[Any]]:
    """Each test's launches, all started with the first test: the two stages, then their save resumed ("stages"),
    and the guide's script ("guide")."""
    jobs = {"stages": _stages_then_resume, "guide": _guide_script}
    return start_jobs(request, background, lambda item: "guide" if "guide" in item.originalname else "stages",
                      lambda name: jobs[name](tmp_path_factory.mktemp(name)))  # fmt: skip


def test_two_stages_train_as_the_unsplit_model_and_their_save_resumes_without_pipeline(
    jobs: dict, tmp_path: Path
) -> None:
    """The Trainer's two stages train as DDP on one rank; Fabric's as the plain model, in the same processes. Their
    save loads in a fresh process at pipeline_parallel_size=1 with the trained weights."""
    # The script's DDP oracle needs no fresh process: it runs on a pooled rank while the launches run.
    (reference,) = run_on_ranks(script_function, 1, str(SCRIPT), "trainer_fit", "reference", 1, tmp_path)
    stages, (resumed,) = jobs["stages"].result()
    for rank, result in enumerate(stages):
        assert result["created"], "the process group existed before the strategy ran"
        _assert_same(result["trainer"], reference, f"trainer, rank {rank}")
        _assert_same(result["fabric"], result["oracle"], f"fabric, rank {rank}")
    assert resumed["trainer"]["losses"] == []  # the save's step is max_steps: nothing left to train
    for name, value in reference["params"].items():
        torch.testing.assert_close(resumed["trainer"]["params"][name], value, msg=f"resumed {name}")


def test_the_guides_trainer_script_runs_as_written(jobs: dict) -> None:
    """docs/pipeline_parallel.md's first block, saved as a script and run with ``python``: 2 stages x 2 data-parallel
    ranks, the tied model, 10 steps."""
    result = jobs["guide"].result()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "`max_steps=10` reached" in result.stdout + result.stderr
