"""``lightning-shard inspect``: a checkpoint directory summarised and, with ``verify``, every file checked as a load
of everything would check it, and each file's SHA-256. No process group is needed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_shard.checkpoint.format import CheckpointError, dtype_name
from lightning_shard.checkpoint.format.adapters import ADAPTERS
from lightning_shard.checkpoint.io.index import LEFT_OUT, PIPELINE, TENSOR_PARALLEL_SIZE, checkpoint_files, read_index
from lightning_shard.checkpoint.io.layout import check_piece, require_complete
from lightning_shard.checkpoint.io.storage import Location, RemoteDirectory, location
from lightning_shard.checkpoint.io.writer import sha256_file
from lightning_shard.checkpoint.load.directory import load_trainer_state

_BLOCK_BYTES = 16 * 2**20  # verify reads an object at a URL in blocks of at most this size


@dataclass(frozen=True)
class CheckpointSummary:
    """What ``lightning-shard inspect`` reports."""

    directory: Path | RemoteDirectory
    state_dict_type: str
    world_size: int
    mesh: dict[str, int]
    epoch: int | None
    global_step: int | None
    tensors: dict[str, tuple[list[int], str]]  # index key -> (shape, dtype)
    total_bytes: int
    problems: list[str]  # empty when every file and piece checks out
    left_out: list[str] = field(default_factory=list)  # model keys a partial save left out
    adapters: list[str] = field(default_factory=list)  # the peft adapters it records
    tensor_parallel_size: int = 1  # the writers' tensor-parallel size
    pipeline: dict[str, Any] | None = None  # the writers' pipeline stages (size, module, blocks, bounds), if any

    def __str__(self) -> str:
        ranks = f"{self.world_size} rank" + ("s" if self.world_size != 1 else "")
        lines = [
            f"checkpoint {self.directory} ({self.state_dict_type}), written by {ranks},"
            f" mesh {self.mesh['replicas']}x{self.mesh['shard_size']}"
            + (f" x tensor-parallel {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else "")
            + (f" x {self.pipeline['size']} pipeline stages" if self.pipeline else "")
            + f"; epoch {self.epoch}, step {self.global_step}",
            f"{len(self.tensors)} tensors, {self.total_bytes / 2**20:.2f} MiB on disk",
        ]
        if self.left_out:
            lines.append(f"{len(self.left_out)} model weights left out (save_trainable_only or a filter): they must"
                         " come from where they came from when it is loaded")
        if self.adapters:
            lines.append(f"peft adapters: {', '.join(self.adapters)} (lightning-shard export --format peft)")
        lines += [f"  {key}  {list(shape)}  {dtype}" for key, (shape, dtype) in self.tensors.items()]
        lines.append("verified: OK" if not self.problems else "PROBLEMS:\n  " + "\n  ".join(self.problems))
        return "\n".join(lines)


def inspect(checkpoint_dir: str | Path, verify: bool = True) -> CheckpointSummary:
    """Summarise a checkpoint directory; with ``verify``, run every check a load runs on every file (see [Note: what a
    load verifies]) and each file's SHA-256: what a load of everything would refuse is reported, and nothing else. An
    index that cannot be read raises ``CheckpointError``."""
    directory = location(checkpoint_dir)
    index = read_index(directory)
    require_complete(directory, index["tensors"])
    files = checkpoint_files(directory, index)
    for name in index["files"]:  # each a regular file of its recorded size (a missing or truncated one is named)
        files.check(name)
    problems: list[str] = []
    state: dict[str, Any] = {}
    try:
        state, _ = load_trainer_state(directory)
    except CheckpointError as err:
        problems.append(str(err))
    if verify:
        problems += _verify(directory, index)
    return CheckpointSummary(
        directory=directory,
        state_dict_type=index.get("state_dict_type", "?"),
        world_size=index["world_size"],
        mesh=index["mesh"],
        epoch=state.get("epoch"),
        global_step=state.get("global_step"),
        tensors={k: (list(e.shape), dtype_name(e.dtype)) for k, e in index["tensors"].items()},
        total_bytes=sum(f["size"] for f in index["files"].values()),
        problems=list(dict.fromkeys(problems)),  # a file's damage once, not once per piece it holds
        left_out=sorted(index.get(LEFT_OUT, {})),
        tensor_parallel_size=index.get(TENSOR_PARALLEL_SIZE, 1),
        pipeline=index.get(PIPELINE),
        adapters=sorted(index.get(ADAPTERS, {}).get("adapters", {})),
    )


def _sha256(directory: Location, name: str) -> str:
    if isinstance(directory, Path):
        return sha256_file(directory / name)
    digest = hashlib.sha256()
    with directory.open(name) as f:
        while block := f.read(_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _verify(directory: Location, index: dict[str, Any]) -> list[str]:
    """Every file's SHA-256 against the index, and every piece against its file's header (the header first against
    the index's digest of it, then the piece's key, dtype and shape)."""
    problems = []
    for name, info in index["files"].items():
        try:
            if _sha256(directory, name) != info["sha256"]:
                problems.append(f"{name}: SHA-256 differs from the index")
        except Exception as err:  # noqa: BLE001 - reported, not raised
            problems.append(f"{name}: cannot be read: {err}")
    for entry in index["tensors"].values():
        for piece in entry.pieces():
            try:
                header = entry.files.header(piece.file)
            except CheckpointError as err:  # the file's damage, once for every piece it holds
                problems.append(f"{piece.file}: {err}")
                continue
            try:
                check_piece(entry, piece, header)
            except CheckpointError as err:
                problems.append(f"{piece.file}: {entry.key}: {err}")
    if not index["tensors"]:
        raise CheckpointError(f"{directory} holds no tensors.")
    return problems
