"""Offline tools on checkpoint directories: consolidate into one model file, and inspect/verify.

No process group is needed, and memory stays bounded by the largest tensor: each full tensor is
assembled from its pieces and streamed into the output file before the next one is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_shard.checkpoint.format import (
    FORMAT_NAME,
    MODEL_PREFIX,
    TRAINER_STATE_JSON,
    CheckpointError,
    crc32,
    dtype_from_name,
    iter_index_tensors,
    model_ties,
    read_index,
    read_json_member,
    read_rows,
    require_complete,
)
from lightning_shard.checkpoint.writer import SafetensorsStreamWriter, sha256_file


def consolidate(checkpoint_dir: str | Path, output: str | Path) -> Path:
    """Write the model of ``checkpoint_dir`` as one ``.safetensors`` file under the LightningModule's state_dict keys.

    Tied weights are stored once; the tie is recorded in the file's metadata (``"ties"``: JSON mapping each
    alias to the stored key). The result loads with ``safetensors.torch.load_file``. An existing file at ``output``
    is replaced; a path inside the checkpoint or a directory is refused.
    """
    directory, output = Path(checkpoint_dir), Path(output)
    index = read_index(directory)
    if output.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(
            f"The consolidated file {output} would be written inside the checkpoint {directory}, whose files it"
            " could replace: write it elsewhere."
        )
    if output.is_dir():
        raise CheckpointError(f"The consolidated file's path {output} is a directory: give a file name.")
    require_complete(directory, index["tensors"])
    model = list(iter_index_tensors(index, MODEL_PREFIX))
    ties = model_ties(index)
    specs = [(key, dtype_from_name(e["dtype"]), tuple(e["shape"])) for key, e in model]
    metadata = {"format": FORMAT_NAME, "ties": json.dumps(ties)}
    tmp = output.with_name(f".{output.name}.tmp")
    writer = SafetensorsStreamWriter(tmp, specs, metadata=metadata)
    try:
        for key, entry in model:
            rows = entry["shape"][0] if entry["shape"] else 1
            writer.write(key, read_rows(directory, entry, 0, rows).reshape(entry["shape"]))
        writer.close()
    except BaseException:
        writer.close_quietly()
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(output)
    return output


@dataclass(frozen=True)
class CheckpointSummary:
    """What ``lightning-shard inspect`` reports."""

    directory: Path
    state_dict_type: str
    world_size: int
    mesh: dict[str, int]
    epoch: int | None
    global_step: int | None
    tensors: dict[str, tuple[list[int], str]]  # index key -> (shape, dtype)
    total_bytes: int
    problems: list[str]  # empty when every file and piece checks out

    def __str__(self) -> str:
        lines = [
            f"checkpoint {self.directory} ({self.state_dict_type}), written by {self.world_size} ranks,"
            f" mesh {self.mesh['replicas']}x{self.mesh['shard_size']}; epoch {self.epoch}, step {self.global_step}",
            f"{len(self.tensors)} tensors, {self.total_bytes / 2**20:.2f} MiB on disk",
        ]
        lines += [f"  {key}  {list(shape)}  {dtype}" for key, (shape, dtype) in self.tensors.items()]
        lines.append("verified: OK" if not self.problems else "PROBLEMS:\n  " + "\n  ".join(self.problems))
        return "\n".join(lines)


def inspect(checkpoint_dir: str | Path, verify: bool = True) -> CheckpointSummary:
    """Summarise a checkpoint directory; with ``verify``, check every file's SHA-256 and every piece's CRC-32."""
    directory = Path(checkpoint_dir)
    index = read_index(directory)
    require_complete(directory, index["tensors"])
    state = read_json_member(directory, TRAINER_STATE_JSON)
    if not isinstance(state, dict):
        raise CheckpointError(f"{directory / TRAINER_STATE_JSON} holds a {type(state).__name__}, not an object.")
    problems: list[str] = []
    if verify:
        problems = _verify(directory, index)
    return CheckpointSummary(
        directory=directory,
        state_dict_type=index.get("state_dict_type", "?"),
        world_size=index["world_size"],
        mesh=index["mesh"],
        epoch=state.get("epoch"),
        global_step=state.get("global_step"),
        tensors={k: (e["shape"], e["dtype"]) for k, e in index["tensors"].items()},
        total_bytes=sum(f["size"] for f in index["files"].values()),
        problems=problems,
    )


def _verify(directory: Path, index: dict[str, Any]) -> list[str]:
    from safetensors import safe_open

    problems = [
        f"{name}: SHA-256 differs from the index" for name, info in index["files"].items()
        if sha256_file(directory / name) != info["sha256"]
    ]
    for key, entry in index["tensors"].items():
        for piece in entry["pieces"]:
            try:
                with safe_open(str(directory / piece["file"]), framework="pt") as f:
                    data = f.get_tensor(piece["key"])
                if crc32(data) != piece["crc32"]:
                    problems.append(f"{piece['file']}: {key} rows {piece['rows']} fail their CRC-32")
            except Exception as err:  # noqa: BLE001 - reported, not raised
                problems.append(f"{piece['file']}: cannot read {key}: {err}")
    if not index["tensors"]:
        raise CheckpointError(f"{directory} holds no tensors.")
    return problems
