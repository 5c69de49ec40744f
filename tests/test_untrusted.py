"""Checkpoints are untrusted input: a file named through ``../``, a symlink out of the directory, an absurd
optimizer-state shape, a piece claiming rows its file does not hold, a header claiming more bytes than its file
holds. Each is refused by validation, before any tensor data is read or allocated, on every rank, with an error
naming the file, the key and the problem; nothing outside the checkpoint directory is opened."""

from __future__ import annotations

import builtins
import io
import json
import math
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

from lightning_shard import consolidate, inspect
from lightning_shard.checkpoint.format import INDEX_FILE, CheckpointError
from lightning_shard.checkpoint.load import _safetensors_tensors
from lightning_shard.testing import RankFailure, RankStatus, run_on_ranks
from tests.checkpoint_fits import fit

SHARD1 = "shard-00001-of-00002.safetensors"
HUGE = 10**8  # elements: far beyond any tensor of the test model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("untrusted")
    run_on_ranks(fit, 2, str(root / "first"), 1)
    return root / "first" / "last.ckpt"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_index(ckpt: Path, edit: Any) -> None:
    index = json.loads((ckpt / INDEX_FILE).read_text())
    edit(index)
    (ckpt / INDEX_FILE).write_text(json.dumps(index))


def _move_shard_out(ckpt: Path, outside: Path, name: str) -> None:
    """Move shard 1 to ``outside`` and make the index name it ``name``."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    (ckpt / SHARD1).rename(outside)

    def rename(index: dict[str, Any]) -> None:
        index["files"][name] = index["files"].pop(SHARD1)
        for entry in index["tensors"].values():
            for piece in entry["pieces"]:
                if piece["file"] == SHARD1:
                    piece["file"] = name

    _edit_index(ckpt, rename)


def resume_guarded(rank: int, world_size: int, out: str, ckpt: str) -> Any:
    """Resume from ``ckpt`` with ``torch.empty`` refusing any allocation of more than ``HUGE`` elements."""
    real = torch.empty

    def guarded(*size: Any, **kwargs: Any) -> torch.Tensor:
        shape = kwargs.get("size", size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
        if math.prod(int(d) for d in shape) > HUGE:
            raise MemoryError(f"an allocation of shape {tuple(shape)} was attempted")
        return real(*size, **kwargs)

    torch.empty = guarded  # type: ignore[assignment]
    try:
        return fit(rank, world_size, out, 2, ckpt)
    finally:
        torch.empty = real  # type: ignore[assignment]


def _refused_on_every_rank(ckpt: Path, out: Path, pattern: str) -> None:
    """Each of 2 ranks raises its own ``CheckpointError`` matching ``pattern``, and no rank tried a huge allocation."""
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(resume_guarded, 2, str(out), str(ckpt), timeout=120)
    outcomes = failure.value.outcomes
    assert [o.status for o in outcomes.values()] == [RankStatus.RAISED] * 2, str(failure.value)
    for rank, outcome in outcomes.items():
        assert outcome.error.startswith("CheckpointError: "), f"rank {rank}: {outcome.error}"
        assert re.search(pattern, outcome.error), f"rank {rank}: {outcome.error}"
        assert "allocation" not in outcome.error, f"rank {rank}: {outcome.error}"


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path opened with ``open`` or ``safetensors.safe_open`` in this process, resolved."""
    paths: list[Path] = []
    real_open, real_safe_open = builtins.open, safetensors.safe_open

    def record_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, Path)):
            paths.append(Path(file).resolve())
        return real_open(file, *args, **kwargs)

    def record_safe_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        paths.append(Path(file).resolve())
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", record_open)
    monkeypatch.setattr(io, "open", record_open)
    monkeypatch.setattr(safetensors, "safe_open", record_safe_open)
    return paths


