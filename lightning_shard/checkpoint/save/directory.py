"""Saving a checkpoint directory from a sharded model: every rank writes its rows, rank 0 the index, atomically.

[Note: atomic checkpoint saves]
Everything is written into a hidden temporary directory next to the target. Once every rank
reports success (``agree``), each rank sends rank 0 the record of the file it wrote (name, size,
SHA-256, shard: a few bytes; only rank 0 receives them all and builds the index), rank 0 writes
the trainer state and the index, moves an existing checkpoint at the target aside, renames the
temporary directory into place and deletes the old one. The index is refused before anything is
committed if it would exceed the size a load reads (``encode_index``). If any rank fails while
writing, every rank raises the failure and the temporary directory is removed: the checkpoint
that was at the target before stays untouched and loadable. A save killed outright (SIGKILL, a
node lost) leaves its hidden temporary directory behind; the next successful save into the same
parent directory removes it (``remove_stale_temporaries``). A save killed between its two renames
leaves the previous checkpoint moved aside (``.<name>.old-<id>``) and nothing at the target: the
next save into the parent puts it back under its name, never deletes it. Only a checkpoint
directory (or an empty one) is ever replaced: a save whose target is anything else (a file, a
non-empty directory without ``index.json``) is refused on every rank before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint import format as checkpoint_format
from lightning_shard.checkpoint.format import (
    FORMAT_NAME,
    MODEL_FILE,
    MODEL_PREFIX,
    OPTIMIZER_FILE,
    TRAINER_STATE_JSON,
    TRAINER_STATE_TENSORS,
    CheckpointError,
    new_save_id,
    shard_file_name,
)
from lightning_shard.checkpoint.format.adapters import ADAPTERS, peft_adapters
from lightning_shard.checkpoint.format.safetensors_header import SAVE_ID_METADATA
from lightning_shard.checkpoint.format.trainer_state import TRAINER_MODEL, TRAINER_OPTIMIZERS, to_json_tree
from lightning_shard.checkpoint.io.agreement import agree, broadcast_str, gather_on_first_rank
from lightning_shard.checkpoint.io.averaged import AVERAGE_FILE, AVERAGE_PREFIX, AVERAGED_MODEL_KEY, AveragedTensors
from lightning_shard.checkpoint.io.index import (
    LEFT_OUT,
    FileRecord,
    SavedTensor,
    build_index,
    encode_index,
    index_head,
    merge_stage_fields,
)
from lightning_shard.checkpoint.io.layout import shard_rows
from lightning_shard.checkpoint.io.selection import (
    MODEL_SELECTION_KEY,
    ModelSelection,
    left_out_fingerprints,
)
from lightning_shard.checkpoint.io.storage import Location, RemoteDirectory
from lightning_shard.checkpoint.io.writer import SafetensorsStreamWriter
from lightning_shard.checkpoint.save.commit import (
    commit,
    commit_remote,
    refuse_foreign_objects,
    refuse_to_replace_other_data,
)
from lightning_shard.checkpoint.save.optimizer_entries import optimizer_entries
from lightning_shard.checkpoint.save.tensor_parallel import tensor_parallel_piece
from lightning_shard.checkpoint.save.whole import Held, Local, Rows, exchange_rows, shard_file_tensors
from lightning_shard.engine.option_choices import StateDictType
from lightning_shard.engine.parallel.pipeline import StageSplit
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.sharded_module import ShardedModule

# (index key, the parameter whose rows the tensor holds or None when it is whole, this rank's tensor)
Item = tuple[str, ShardedParam | None, Tensor]


def save_checkpoint_dir(
    engine: ShardedModule,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    checkpoint: dict[str, Any],
    path: Location,
    layout: StateDictType,
) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a checkpoint directory at ``path`` (a local directory, or a URL:
    see [Note: committing to object storage]). Collective."""
    prepared = prepare_save(engine, module, optimizers, checkpoint, path, layout)
    prepared.write(prepared.plan.write_local)


