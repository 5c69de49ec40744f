"""Release hygiene: the wheel and the sdist build, and the wheel installs and imports in a fresh environment."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_and_sdist_build_and_the_wheel_installs_cleanly(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], check=True,
                   capture_output=True, timeout=600)
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), str(wheels[0])],
                   check=True, capture_output=True, timeout=900)
    probe = ("import importlib.resources as r, lightning_shard; "
             "assert (r.files('lightning_shard') / 'py.typed').is_file(); "
             "from lightning_shard import ShardStrategy; print(lightning_shard.__version__)")
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0.1.0"
    cli = subprocess.run([str(env / "bin" / "lightning-shard"), "--help"], capture_output=True, text=True)
    assert cli.returncode == 0 and "consolidate" in cli.stdout


def test_type_hints_check_clean() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy", "lightning_shard"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
