"""docs/quickstart.md run as a reader runs it, in order, in a fresh folder: ``python quickstart.py`` (2 processes
under Lightning's launcher), ``python resume.py`` (3 processes), then ``lightning-shard inspect`` and ``consolidate``
of ``checkpoints/last.ckpt``, which must be the resumed run's. With fewer steps: 10 instead of 100, then up to 20
instead of 200 (each a step count the reader's run passes too)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.jobs import job_env

pytestmark = pytest.mark.launch

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"


def _python_blocks() -> list[str]:
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", QUICKSTART.read_text(), re.S | re.M)
            if m.group(1) == "python"]


def _fewer_steps(block: str, steps: int, fewer: int) -> str:
    """``block`` with its ``max_steps=steps`` (which it must have) replaced by ``max_steps=fewer``."""
    assert block.count(f"max_steps={steps},") == 1, block
    return block.replace(f"max_steps={steps},", f"max_steps={fewer},")


def _run(*command: str, cwd: Path) -> str:
    done = subprocess.run(list(command), cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}:\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
    return done.stdout


def _in_sequence() -> dict[str, Any]:
    """The page in order in a fresh folder: what each step printed, and the names in the consolidated file. An early
    check (see [Note: early checks] in tests/jobs.py): nothing here needs the rest of the session."""
    blocks = _python_blocks()
    quickstart = blocks[0]
    resume = next(b for b in blocks if "from quickstart import" in b)
    command = str(Path(sys.executable).parent / "lightning-shard")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "quickstart.py").write_text(_fewer_steps(quickstart, 100, 10))
        (folder / "resume.py").write_text(_fewer_steps(resume, 200, 20))
        printed = {"quickstart": _run(sys.executable, "quickstart.py", cwd=folder)}
        printed["first inspect"] = _run(command, "inspect", "checkpoints/last.ckpt", cwd=folder)
        _run(sys.executable, "resume.py", cwd=folder)
        printed["second inspect"] = _run(command, "inspect", "checkpoints/last.ckpt", cwd=folder)
        _run(command, "consolidate", "checkpoints/last.ckpt", "model.safetensors", cwd=folder)
        return {**printed, "consolidated": set(load_file(str(folder / "model.safetensors")))}


@pytest.mark.early(check=_in_sequence)
def test_the_quickstart_in_sequence_trains_resumes_and_consolidates_the_resumed_run(early: dict[str, Any]) -> None:
    out = early["quickstart"]
    assert "rank 0: params" in out and "rank 1: params" in out, out
    first = early["first inspect"]
    assert "written by 2 ranks" in first and "step 10\n" in first, first
    after = early["second inspect"]
    assert "written by 3 ranks" in after and "step 20\n" in after, after
    assert "net.blocks.0.fc.weight" in early["consolidated"]