def prepare_save(
    engine: ShardedModule,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    checkpoint: dict[str, Any],
    path: Location,
    layout: StateDictType,
) -> PreparedSave:
    """The part of a save every rank must do together on the default group: agree on the temporary directory (for a
    URL: the local staging directory and the save's id) and turn the trainer state into JSON. Collective."""
    if engine.mesh.pipeline is not None and layout is StateDictType.FULL:  # every rank, before any collective
        raise CheckpointError(
            f"state_dict_type='full' under pipeline_parallel_size={engine.mesh.pipeline_parallel_size} is not"
            " supported: no rank holds every stage. Save with state_dict_type='sharded' (it loads at any pipeline"
            " size) and write one file with `lightning-shard consolidate`."
        )
    checkpoint = dict(checkpoint)
    checkpoint.pop(TRAINER_MODEL, None)
    averaged = checkpoint.pop(AVERAGED_MODEL_KEY, None)  # see [Note: averaged weights in a checkpoint]
    selection = checkpoint.pop(MODEL_SELECTION_KEY, None)  # see [Note: weights a checkpoint leaves out]
    with_optimizers = checkpoint.pop(TRAINER_OPTIMIZERS, None) is not None
    save_id = new_save_id()
    if isinstance(path, Path):
        tmp = Path(broadcast_str(str(path.parent / f".{path.name}.tmp-{save_id}")))
    else:  # staged locally, then uploaded: see [Note: committing to object storage]
        tmp = Path(broadcast_str(str(Path(tempfile.gettempdir()) / f"lightning-shard-upload-{save_id}")))
    tensors: dict[str, Tensor] = {}

    def checked_trainer_state() -> Any:
        if not dist.is_initialized() or dist.get_rank() == 0:  # rank 0 finishes the directory: it looks at the target
            if isinstance(path, Path):
                refuse_to_replace_other_data(path)
            else:
                refuse_foreign_objects(path)
        tree = to_json_tree(checkpoint, tensors)
        size, limit = len(_trainer_state_json(tree).encode()), checkpoint_format.MAX_JSON_BYTES
        if size > limit:  # a load would refuse it
            raise CheckpointError(
                f"The trainer state would take {size} bytes of JSON, above the {limit} bytes a load reads; nothing"
                " was saved. Keep large values out of the checkpoint dict (store large arrays as tensors)."
            )
        return tree

    trainer_state = agree(checked_trainer_state)  # a refused target or an unstorable value fails on every rank
    writer = _ShardedWriter if layout is StateDictType.SHARDED else _FullWriter
    plan = writer(engine, module, list(optimizers) if with_optimizers else [], tmp, averaged, selection)
    plan.save_id = tmp.name.rsplit("-", 1)[1]  # rank 0's, as every rank received it
    if not isinstance(path, Path):  # every file under this save's id: nothing at the URL is overwritten
        plan.file_prefix = plan.save_id + "."
    return PreparedSave(plan, path, layout, trainer_state, tensors)


