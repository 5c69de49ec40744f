"""Checkpoints are untrusted input: a file named through ``../``, a symlink out of the directory, an absurd
optimizer-state shape, a piece claiming rows its file does not hold, a header claiming more bytes than its file
holds. Each is refused by validation, before any tensor data is read or allocated, on every rank, with an error
naming the file, the key and the problem; nothing outside the checkpoint directory is opened."""

from __future__ import annotations

import builtins
import io
import json
import math
import os
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
from lightning_shard.checkpoint.interop.hf import _safetensors_tensors
from lightning_shard.checkpoint.io.writer import sha256_file
from lightning_shard.testing import RankFailure, RankStatus, run_on_ranks
from lightning_shard.testing_checkpoints import header_digest, reseal_index
from tests.checkpoint_fits import fit
from tests.checkpoint_scaling_fits import FIXTURE_V1, with_layout

SHARD1 = "shard-00001-of-00002.safetensors"
HUGE = 10**8  # elements: far beyond any tensor of the test model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("untrusted")
    # every tensor split by rows (this model's are all small enough to be stored whole by default): damage to the
    # split layout, which larger models' checkpoints hold, is refused as any other
    run_on_ranks(with_layout, 2, {"SPLIT_PIECE_MIN_BYTES": 0}, fit, str(root / "first"), 1)
    return root / "first" / "last.ckpt"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_index(ckpt: Path, edit: Any) -> None:
    reseal_index(ckpt, edit)


