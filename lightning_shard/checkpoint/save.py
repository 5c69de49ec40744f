"""Saving a checkpoint directory from a sharded model: every rank writes its rows, rank 0 the index, atomically.

[Note: atomic checkpoint saves]
Everything is written into a hidden temporary directory next to the target. Once every rank
reports success (one all-gather of small status records), rank 0 writes the index, moves an
existing checkpoint at the target aside, renames the temporary directory into place and deletes
the old one. If any rank fails while writing, every rank raises the failure and the temporary
directory is removed: the checkpoint that was at the target before stays untouched and loadable.
A save killed outright (SIGKILL, a node lost) leaves its hidden temporary directory behind; the
next successful save into the same parent directory removes it (``remove_stale_temporaries``). A save
killed between its two renames leaves the previous checkpoint moved aside (``.<name>.old-<id>``) and
nothing at the target: the next save into the parent puts it back under its name, never deletes it.
Only a checkpoint directory (or an empty one) is ever replaced: a save whose target is anything else
(a file, a non-empty directory without ``index.json``) is refused on every rank before anything is
written.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.agreement import agree, broadcast_str, gather_records
from lightning_shard.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    TRAINER_STATE_JSON,
    TRAINER_STATE_TENSORS,
    CheckpointError,
    dtype_name,
    shard_file_name,
)
from lightning_shard.checkpoint.trainer_state import to_json_tree
from lightning_shard.checkpoint.writer import SafetensorsStreamWriter, sha256_file
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.policies import parse_choice
from lightning_shard.engine.sharded_module import ShardedModule

T = TypeVar("T")


class StateDictType(enum.Enum):
    """How ``trainer.save_checkpoint`` lays out model and optimizer tensors."""

    SHARDED = "sharded"  # every rank writes its own rows; loads at any world size
    FULL = "full"  # gathered one tensor at a time and streamed by rank 0 into model/optimizer.safetensors

    @classmethod
    def parse(cls, value: StateDictType | str) -> StateDictType:
        return parse_choice(cls, value, "state_dict_type")


def save_checkpoint_dir(
    engine: ShardedModule,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    checkpoint: dict[str, Any],
    path: Path,
    layout: StateDictType,
) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a checkpoint directory at ``path``. Collective."""
    prepared = prepare_save(engine, module, optimizers, checkpoint, path, layout)
    prepared.write(prepared.plan.write_local)