class PreparedSave:
    """A save whose shared decisions are made: ``write`` writes this rank's file and, with every rank's record,
    rank 0 finishes the directory (see [Note: atomic checkpoint saves])."""

    def __init__(
        self, plan: _Plan, path: Location, layout: StateDictType, trainer_state: Any, tensors: dict[str, Tensor]
    ) -> None:
        self.plan, self.path, self.layout = plan, path, layout
        self.trainer_state, self.tensors = trainer_state, tensors

    def write(self, write_local: Callable[[], list[FileRecord]], group: Any = None) -> None:
        """Run ``write_local`` (this rank's file) and finish the directory, agreeing over ``group``. Collective."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        tmp, remote = self.plan.tmp, self.path if not isinstance(self.path, Path) else None
        if remote is not None:  # each rank uploads what it wrote, in parallel with the others
            write_local = _then_upload(write_local, tmp, remote)
        try:
            written = agree(write_local, group)
            part = self.plan.stage_part(self.layout)  # what a pipeline stage adds to the index; None otherwise
            sent = gather_on_first_rank({"files": [dataclasses.asdict(r) for r in written], "stage": part}, group)
            # Rank 0 finishes the directory; agree() so that a failure there is raised on every rank, not a hang.
            agree(lambda: _finish(self, [FileRecord(**r) for one in sent for r in one["files"]],
                                  [one["stage"] for one in sent if one["stage"] is not None])
                  if sent is not None else None, group)
        except BaseException:
            if rank == 0 or remote is not None:  # a staging directory is every rank's to remove
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if remote is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _then_upload(
    write_local: Callable[[], list[FileRecord]], tmp: Path, remote: RemoteDirectory
) -> Callable[[], list[FileRecord]]:
    """``write_local``, then the upload of the files it wrote (see [Note: committing to object storage])."""

    def write_and_upload() -> list[FileRecord]:
        records = write_local()
        for record in records:
            remote.put_file(tmp / record.name, record.name)
            (tmp / record.name).unlink()  # the staging copy is no longer needed
        return records

    return write_and_upload


def _finish(save: PreparedSave, records: list[FileRecord], stages: list[dict[str, Any]]) -> None:
    """Rank 0: the trainer state, then the index from every file's record (and every pipeline stage's part), then
    the swap (see [Note: atomic ...])."""
    tmp = save.plan.tmp
    state_records = write_trainer_state(tmp, save.trainer_state, save.tensors, save.plan.file_prefix)
    index = encode_index(save.plan.index(records + state_records, save.layout, stages))
    if isinstance(save.path, Path):
        commit(tmp, save.path, index)
    else:
        commit_remote(tmp, save.path, state_records, index)


def _trainer_state_json(tree: Any) -> str:
    return json.dumps(tree, indent=1, allow_nan=True)


def write_trainer_state(
    tmp: Path, trainer_state: Any, tensors: dict[str, Tensor], prefix: str = ""
) -> list[FileRecord]:
    """Rank 0: ``trainer_state.json`` and ``trainer_state.safetensors`` (named with ``prefix``) into the temporary
    directory."""
    from safetensors.torch import save

    tmp.mkdir(parents=True, exist_ok=True)
    json_name, tensors_name = prefix + TRAINER_STATE_JSON, prefix + TRAINER_STATE_TENSORS
    (tmp / json_name).write_text(_trainer_state_json(trainer_state))
    (tmp / tensors_name).write_bytes(save(tensors))  # a few values; written as open() does, under the umask
    return [FileRecord.written(tmp / name) for name in (json_name, tensors_name)]


# --------------------------------------------------------------------------------------------------
# What each rank writes
# --------------------------------------------------------------------------------------------------


class _Plan:
    """The tensors of a checkpoint: each model parameter once (tied names recorded), buffers, optimizer state."""

    def __init__(
        self,
        engine: ShardedModule,
        module: nn.Module,
        optimizers: list[Optimizer],
        tmp: Path,
        averaged: AveragedTensors | None = None,
        selection: ModelSelection | None = None,
    ) -> None:
        self.engine, self.tmp = engine, tmp
        self.file_prefix = ""  # "<save-id>." for a save to a URL (see [Note: committing to object storage])
        self.save_id = new_save_id()  # every rank's the same once ``prepare_save`` has set it
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
        position = {name: i for i, name in enumerate(state)}  # the module's order, not the units': files and index
        self.params.sort(key=lambda item: position[item[0]])  # are the same whatever the wrap policy
        owned = {f for p in engine.sharded_params() for f in p.fqns}
        self.buffers = [(k, v) for k, v in state.items() if k not in owned]
        self.left_out: dict[str, str] = {}  # see [Note: weights a checkpoint leaves out]
        if selection is not None and not selection.keeps_everything:
            keep = {k for k, p in self.params if selection.keeps_parameter(k, state[k], p)}
            keep |= {k for k, v in self.buffers if selection.keeps_buffer(k, v)}
            self.left_out = left_out_fingerprints(engine, [item for item in self.params if item[0] not in keep],
                                                  [item for item in self.buffers if item[0] not in keep])
            self.params = [item for item in self.params if item[0] in keep]
            self.buffers = [item for item in self.buffers if item[0] in keep]
            self.ties = {alias: name for alias, name in self.ties.items() if name in keep}
        pipeline = engine.mesh.pipeline
        if pipeline is not None:  # a weight tied across stages is written by its first stage
            self.params = [(k, p) for k, p in self.params if id(p.sharded) not in pipeline.held_earlier]
        kept_names = {f for _, p in self.params for f in p.fqns}
        self.optimizers = [optimizer_entries(engine, opt, i, kept_names) for i, opt in enumerate(optimizers)]
        self.averaged = _averaged_plan(averaged, self.params, self.buffers)
        self.adapters = peft_adapters(module)  # see [Note: adapters recorded at save time]
        stage = engine.pipeline_stage  # the pipelined submodule's name and its split, as the engine holds them
        self.pipeline_split: tuple[str, StageSplit] | None = None if stage is None else (stage.prefix, stage.split)

    def write_local(self) -> list[FileRecord]:
        """Write what this rank holds into the temporary directory; return the records of the files it wrote."""
        raise NotImplementedError

    def parts(self) -> tuple[list[Item], list[Item], list[Item], list[Item]]:
        """What this rank holds, as ``Item``s: the model's parameters, the optimizers' tensors, the averaged weights
        and the buffers."""
        params: list[Item] = [(MODEL_PREFIX + fqn, p, p.sharded.detach()) for fqn, p in self.params]
        optim = [item for _, tensors in self.optimizers for item in tensors]
        return params, optim, self.averaged, [(MODEL_PREFIX + k, None, v) for k, v in self.buffers]

    def tensors_and_head(self, layout: StateDictType) -> tuple[list[SavedTensor], dict[str, Any]]:
        """Every tensor this save stores of what this rank holds (its stage's under pipeline parallelism), in the
        index's order, and the index fields that follow from the model and optimizers: ties, optimizers, left-out
        weights, adapters."""
        shards = self.engine.mesh.shard_size if layout is StateDictType.SHARDED else None
        params, optim, averaged, buffers = self.parts()
        saved = [SavedTensor.of(key, tuple(p.full_shape) if p is not None else tuple(t.shape), t.dtype,
                                shards if p is not None else None)
                 for key, p, t in params + buffers + optim + averaged]
        head: dict[str, Any] = {"ties": self.ties, "optimizers": [meta for meta, _ in self.optimizers]}
        if self.left_out:
            head[LEFT_OUT] = self.left_out
        if self.adapters is not None:
            head[ADAPTERS] = self.adapters
        return saved, head

    def stage_part(self, layout: StateDictType) -> dict[str, Any] | None:
        """Under pipeline parallelism, on the first rank of each stage: ``tensors_and_head`` as JSON, for rank 0's
        index (see [Note: pipeline-parallel checkpoints]); ``None`` on every other rank."""
        mesh = self.engine.mesh
        if mesh.pipeline is None or mesh.pipeline.is_first or self.rank != mesh.stage_offset:
            return None
        saved, head = self.tensors_and_head(layout)
        return {"tensors": [t.to_json() for t in saved], "head": head}

    def index(self, records: list[FileRecord], layout: StateDictType,
              stages: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:  # fmt: skip
        """The index, from the records of every file written and the later pipeline stages' parts (rank 0)."""
        mesh = self.engine.mesh
        saved, fields = self.tensors_and_head(layout)
        for stage in stages:  # see [Note: pipeline-parallel checkpoints]
            saved += [SavedTensor.from_json(entry) for entry in stage["tensors"]]
            fields = merge_stage_fields(fields, stage["head"])
        pipeline = None
        if self.pipeline_split is not None:
            module, split = self.pipeline_split
            pipeline = {"size": split.stages, "module": module, **split.to_json()}
        head = index_head(layout.value, self.world_size, (mesh.replicas, mesh.shard_size),
                          self.engine.sharding_strategy.value, self.save_id, fields, mesh.tensor_parallel_size,
                          pipeline)
        return build_index(head, saved, records)


def _averaged_plan(
    averaged: AveragedTensors | None, params: list[tuple[str, ShardedParam]], buffers: list[tuple[str, Tensor]]
) -> list[Item]:
    """The averaged tensors a save stores, under ``"average/" + the model's key``, in the model's order (see [Note:
    averaged weights in a checkpoint])."""
    if averaged is None:
        return []
    out: list[Item] = []
    for fqn, p in params:
        tensor = next((averaged.tensors[f] for f in p.fqns if f in averaged.tensors), None)
        if tensor is None or tensor.shape != p.sharded.shape:
            raise CheckpointError(f"Internal error: the averaged weights hold no tensor shaped like {fqn}'s shard.")
        out.append((AVERAGE_PREFIX + fqn, p, tensor.detach()))
    out += [(AVERAGE_PREFIX + k, None, averaged.tensors[k].detach()) for k, _ in buffers if k in averaged.tensors]
    return out


class _ShardedWriter(_Plan):
    """Each rank of replica 0 writes its rows of the parameters and per-parameter optimizer tensors split by rows
    (see [Note: rows by rule]) and the small ones it stores whole (see [Note: small tensors stored whole]); rank 0
    also writes buffers and scalar optimizer state."""

    def local_tensors(self) -> Local:
        """This rank's (key, tensor, rows) to write: views of its rows of the tensors split by rows, the tensors it
        stores whole (received from the other shards: see [Note: small tensors stored whole]), and on rank 0 buffers
        and scalar optimizer state. Collective over the shard group (replica 0's ranks)."""
        mesh = self.engine.mesh
        if mesh.replicate_rank != 0:
            return []  # replicas hold identical shards: replica 0 writes them
        if mesh.tensor_parallel_size > 1 or mesh.pipeline is not None:
            return self._listed_tensors()
        for fqn, p in self.params:  # the index records the rule, not the rows: they must agree
            rows = (p.first_row, p.first_row + p.local_rows)
            if p.local_rows and (p.shard_size != mesh.shard_size or rows != shard_rows(p.rows, mesh.shard_size,
                                                                                      mesh.shard_rank)):
                raise CheckpointError(f"Internal error: {fqn} holds rows {rows}, not those of shard {mesh.shard_rank}.")
        params, optim, averaged, buffers = self.parts()  # averaged: see [Note: averaged weights in a checkpoint]
        held: list[Held] = [(key, value, tuple(p.global_shape) if p is not None else None)
                            for key, p, value in params + optim + buffers + averaged]

        def gather(whole: Sequence[Rows], owners: dict[str, int]) -> dict[str, Tensor]:
            return exchange_rows(whole, owners, mesh.shard_rank, mesh.shard_size, mesh.shard_group, self.engine.device)

        return shard_file_tensors(held, mesh.shard_rank, mesh.shard_size, gather)

    def _listed_tensors(self) -> list[tuple[str, Tensor, tuple[int, int] | None]]:
        """``local_tensors`` under tensor or pipeline parallelism: every rank's pieces, rows of the whole tensors
        listed in the index (see [Note: tensor-parallel checkpoints], [Note: pipeline-parallel checkpoints])."""
        mesh = self.engine.mesh
        writes_whole = self.rank == mesh.stage_offset  # the first rank of its stage (the world's without pipeline)
        out: list[tuple[str, Tensor, tuple[int, int] | None]] = []
        params, optim, averaged, buffers = self.parts()
        for key, p, value in params + optim + averaged + buffers:
            if p is None:  # a buffer, or scalar optimizer state: whole, by the stage's first rank
                if writes_whole:
                    out.append((key, value, None))
                continue
            piece = tensor_parallel_piece(p, value, mesh.tensor_parallel_size, mesh.tensor_parallel_rank)
            if piece is not None:
                out.append((key, *piece))
        return out

    def write_local(self) -> list[FileRecord]:
        return self.write_tensors(self.local_tensors())

    def write_tensors(self, local: Local) -> list[FileRecord]:
        """Write ``local`` (``local_tensors()`` or a copy of them) as this rank's file; return its record (none on
        the ranks of other replicas than replica 0, which write nothing)."""
        if self.engine.mesh.replicate_rank != 0:
            return []
        self.tmp.mkdir(parents=True, exist_ok=True)
        path = self.tmp / (self.file_prefix + shard_file_name(self.rank, self.world_size))
        if self.engine.mesh.tensor_parallel_size > 1 or self.engine.mesh.pipeline is not None:  # pieces listed
            return write_shard_file(path, None, local, self.save_id, listed=True)
        return write_shard_file(path, self.engine.mesh.shard_rank, local, self.save_id)


def write_shard_file(
    path: Path, shard: int | None, local: Local, save_id: str, listed: bool = False
) -> list[FileRecord]:
    """Write one shard's tensors (key, tensor, its rows or ``None`` when stored whole) as the safetensors file
    ``path``, the CRC-32s of its data in its header; its record. Every shard writes its file, also one holding
    nothing (a shard of more shards than a tensor has rows, or whose tensors are all stored whole elsewhere: see
    [Note: small tensors stored whole]): a sharded checkpoint holds one shard file per writing rank, each recording
    ``save_id`` (see [Note: what a load verifies]). With ``listed``
    (tensor parallelism) the record lists the rows of each piece, for the index to list. The tensors stored whole
    come first, then the pieces, each in ``local``'s order (see [Note: small tensors stored whole])."""
    local = sorted(local, key=lambda item: item[2] is not None)
    with SafetensorsStreamWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t, _ in local],
                                 metadata={SAVE_ID_METADATA: save_id}, checksums=True) as writer:
        for key, tensor, _ in local:
            writer.write(key, tensor)
    pieces = {key: [rows[0], rows[1]] for key, _, rows in local if rows is not None} if listed else {}
    whole = {key: key for key, _, rows in local if rows is None}
    return [FileRecord.written(path, shard, whole, pieces, writer.header_sha256)]