def _move_shard_out(ckpt: Path, outside: Path, name: str) -> None:
    """Move shard 1 to ``outside`` and make the index name it ``name``."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    (ckpt / SHARD1).rename(outside)

    def rename(index: dict[str, Any]) -> None:
        index["files"][name] = index["files"].pop(SHARD1)
        index["shard_files"] = [name if file == SHARD1 else file for file in index["shard_files"]]

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
    """Every path opened with ``open``, ``os.open`` or ``safetensors.safe_open`` in this process, resolved."""
    paths: list[Path] = []
    real_open, real_safe_open = builtins.open, safetensors.safe_open

    def record_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, Path)):
            paths.append(Path(file).resolve())
        return real_open(file, *args, **kwargs)

    def record_safe_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        paths.append(Path(file).resolve())
        return real_safe_open(file, *args, **kwargs)

    real_os_open = os.open

    def record_os_open(file: Any, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> Any:
        directory = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) if dir_fd is not None else Path()
        paths.append((directory / file).resolve())
        return real_os_open(file, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(builtins, "open", record_open)
    monkeypatch.setattr(io, "open", record_open)
    monkeypatch.setattr(os, "open", record_os_open)
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


def test_a_symlink_that_stays_inside_the_directory_is_followed(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "linked")
    (ckpt / SHARD1).rename(ckpt / "moved.safetensors")
    (ckpt / SHARD1).symlink_to("moved.safetensors")
    consolidate(ckpt, tmp_path / "linked.safetensors")
    consolidate(saved, tmp_path / "plain.safetensors")
    assert (tmp_path / "linked.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()


def test_absurd_optimizer_state_shape_is_refused_before_any_allocation(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    key = "optimizer/0/model.wte.weight/exp_avg"
    _edit_index(ckpt, lambda index: index["tensors"][key].update(shape=[10**12]))  # split over the 2 shard files
    _refused_on_every_rank(
        ckpt, tmp_path / "out", rf"{re.escape(key)}: checkpoint \(1000000000000,\), model \(37, 16\)",
    )


def test_absurd_model_shape_is_refused_by_consolidate_before_any_allocation(
    tmp_path: Path, saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    key = "model/model.wte.weight"
    _edit_index(ckpt, lambda index: index["tensors"][key].update(shape=[10**12, 16]))
    real = torch.empty

    def guarded(*size: Any, **kwargs: Any) -> torch.Tensor:
        shape = kwargs.get("size", size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
        assert math.prod(int(d) for d in shape) <= HUGE, f"an allocation of shape {tuple(shape)} was attempted"
        return real(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", guarded)
    pattern = rf"shard-00000-of-00002\.safetensors: '{re.escape(key)}', rows \[0, 500000000000\] of .* holds shape"
    with pytest.raises(CheckpointError, match=pattern):
        consolidate(ckpt, tmp_path / "m.safetensors")


def test_piece_claiming_rows_its_file_lacks_is_refused_on_every_rank(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    key = "model/model.wte.weight"
    whole = {"shape": [37, 16], "dtype": "float32", "file": "shard-00000-of-00002.safetensors", "key": key}
    _edit_index(ckpt, lambda index: index["tensors"].update({key: whole}))  # all 37 rows, where 19 are
    _refused_on_every_rank(
        ckpt, tmp_path / "out",
        rf"shard-00000-of-00002\.safetensors: .*rows \[0, 37\] of tensor '{re.escape(key)}', holds shape \[19, 16\]",
    )


def test_a_split_beyond_the_shard_files_is_refused(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")  # the mesh claims one shard file per row of a 37-row tensor
    _edit_index(ckpt, lambda index: index.update(world_size=37, mesh={"replicas": 1, "shard_size": 37}))
    with pytest.raises(CheckpointError, match=r"is split over \d+ shards but 'shard_files' names 2 files"):
        consolidate(ckpt, tmp_path / "m.safetensors")


def test_overlapping_pieces_of_a_version_1_index_are_refused(tmp_path: Path) -> None:
    ckpt = _copy(FIXTURE_V1, tmp_path / "bad")
    _edit_index(ckpt, lambda index: index["tensors"]["model/embed.weight"]["pieces"][1].update(rows=[2, 5]))
    with pytest.raises(CheckpointError, match=r"'model/embed\.weight' .*rows \[2, 5\) overlaps"):
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
    _edit_index(ckpt, lambda index: index["files"][SHARD1].update(
        size=shard.stat().st_size, header_sha256=header_digest(shard)))
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


def _set(key: str, value: Any) -> Any:
    return lambda index: index.__setitem__(key, value)


def _first_file(edit: Any) -> Any:
    return lambda index: edit(next(iter(index["files"].values())))


def _first_entry(where: str, edit: Any) -> Any:
    return lambda index: edit(next(e for e in index["tensors"].values() if where in e))


DAMAGED_INDEXES = {
    "index is a list": (lambda index: None, r"index\.json is damaged: it holds a JSON list"),
    "version is a string": (_set("version", "1"), r"format version is '1', which no lightning_shard writes"),
    "size is a string": (_first_file(lambda f: f.__setitem__("size", "1836")), r"needs a byte count 'size'"),
    "file entry is a string": (lambda index: index["files"].update(dict.fromkeys(index["files"], "x")),
                               r"needs a byte count 'size'"),
    "ties is a list": (_set("ties", ["a"]), r"'ties' must map tensor names to tensor names"),
    "tie to a number": (_set("ties", {"model/a": 5}), r"'ties' must map tensor names to tensor names"),
    "optimizers is a number": (_set("optimizers", 5), r"'optimizers' must be a list"),
    "optimizer without groups": (lambda index: index["optimizers"][0].pop("param_groups"), r"optimizer 0 needs"),
    "mesh missing": (lambda index: index.pop("mesh"), r"'world_size' and 'mesh'"),
    "scalar states not a table": (lambda index: index["optimizers"][0].__setitem__("scalar_param_states", ["x"]),
                                  r"optimizer 0's 'scalar_param_states' must map parameter names"),
    "dtype is a list": (lambda index: next(iter(index["tensors"].values())).__setitem__("dtype", ["float32"]),
                        r"has a malformed entry"),
    "whole tensor's file is a list": (_first_entry("file", lambda e: e.__setitem__("file", [e["file"]])),
                                      r"has a malformed entry"),
    "unknown split": (_first_entry("split", lambda e: e.__setitem__("split", "columns")), r"has a malformed entry"),
    "shard files not a list": (_set("shard_files", "shard-00000-of-00002.safetensors"),
                               r"'shard_files' must list files of its 'files' table"),
    "mesh not covering the world": (_set("world_size", 3), r"its mesh .* does not cover its world size 3"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED_INDEXES))
def test_a_damaged_index_is_named_and_explained_by_every_reader(tmp_path: Path, saved: Path, case: str) -> None:
    edit, pattern = DAMAGED_INDEXES[case]
    ckpt = _copy(saved, tmp_path / "bad")
    if case == "index is a list":
        (ckpt / INDEX_FILE).write_text("[1, 2, 3]")
    else:
        _edit_index(ckpt, edit)
    for tool in (lambda: inspect(ckpt), lambda: consolidate(ckpt, tmp_path / "m.safetensors")):
        with pytest.raises(CheckpointError, match=pattern):
            tool()
    assert not (tmp_path / "m.safetensors").exists()


def test_damaged_optimizer_options_and_trainer_state_are_named(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    _edit_index(ckpt, lambda index: index["optimizers"][0]["param_groups"][0]["options"].update(
        {"lr": {"__tensor__": "nope"}}))
    _refused_on_every_rank(ckpt, tmp_path / "out", r"Optimizer 0's options in .*index\.json cannot be decoded")
    ckpt = _copy(saved, tmp_path / "deep")
    nested: Any = 0
    for _ in range(900):
        nested = [nested]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "deep": nested}))
    _edit_index(ckpt, lambda index: index["files"]["trainer_state.json"].update(
        size=(ckpt / "trainer_state.json").stat().st_size, sha256=sha256_file(ckpt / "trainer_state.json")))
    _refused_on_every_rank(ckpt, tmp_path / "out2", r"trainer state in .*trainer_state\.json .*RecursionError")


@pytest.mark.parametrize("special", ["pipe", "link to /dev/zero"])
def test_an_index_that_is_not_a_regular_file_is_refused_without_reading_it(
    tmp_path: Path, saved: Path, special: str
) -> None:
    ckpt = _copy(saved, tmp_path / "bad")
    (ckpt / INDEX_FILE).unlink()
    if special == "pipe":
        os.mkfifo(ckpt / INDEX_FILE)  # reading it would wait for a writer forever
        pattern = r"index\.json is not a regular file"
    else:
        (ckpt / INDEX_FILE).symlink_to("/dev/zero")  # reading it would never end
        pattern = r"index\.json is a symlink that leads out of"
    _refused_on_every_rank(ckpt, tmp_path / "out", pattern)  # a hang would time out instead


def test_consolidate_refuses_to_write_into_the_checkpoint_or_onto_a_directory(tmp_path: Path, saved: Path) -> None:
    ckpt = _copy(saved, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(CheckpointError, match="would be written inside the checkpoint"):
        consolidate(ckpt, ckpt / SHARD1)
    (tmp_path / "folder").mkdir()
    with pytest.raises(CheckpointError, match="is a directory: give a file name"):
        consolidate(ckpt, tmp_path / "folder")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "folder"]  # no temporary file left


# DCP metadata and pickles that claim more than they hold #


def _chunked(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Any:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def _grid(rows: int, cols: int, n: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [((i * rows, j * cols), (rows, cols)) for i in range(n) for j in range(n)]


def test_dcp_chunks_on_a_grid_of_4096_are_checked_and_any_overlap_refused() -> None:
    from lightning_shard.checkpoint.interop.dcp import _check_tensor_entry

    _check_tensor_entry("w", _chunked((128, 128), _grid(2, 2, 64)), CheckpointError)  # 64 x 64: rows and columns
    overlapping = _grid(2, 2, 64)
    overlapping[-1] = ((0, 0), (2, 2))  # the last chunk moved onto the first: same volume, one cell twice
    with pytest.raises(CheckpointError, match="do not cover it exactly once"):
        _check_tensor_entry("w", _chunked((128, 128), overlapping), CheckpointError)
    staggered: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((i, 0), (1, 128 - i)) for i in range(64)]
    staggered += [((i, 128 - i), (1, i)) for i in range(1, 64)]
    _check_tensor_entry("w", _chunked((64, 128), staggered), CheckpointError)  # off a grid, but an exact cover


def test_dcp_metadata_listing_more_chunks_than_a_save_writes_is_refused() -> None:
    from lightning_shard.checkpoint.interop import dcp

    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((i,), (1,)) for i in range(dcp.MAX_CHUNKS + 1)]
    with pytest.raises(CheckpointError, match=f"lists {dcp.MAX_CHUNKS + 1} chunks, more than"):
        dcp._check_tensor_entry("w", _chunked((dcp.MAX_CHUNKS + 1,), chunks), CheckpointError)


class _HugeArray:
    """Pickles as a call of numpy's ``_reconstruct`` for a 1 TiB array (numpy's own pickles ask for an empty one)."""

    def __reduce__(self) -> Any:
        import numpy as np

        multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
        return (multiarray._reconstruct, (np.ndarray, (2**40,), b"b"))


def test_a_pickle_that_asks_numpy_for_a_huge_array_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    import numpy as np

    from lightning_shard.checkpoint.interop.safe_pickle import load_restricted

    torch.save({"callbacks": {"state": _HugeArray()}}, tmp_path / "crafted.pt")
    with pytest.raises(CheckpointError, match=r"crafted\.pt is refused: the pickle asks numpy for an array of shape"):
        load_restricted(tmp_path / "crafted.pt", str(tmp_path / "crafted.pt"))
    torch.save({"callbacks": {"state": np.arange(5.0)}}, tmp_path / "honest.pt")  # numpy's own pickle still loads
    assert load_restricted(tmp_path / "honest.pt", "honest")["callbacks"]["state"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def _with_a_short_record(path: Path, out: Path, record: str, keep: int) -> None:
    """Rewrite the ``torch.save`` archive ``path`` as ``out`` (as torch writes archives) with its record ``record``
    cut to its first ``keep`` bytes: the pickle still claims the whole storage."""
    import zipfile

    writer = torch._C.PyTorchFileWriter(str(out))
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            inside = name.split("/", 1)[1]
            if inside == ".data/serialization_id":
                continue  # the writer adds its own
            data = archive.read(name)[:keep] if inside == record else archive.read(name)
            writer.write_record(inside, data, len(data))
    writer.write_end_of_file()


def test_a_ckpt_whose_pickle_claims_more_bytes_than_a_record_holds_is_refused_naming_it(tmp_path: Path) -> None:
    """A memory-mapped ``.ckpt`` whose pickle claims a storage larger than its record would read the next record's
    bytes as that tensor's (torch checks the sizes only when it reads records into memory): refused by convert and
    by ``fabric.load_raw``'s reader, naming the file and the storage."""
    from lightning_shard.checkpoint.convert import convert
    from lightning_shard.checkpoint.interop.safe_pickle import load_restricted

    state = {"state_dict": {"a": torch.arange(1000.0), "b": torch.arange(5000.0)}, "epoch": 0, "global_step": 0}
    torch.save(state, tmp_path / "honest.ckpt")
    _with_a_short_record(tmp_path / "honest.ckpt", tmp_path / "short.ckpt", "data/0", 16)
    message = r"short\.ckpt.* is damaged: its pickle claims 4000 bytes for the storage '0', whose record holds 16 bytes"
    with pytest.raises(CheckpointError, match=message):
        convert(tmp_path / "short.ckpt", tmp_path / "out")
    with pytest.raises(CheckpointError, match=message):
        load_restricted(tmp_path / "short.ckpt", str(tmp_path / "short.ckpt"), mmap=True)
    assert not (tmp_path / "out").exists()
    assert torch.equal(load_restricted(tmp_path / "honest.ckpt", "honest", mmap=True)["state_dict"]["b"],
                       torch.arange(5000.0))