def prepare_save(
    engine: ShardedModule,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    checkpoint: dict[str, Any],
    path: Path,
    layout: StateDictType,
) -> PreparedSave:
    """The part of a save every rank must do together on the default group: agree on the temporary directory and
    turn the trainer state into JSON. Collective."""
    checkpoint = dict(checkpoint)
    checkpoint.pop("state_dict", None)
    with_optimizers = checkpoint.pop("optimizer_states", None) is not None
    tmp = Path(broadcast_str(str(path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")))
    tensors: dict[str, Tensor] = {}

    def checked_trainer_state() -> Any:
        if not dist.is_initialized() or dist.get_rank() == 0:  # rank 0 finishes the directory: it looks at the target
            refuse_to_replace_other_data(path)
        return to_json_tree(checkpoint, tensors)

    trainer_state = agree(checked_trainer_state)  # a refused target or an unstorable value fails on every rank
    writer = _ShardedWriter if layout is StateDictType.SHARDED else _FullWriter
    plan = writer(engine, module, list(optimizers) if with_optimizers else [], tmp)
    return PreparedSave(plan, path, layout, trainer_state, tensors)


class PreparedSave:
    """A save whose shared decisions are made: ``write`` writes this rank's file and, with every rank's record,
    rank 0 finishes the directory (see [Note: atomic checkpoint saves])."""

    def __init__(
        self, plan: _Plan, path: Path, layout: StateDictType, trainer_state: Any, tensors: dict[str, Tensor]
    ) -> None:
        self.plan, self.path, self.layout = plan, path, layout
        self.trainer_state, self.tensors = trainer_state, tensors

    def write(self, write_local: Callable[[], dict[str, Any]], group: Any = None) -> None:
        """Run ``write_local`` (this rank's file) and finish the directory, agreeing over ``group``. Collective."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        tmp = self.plan.tmp
        try:
            records = gather_records(agree(write_local, group), group)
            index = self.plan.index(records, self.layout)
            # Rank 0 finishes the directory; agree() so that a failure there is raised on every rank, not a hang.
            finish = lambda: _finish(tmp, self.path, index, self.trainer_state, self.tensors)  # noqa: E731
            agree(lambda: finish() if rank == 0 else None, group)
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise


def _finish(tmp: Path, path: Path, index: dict[str, Any], trainer_state: Any, tensors: dict[str, Tensor]) -> None:
    """Rank 0: trainer state and index into the temporary directory, then swap it in (see [Note: atomic ...])."""
    from safetensors.torch import save_file

    (tmp / TRAINER_STATE_JSON).write_text(json.dumps(trainer_state, indent=1, allow_nan=True))
    save_file(tensors, str(tmp / TRAINER_STATE_TENSORS))
    for name in (TRAINER_STATE_JSON, TRAINER_STATE_TENSORS):
        index["files"][name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
    old = None
    if path.exists() or path.is_symlink():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    remove_stale_temporaries(path.parent)


def refuse_to_replace_other_data(path: Path) -> None:
    """Raise unless ``path`` is free, an empty directory or a checkpoint directory (which a save replaces): a save
    never deletes a file or a directory holding anything else (see [Note: atomic checkpoint saves])."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and ((path / INDEX_FILE).is_file() or not any(path.iterdir())):
        return  # a checkpoint, or an empty directory (made ready for the save): nothing else is lost
    what = "a file" if path.is_file() else "a directory that is not a checkpoint (no index.json)"
    if path.is_symlink() and not path.exists():
        what = "a broken symlink"
    raise CheckpointError(
        f"Refusing to save a checkpoint at {path}: it is {what}, which the save would replace. Remove it or"
        " choose another path; an existing checkpoint directory is replaced atomically."
    )


_STALE = re.compile(r"^\.(.+)\.(tmp|old)-[0-9a-f]{12}$")  # the hidden names saves give their temporary directories


def remove_stale_temporaries(parent: Path) -> list[str]:
    """Clean up what a killed save left in ``parent`` (only hidden directories named as saves name them; never a
    link, never anything else): a ``.<name>.old-<id>`` whose ``<name>`` is missing is the previous checkpoint of a
    save killed between its renames, and is put back under ``<name>``; the other ``.<name>.tmp-<id>`` and
    ``.<name>.old-<id>`` directories are removed. Called by rank 0 after a successful save, when no other save of
    this job is in progress; returns the names removed."""
    removed = []
    stale = [(entry, match) for entry in sorted(parent.iterdir()) if (match := _STALE.match(entry.name))]
    for entry, match in sorted(stale, key=lambda item: item[1].group(2)):  # "old" first: restore before removing
        if not entry.is_dir() or entry.is_symlink():
            continue
        target = parent / match.group(1)
        if match.group(2) == "old" and not (target.exists() or target.is_symlink()):
            os.replace(entry, target)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


# --------------------------------------------------------------------------------------------------
# What each rank writes
# --------------------------------------------------------------------------------------------------


class _Plan:
    """The tensors of a checkpoint: each model parameter once (tied names recorded), buffers, optimizer state."""

    def __init__(self, engine: ShardedModule, module: nn.Module, optimizers: list[Optimizer], tmp: Path) -> None:
        self.engine, self.tmp = engine, tmp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.params: list[tuple[str, ShardedParam]] = []
        self.ties: dict[str, str] = {}
        state = module.state_dict()  # views of the shards and buffers: nothing is copied
        names = set(state.keys())
        for p in engine.sharded_params():
            fqns = [f for f in p.fqns if f in names]
            if not fqns:
                continue
            self.params.append((fqns[0], p))
            self.ties.update({f: fqns[0] for f in fqns[1:]})
        owned = {f for p in engine.sharded_params() for f in p.fqns}
        self.buffers = [(k, v) for k, v in state.items() if k not in owned]
        self.optimizers = [_optimizer_plan(engine, opt, i) for i, opt in enumerate(optimizers)]

    def write_local(self) -> dict[str, Any]:
        """Write what this rank holds into the temporary directory; return its record for the index."""
        raise NotImplementedError

    def index(self, records: list[dict[str, Any]], layout: StateDictType) -> dict[str, Any]:
        """The index from every rank's record."""
        raise NotImplementedError

    def index_base(self, layout: StateDictType) -> dict[str, Any]:
        mesh = self.engine.mesh
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "state_dict_type": layout.value,
            "world_size": self.world_size,
            "mesh": {"replicas": mesh.replicas, "shard_size": mesh.shard_size},
            "sharding_strategy": self.engine.sharding_strategy.value,
            "files": {},
            "ties": {MODEL_PREFIX + k: MODEL_PREFIX + v for k, v in self.ties.items()},
            "optimizers": [meta for meta, _ in self.optimizers],
        } | {"tensors": self._entries()}

    def _entries(self) -> dict[str, dict[str, Any]]:
        entries = {MODEL_PREFIX + fqn: _entry(p.global_shape, p.dtype) for fqn, p in self.params}
        entries |= {MODEL_PREFIX + k: _entry(v.shape, v.dtype) for k, v in self.buffers}
        for _, tensors in self.optimizers:
            for name, p, value in tensors:
                entries[name] = _entry(p.global_shape if p is not None else value.shape, value.dtype)
        return entries


def _optimizer_plan(engine: ShardedModule, optimizer: Optimizer, i: int) -> tuple[dict[str, Any], list[Any]]:
    """JSON metadata of optimizer ``i`` and its tensors as (key, ShardedParam or None, tensor)."""
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    state = optimizer.state_dict()
    params = [q for group in optimizer.param_groups for q in group["params"]]
    missing = [j for j, q in enumerate(params) if id(q) not in by_shard]
    if missing:
        raise CheckpointError(f"Optimizer {i} holds tensors that are not parameters of the sharded model: {missing}.")
    names = [by_shard[id(q)].fqn for q in params]
    groups = []
    for group in state["param_groups"]:
        g = {k: v for k, v in group.items() if k != "params"}
        option_tensors: dict[str, Tensor] = {}
        options = to_json_tree(g, option_tensors, f"optimizer {i}")
        if option_tensors:
            raise CheckpointError(
                f"Optimizer {i} has tensor-valued options ({', '.join(sorted(option_tensors))}): a checkpoint stores"
                f" options as plain values. Pass them as Python numbers (e.g. lr=1e-3, not lr=torch.tensor(1e-3))."
            )
        groups.append({"params": [names[j] for j in group["params"]], "options": options})
    values: dict[str, dict[str, Any]] = {}
    row_states: dict[str, list[str]] = {}  # 0-dim parameters' states split by rows like them (see the format doc)
    tensors: list[Any] = []
    for j, param_state in state["state"].items():
        p = by_shard[id(params[j])]
        for key, value in param_state.items():
            name = f"{OPTIMIZER_PREFIX}{i}/{p.fqn}/{key}"
            if isinstance(value, Tensor):
                sharded = value.dim() > 0 and value.shape == p.sharded.shape
                tensors.append((name, p if sharded else None, value))
                if sharded and not p.global_shape:
                    row_states.setdefault(p.fqn, []).append(key)
            else:
                values.setdefault(p.fqn, {})[key] = to_json_tree(value, {}, name)
    meta: dict[str, Any] = {"param_groups": groups, "values": values}
    if row_states:
        meta["scalar_param_states"] = row_states
    return meta, tensors


class _ShardedWriter(_Plan):
    """Each rank of replica 0 writes its rows of every parameter and per-parameter optimizer tensor; rank 0 also
    writes buffers and scalar optimizer state."""

    def local_tensors(self) -> list[tuple[str, Tensor, tuple[int, int] | None]]:
        """This rank's (key, tensor, rows) to write: views of the shards, optimizer state and buffers."""
        mesh = self.engine.mesh
        if mesh.replicate_rank != 0:
            return []  # replicas hold identical shards: replica 0 writes them
        out: list[tuple[str, Tensor, tuple[int, int] | None]] = []
        for fqn, p in self.params:
            if p.local_rows > 0:
                out.append((MODEL_PREFIX + fqn, p.sharded.detach(), (p.first_row, p.first_row + p.local_rows)))
        for _, tensors in self.optimizers:
            for name, p, value in tensors:
                if p is not None and p.local_rows > 0:
                    out.append((name, value, (p.first_row, p.first_row + p.local_rows)))
                elif p is None and self.rank == 0:
                    out.append((name, value, None))
        if self.rank == 0:
            out.extend((MODEL_PREFIX + k, v, None) for k, v in self.buffers)
        return out

    def write_local(self) -> dict[str, Any]:
        return self.write_tensors(self.local_tensors())

    def write_tensors(self, local: list[tuple[str, Tensor, tuple[int, int] | None]]) -> dict[str, Any]:
        """Write ``local`` (``local_tensors()`` or a copy of them) as this rank's file; return its record."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        if not local:
            return {}
        name = shard_file_name(self.rank, self.world_size)
        writer = SafetensorsStreamWriter(self.tmp / name, [(k, t.dtype, tuple(t.shape)) for k, t, _ in local])
        pieces = {}
        for key, tensor, rows in local:
            crc = writer.write(key, tensor)
            pieces[key] = {"file": name, "key": key, "rows": list(rows) if rows else [0, _rows(tensor)], "crc32": crc}
        writer.close()
        path = self.tmp / name
        return {"file": name, "size": path.stat().st_size, "sha256": sha256_file(path), "pieces": pieces}

    def index(self, records: list[dict[str, Any]], layout: StateDictType) -> dict[str, Any]:
        index = self.index_base(layout)
        for record in records:
            if not record:
                continue
            index["files"][record["file"]] = {"size": record["size"], "sha256": record["sha256"]}
            for key, piece in record["pieces"].items():
                index["tensors"][key]["pieces"].append(piece)
        for entry in index["tensors"].values():
            entry["pieces"].sort(key=lambda piece: piece["rows"][0])
        return index


class _FullWriter(_Plan):
    """Rank 0 streams every full tensor into model.safetensors and optimizer.safetensors, one tensor in memory at a
    time; the other ranks take part in each tensor's all-gather."""

    def write_local(self) -> dict[str, Any]:
        self.tmp.mkdir(parents=True, exist_ok=True)
        records: dict[str, Any] = {"files": {}, "pieces": {}}
        model: list[tuple[str, ShardedParam | None, Tensor]] = [
            (MODEL_PREFIX + fqn, p, p.sharded.detach()) for fqn, p in self.params
        ]
        model += [(MODEL_PREFIX + k, None, v) for k, v in self.buffers]
        self._stream("model.safetensors", model, records)
        optim = [item for _, tensors in self.optimizers for item in tensors]
        if optim:
            self._stream("optimizer.safetensors", optim, records)
        return records

    def _stream(self, file: str, items: list[tuple[str, ShardedParam | None, Tensor]], records: dict[str, Any]) -> None:
        """``items``: (key, the parameter whose rows ``local`` holds, or None if ``local`` is already full, local)."""
        writer = None
        in_file = {k: k.removeprefix(MODEL_PREFIX) for k, _, _ in items}  # model.safetensors: plain state_dict keys
        if self.rank == 0:
            specs = [(in_file[k], t.dtype, tuple(p.global_shape) if p is not None else tuple(t.shape))
                     for k, p, t in items]
            metadata = {"format": FORMAT_NAME, "ties": json.dumps(self.ties)}
            writer = SafetensorsStreamWriter(self.tmp / file, specs, metadata=metadata)
        for key, p, local in items:
            full = self.engine.gather_full(p, local) if p is not None else local
            if writer is not None:
                crc = writer.write(in_file[key], full)
                records["pieces"][key] = {"file": file, "key": in_file[key], "rows": [0, _rows(full)], "crc32": crc}
            del full  # at most one full tensor at a time
        if writer is not None:
            writer.close()
            path = self.tmp / file
            records["files"][file] = {"size": path.stat().st_size, "sha256": sha256_file(path)}

    def index(self, records: list[dict[str, Any]], layout: StateDictType) -> dict[str, Any]:
        index = self.index_base(layout)
        index["files"].update(records[0]["files"])
        for key, piece in records[0]["pieces"].items():
            index["tensors"][key]["pieces"].append(piece)
        return index



def _entry(shape: Sequence[int], dtype: torch.dtype) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": dtype_name(dtype), "pieces": []}


def _rows(t: Tensor) -> int:
    return t.shape[0] if t.dim() > 0 else 1
