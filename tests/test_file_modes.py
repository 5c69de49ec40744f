"""Files and folders a save, an export or a consolidation writes get the modes the umask gives ``open()`` and
``mkdir()`` (``0644`` and ``0755`` under ``022``), so that another account on a shared cluster can read them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lightning_shard.cli import main
from lightning_shard.testing import run_on_ranks
from tests.test_export import fit_and_checkpoint, write_config


def fit_and_checkpoint_under_umask(rank: int, world_size: int, ckpt_dir: str, umask: int) -> None:
    previous = os.umask(umask)
    try:
        fit_and_checkpoint(rank, world_size, ckpt_dir)
    finally:
        os.umask(previous)


def _modes(root: Path) -> dict[str, int]:
    found = {".": stat.S_IMODE(root.stat().st_mode)} if root.is_dir() else {}
    for path in [root] if root.is_file() else root.rglob("*"):
        found[str(path.relative_to(root) if path != root else path.name)] = stat.S_IMODE(path.stat().st_mode)
    return found


@pytest.fixture
def umask_022():  # noqa: ANN201
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_what_is_saved_exported_and_consolidated_is_readable_by_others(tmp_path: Path, umask_022: None) -> None:
    run_on_ranks(fit_and_checkpoint_under_umask, 2, str(tmp_path / "run"), 0o022)
    ckpt = tmp_path / "run" / "last.ckpt"
    config = write_config(tmp_path / "config.json")
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--format", "hf", "--prefix", "model", "--config",
                 str(config)]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "dcp"), "--format", "dcp"]) == 0
    assert main(["consolidate", str(ckpt), str(tmp_path / "model.safetensors")]) == 0
    for written in (ckpt, tmp_path / "hf", tmp_path / "dcp", tmp_path / "model.safetensors"):
        modes = _modes(written)
        assert len(modes) > 1 or written.is_file(), modes
        wrong = {name: oct(mode) for name, mode in modes.items()
                 if mode != (0o755 if (written / name).is_dir() or name == "." else 0o644)}
        assert not wrong, f"{written.name}: {wrong}"