def test_file_named_through_dotdot_is_refused_on_every_rank(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    _move_shard_out(ckpt, tmp_path / "outside.safetensors", "../outside.safetensors")
    _refused_on_every_rank(ckpt, tmp_path / "out", r"'\.\./outside\.safetensors', which is not a plain file name")


def test_consolidate_and_inspect_open_nothing_outside_the_directory(
    tmp_path: Path, saved: Path, opened: list[Path]
) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    _move_shard_out(ckpt, tmp_path / "outside.safetensors", "../outside.safetensors")
    for tool in (lambda: consolidate(ckpt, tmp_path / "m.safetensors"), lambda: inspect(ckpt)):
        with pytest.raises(CheckpointError, match=r"'\.\./outside\.safetensors', which is not a plain file name"):
            tool()
    assert opened and all(p.is_relative_to(ckpt.resolve()) for p in opened), opened
    assert not (tmp_path / "m.safetensors").exists()


def test_symlink_out_of_the_directory_is_refused_on_every_rank(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    elsewhere = tmp_path / "elsewhere" / SHARD1
    elsewhere.parent.mkdir()
    (ckpt / SHARD1).rename(elsewhere)
    (ckpt / SHARD1).symlink_to(elsewhere)
    _refused_on_every_rank(ckpt, tmp_path / "out", rf"{re.escape(SHARD1)} is a symlink that leads out of")


def test_absurd_optimizer_state_shape_is_refused_before_any_allocation(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    key = "optimizer/0/model.wte.weight/exp_avg"

    def absurd(index: dict[str, Any]) -> None:
        entry = index["tensors"][key]
        entry["shape"] = [10**12]
        entry["pieces"] = [{**entry["pieces"][0], "rows": [0, 10**12]}]

    _edit_index(ckpt, absurd)
    _refused_on_every_rank(
        ckpt, tmp_path / "out",
        rf"rows \[0, 1000000000000\] of tensor '{re.escape(key)}', holds shape \[19, 16\] .* claims shape \[10+\]",
    )


def test_piece_claiming_rows_its_file_lacks_is_refused_on_every_rank(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    key = "model/model.wte.weight"

    def shift(index: dict[str, Any]) -> None:  # same total, but piece 0 now claims 20 rows of a 19-row tensor
        first, second = index["tensors"][key]["pieces"]
        first["rows"], second["rows"] = [0, 20], [20, 37]

    _edit_index(ckpt, shift)
    _refused_on_every_rank(
        ckpt, tmp_path / "out",
        rf"shard-00000-of-00002\.safetensors: .*rows \[0, 20\] of tensor '{re.escape(key)}', holds shape \[19, 16\]",
    )


def test_overlapping_pieces_are_refused(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    _edit_index(ckpt, lambda index: index["tensors"]["model/model.wte.weight"]["pieces"][1].update(rows=[18, 36]))
    with pytest.raises(CheckpointError, match=r"'model/model\.wte\.weight' .*rows \[18, 36\) overlaps"):
        consolidate(ckpt, tmp_path / "m.safetensors")


def test_header_claiming_more_bytes_than_the_file_holds_is_refused(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    shard = ckpt / SHARD1
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [10**9]
    header[name]["data_offsets"] = [header[name]["data_offsets"][0], header[name]["data_offsets"][0] + 4 * 10**9]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])
    _edit_index(ckpt, lambda index: index["files"][SHARD1].update(size=shard.stat().st_size))
    with pytest.raises(CheckpointError, match=rf"{re.escape(SHARD1)}: tensor '{re.escape(name)}' .*claims bytes"):
        consolidate(ckpt, tmp_path / "m.safetensors")


def test_hugging_face_index_naming_a_file_outside_is_refused(tmp_path: Path, opened: list[Path]) -> None:
    from safetensors.torch import save_file

    (tmp_path / "model").mkdir()
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "outside.safetensors"))
    index = tmp_path / "model" / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"'\.\./outside\.safetensors', which is not a plain file name"):
        _safetensors_tensors(tmp_path / "model")
    assert all(p.is_relative_to((tmp_path / "model").resolve()) for p in opened), opened