class _FullWriter(_Plan):
    """Rank 0 streams every full tensor into model.safetensors and optimizer.safetensors, one tensor in memory at a
    time; the other ranks take part in each tensor's all-gather."""

    def write_local(self) -> list[FileRecord]:
        self.tmp.mkdir(parents=True, exist_ok=True)
        params, optim, averaged, buffers = self.parts()
        records = self._stream(self.file_prefix + MODEL_FILE, params + buffers)
        if optim:
            records += self._stream(self.file_prefix + OPTIMIZER_FILE, optim)
        if averaged:
            records += self._stream(self.file_prefix + AVERAGE_FILE, averaged)
        return records

    def _stream(self, file: str, items: list[Item]) -> list[FileRecord]:
        """Gather each of ``items`` in turn; rank 0 writes them into ``file`` (the model's under their state_dict
        keys)."""
        in_file = {k: k.removeprefix(MODEL_PREFIX) for k, _, _ in items}
        specs = [(in_file[k], t.dtype, tuple(p.full_shape) if p is not None else tuple(t.shape)) for k, p, t in items]
        metadata = {"format": FORMAT_NAME, "ties": json.dumps(self.ties), SAVE_ID_METADATA: self.save_id}
        writer = SafetensorsStreamWriter(self.tmp / file, specs, metadata, checksums=True) if self.rank == 0 else None
        with writer or nullcontext():
            for key, p, local in items:
                full = self.engine.gather_whole(p, local) if p is not None else local
                if writer is not None:
                    writer.write(in_file[key], full)
                del full  # at most one full tensor at a time
        if writer is None:
            return []
        return [FileRecord.written(self.tmp / file, None, in_file, header_sha256=writer.header_sha256)]
