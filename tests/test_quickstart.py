"""docs/quickstart.md run as a reader runs it, in order, in a fresh folder: ``python quickstart.py`` (2 processes
under Lightning's launcher), ``python resume.py`` (3 processes), then ``lightning-shard inspect`` and ``consolidate``
of ``checkpoints/last.ckpt``, which must be the resumed run's. With fewer steps: 10 instead of 100, then up to 20
instead of 200 (each a step count the reader's run passes too)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def test_the_quickstart_in_sequence_trains_resumes_and_consolidates_the_resumed_run(tmp_path: Path) -> None:
    blocks = _python_blocks()
    quickstart = blocks[0]
    resume = next(b for b in blocks if "from quickstart import" in b)
    (tmp_path / "quickstart.py").write_text(_fewer_steps(quickstart, 100, 10))
    (tmp_path / "resume.py").write_text(_fewer_steps(resume, 200, 20))
    out = _run(sys.executable, "quickstart.py", cwd=tmp_path)
    assert "rank 0: params" in out and "rank 1: params" in out, out
    first = _run(str(Path(sys.executable).parent / "lightning-shard"), "inspect", "checkpoints/last.ckpt", cwd=tmp_path)
    assert "written by 2 ranks" in first and "step 10\n" in first, first
    _run(sys.executable, "resume.py", cwd=tmp_path)
    after = _run(str(Path(sys.executable).parent / "lightning-shard"), "inspect", "checkpoints/last.ckpt", cwd=tmp_path)
    assert "written by 3 ranks" in after and "step 20\n" in after, after
    _run(str(Path(sys.executable).parent / "lightning-shard"), "consolidate", "checkpoints/last.ckpt",
         "model.safetensors", cwd=tmp_path)
    assert "net.blocks.0.fc.weight" in load_file(str(tmp_path / "model.safetensors"))
