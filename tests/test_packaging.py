"""Release hygiene: the wheel and the sdist build, and the wheel installs alone and imports in a fresh environment
whose dependencies are this environment's pinned packages, which satisfy what the wheel requires (`pip check`).

Both checks start with the session (see [Note: early checks] in tests/jobs.py): on a fresh clone, with no cache, they
are the slowest single processes of the suite."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import ROOT, run_early


def _build_and_install() -> dict[str, Any]:
    """Build the wheel and the sdist, install the wheel alone in a fresh virtual environment, and run what the test
    checks there: ``pip check``, an import of the installed copy, the command's ``--help``."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        dist = tmp_path / "dist"
        built = run_early([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)])
        assert built.returncode == 0, built.stderr[-3000:]
        wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
        assert len(wheels) == 1 and len(sdists) == 1
        env = tmp_path / "env"
        created = run_early([sys.executable, "-m", "venv", str(env)])
        assert created.returncode == 0, created.stderr
        python = env / "bin" / "python"
        # The dependencies come from this environment's site-packages, as a path (its .pth files, among them the
        # checkout's editable install, are not read there): the wheel alone is installed, and `pip check` says
        # whether what it requires is satisfied by the pinned environment.
        site = run_early([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
        ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
        Path(site, "pinned-dependencies.pth").write_text(ours + "\n")
        installed = run_early([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])], timeout=900)
        assert installed.returncode == 0, installed.stderr
        probe = ("import importlib.resources as r, sys, lightning_shard; "  # the wheel's copy, not the checkout:
                 "assert lightning_shard.__file__.startswith(sys.prefix), lightning_shard.__file__; "
                 "assert (r.files('lightning_shard') / 'py.typed').is_file(); "
                 "from lightning_shard import ShardStrategy; print(lightning_shard.__version__)")  # fmt: skip
        return {
            "pip check": run_early([str(python), "-m", "pip", "check"], timeout=300).stdout,
            "import": run_early([str(python), "-c", probe], cwd=tmp_path, timeout=300),
            "help": run_early([str(env / "bin" / "lightning-shard"), "--help"]),
        }


@pytest.mark.early(check=_build_and_install)
def test_wheel_and_sdist_build_and_the_wheel_installs_cleanly(early: dict[str, Any]) -> None:
    ours_unmet = [line for line in early["pip check"].splitlines() if line.lower().startswith("lightning-shard")]
    assert not ours_unmet, early["pip check"]  # (the fresh environment's own setuptools may be older than torch wants)
    done = early["import"]
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0.1.0"
    cli = early["help"]
    assert cli.returncode == 0 and "consolidate" in cli.stdout


@pytest.mark.early(check=lambda: run_early([sys.executable, "-m", "mypy", "lightning_shard"]))
def test_type_hints_check_clean(early: subprocess.CompletedProcess) -> None:
    assert early.returncode == 0, early.stdout[-3000:]
