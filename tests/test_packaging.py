"""Release hygiene: the wheel and the sdist build, and the wheel installs alone and imports in a fresh environment
whose dependencies are this environment's pinned packages, which satisfy what the wheel requires (`pip check`)."""

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
    # The dependencies come from this environment's site-packages, as a path (its .pth files, among them the
    # checkout's editable install, are not read there): the wheel alone is installed, and `pip check` says whether
    # what it requires is satisfied by the pinned environment.
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    Path(site, "pinned-dependencies.pth").write_text(ours + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])], check=True,
                   capture_output=True, timeout=900)
    checked = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    ours_unmet = [line for line in checked.stdout.splitlines() if line.lower().startswith("lightning-shard")]
    assert not ours_unmet, checked.stdout  # (the fresh environment's own setuptools may be older than torch wants)
    probe = ("import importlib.resources as r, sys, lightning_shard; "
             "assert lightning_shard.__file__.startswith(sys.prefix), lightning_shard.__file__; "  # the wheel's copy
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
