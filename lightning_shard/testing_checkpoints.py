"""Checkpoints as a large world writes them, from one process: for tests and benchmarks of how the checkpoint format
scales with the writer's world size.

    from lightning_shard.testing_checkpoints import simulate_save

    model = build_model()                                  # a plain module: full weights, no process group
    simulate_save("ckpt", model, world_size=1024)          # the directory 1,024 FULL_SHARD ranks would write

``simulate_save`` writes the checkpoint directory that ``save_checkpoint`` called on ``world_size`` ranks of a
``FULL_SHARD`` mesh ``(1, world_size)`` writes for the same weights, optimizer state and values: one shard file per
rank (its rows by the rule of [Note: rows by rule], and the tensors it stores whole by [Note: small tensors stored
whole]), the trainer state and the index. It runs the save's own code for everything but the collectives
(``shard_file_tensors`` and ``write_shard_file`` for each simulated rank's file, ``build_index``,
``encode_index``, ``commit``), so the result is what a real save writes; tests check that against a real 2-rank
save. Memory stays at the model (each rank's rows are views of the full tensors).

``simulated_index`` builds, without any tensor or file, the index a save of a model of given parameter shapes would
write at a world size: how big it is, against the limit a load reads (``MAX_JSON_BYTES``). ``reseal_index`` edits a
checkpoint's index and seals it again, for tests of the checks behind the seal.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import (
    FORMAT_VERSION,
    INDEX_FILE,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    CheckpointError,
    new_save_id,
    shard_file_name,
)
from lightning_shard.checkpoint.format.trainer_state import to_json_tree
from lightning_shard.checkpoint.io.files import CheckpointFiles
from lightning_shard.checkpoint.io.index import (
    FileRecord,
    SavedTensor,
    build_index,
    encode_index,
    index_head,
    optimizer_entry,
)
from lightning_shard.checkpoint.io.layout import shard_rows, whole_owners
from lightning_shard.checkpoint.save.commit import commit, refuse_to_replace_other_data
from lightning_shard.checkpoint.save.directory import write_shard_file, write_trainer_state
from lightning_shard.checkpoint.save.optimizer_entries import optimizer_plan
from lightning_shard.checkpoint.save.whole import Held, Local, Rows, shard_file_tensors
from lightning_shard.engine.option_choices import ShardingStrategy, StateDictType


def simulate_save(
    path: str | Path,
    module: nn.Module,
    world_size: int,
    optimizers: Sequence[Optimizer] = (),
    values: Mapping[str, Any] | None = None,
    save_id: str | None = None,
) -> Path:
    """Write the checkpoint directory ``world_size`` FULL_SHARD ranks would write for ``module`` (a plain module
    holding full weights), the state of ``optimizers`` (built on its parameters) and ``values``, at ``path``
    (replaced if it is a checkpoint), as the save ``save_id`` (a new id when None). A 0-dim parameter must have no
    tensor optimizer state (its row-split state cannot be told from scalar state here: refused)."""
    path = Path(path)
    refuse_to_replace_other_data(path)
    params, ties = _parameters(module)
    owned = {id(p) for _, p in module.named_parameters(remove_duplicate=False)}
    buffers = [(k, v) for k, v in module.state_dict(keep_vars=True).items() if id(v) not in owned]
    buffers = [(k, v.detach()) for k, v in buffers]
    by_id = {id(p): (fqn, p.shape, p.shape) for fqn, p in params}
    plans = [optimizer_plan(opt, i, by_id) for i, opt in enumerate(optimizers)]
    _refuse_optimizer_state_of_0_dim_parameters(params, plans)
    optim = [(name, full_of(pid, params), value) for _, tensors in plans for name, pid, value in tensors]

    save_id = save_id or new_save_id()
    tmp = path.parent / f".{path.name}.tmp-{save_id}"
    tmp.mkdir(parents=True)
    records: list[FileRecord] = []
    for shard in range(world_size):
        local = _shard_tensors(shard, world_size, params, optim, buffers)
        records += write_shard_file(tmp / shard_file_name(shard, world_size), shard, local, save_id)
    tensors: dict[str, Tensor] = {}
    records += write_trainer_state(tmp, to_json_tree(dict(values or {}), tensors), tensors)
    contents = [SavedTensor.of(MODEL_PREFIX + fqn, tuple(p.shape), p.dtype, world_size) for fqn, p in params]
    contents += [SavedTensor(MODEL_PREFIX + k, tuple(v.shape), v.dtype, False) for k, v in buffers]
    contents += [SavedTensor.of(name, tuple(full.shape), value.dtype, world_size) if full is not None
                 else SavedTensor(name, tuple(value.shape), value.dtype, False) for name, full, value in optim]
    head = _head(world_size, save_id, {"ties": ties, "optimizers": [meta for meta, _ in plans]})
    commit(tmp, path, encode_index(build_index(head, contents, records)))
    return path


def full_of(pid: int | None, params: list[tuple[str, nn.Parameter]]) -> Tensor | None:
    """The parameter whose id is ``pid`` (``None`` for scalar state)."""
    return None if pid is None else next(p for _, p in params if id(p) == pid)


def _parameters(module: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], dict[str, str]]:
    """Each parameter once, under its first name (``named_parameters()`` order, as the engine names it), and the
    other names of tied parameters mapped to it."""
    first: dict[int, str] = {}
    params: list[tuple[str, nn.Parameter]] = []
    ties: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties[name] = first[id(p)]
        else:
            first[id(p)] = name
            params.append((name, p))
    return params, ties


def _refuse_optimizer_state_of_0_dim_parameters(params: list[tuple[str, nn.Parameter]], plans: list[Any]) -> None:
    """A real rank holds a 0-dim parameter as one row, so Adam's moments of it are split by rows while its ``step``
    is scalar; on the full 0-dim parameter both are 0-dim and cannot be told apart: refused."""
    zero_dim = {fqn for fqn, p in params if p.dim() == 0}
    with_state = {name.split("/", 2)[2].rsplit("/", 1)[0] for _, tensors in plans for name, _, _ in tensors}
    if zero_dim & with_state:
        raise ValueError(
            f"simulate_save does not simulate optimizer state of 0-dim parameters: {sorted(zero_dim & with_state)}."
        )


def _shard_tensors(
    shard: int,
    world_size: int,
    params: list[tuple[str, nn.Parameter]],
    optim: list[tuple[str, Tensor | None, Tensor]],
    buffers: list[tuple[str, Tensor]],
) -> Local:
    """What rank ``shard`` of the simulated world writes, as a real rank decides it (``shard_file_tensors``, from
    views of the rows it would hold, in the order ``local_tensors`` gives them)."""
    full: dict[str, Tensor] = {}

    def rows_of(key: str, shape: torch.Size, value: Tensor) -> Held:
        rows = shape[0] if len(shape) else 1
        lo, hi = shard_rows(rows, world_size, shard)
        full[key] = value.detach()
        return key, value.detach().reshape(rows, *value.shape[1:])[lo:hi], tuple(shape)

    held = [rows_of(MODEL_PREFIX + fqn, p.shape, p) for fqn, p in params]
    held += [rows_of(name, p.shape, value) if p is not None else (name, value, None) for name, p, value in optim]
    held += [(MODEL_PREFIX + k, v, None) for k, v in buffers]

    def gather(whole: Sequence[Rows], owners: dict[str, int]) -> dict[str, Tensor]:
        return {key: full[key].reshape(shape) for key, _, shape in whole if owners[key] == shard}

    return shard_file_tensors(held, shard, world_size, gather)


def simulated_index(
    param_shapes: Mapping[str, tuple[int, ...]],
    world_size: int,
    dtype: torch.dtype = torch.bfloat16,
    optimizer_states: Sequence[str] = ("exp_avg", "exp_avg_sq"),
) -> bytes:
    """The bytes of the ``index.json`` a sharded save by ``world_size`` FULL_SHARD ranks writes for parameters of
    ``param_shapes`` (name -> global shape) with an Adam-like optimizer (``optimizer_states`` shaped like each
    parameter, and a scalar ``step``): built in memory, no tensor allocated, no file written. Raises
    ``CheckpointError`` as a save does when it would exceed ``MAX_JSON_BYTES``."""
    tensors = [SavedTensor.of(MODEL_PREFIX + name, tuple(shape), dtype, world_size)
               for name, shape in param_shapes.items()]
    for name, shape in param_shapes.items():
        tensors.append(SavedTensor(f"{OPTIMIZER_PREFIX}0/{name}/step", (), torch.float32, False))
        tensors += [SavedTensor.of(f"{OPTIMIZER_PREFIX}0/{name}/{state}", tuple(shape), torch.float32, world_size)
                    for state in optimizer_states]
    in_file: list[dict[str, str]] = [{} for _ in range(world_size)]
    in_file[0] = {t.key: t.key for t in tensors if t.key.endswith("/step")}
    owners = whole_owners([(t.key, math.prod(t.shape) * t.dtype.itemsize) for t in tensors
                           if not t.split and not t.key.endswith("/step")], world_size)
    for key, shard in owners.items():
        in_file[shard][key] = key
    digest = hashlib.sha256(b"").hexdigest()
    records = [FileRecord(shard_file_name(s, world_size), 10**11, digest, s, in_file[s], header_sha256=digest)
               for s in range(world_size)]
    records += [FileRecord(name, 10**6, digest, None) for name in ("trainer_state.json", "trainer_state.safetensors")]
    options = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    optimizer = optimizer_entry(0, [(list(param_shapes), options)], {}, {}, {})
    head = _head(world_size, new_save_id(), {"ties": {}, "optimizers": [optimizer]})
    if not param_shapes:
        raise CheckpointError("simulated_index needs at least one parameter.")
    return encode_index(build_index(head, tensors, records))


def _head(world_size: int, save_id: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The index head of a sharded save by ``world_size`` FULL_SHARD ranks."""
    return index_head(StateDictType.SHARDED.value, world_size, (1, world_size), ShardingStrategy.FULL_SHARD.value,
                      save_id, fields)


@contextmanager
def shard_files_read() -> Iterator[list[CheckpointFiles]]:
    """Within it, every view of a checkpoint's shard files that a load makes (a ``CheckpointFiles`` whose
    ``headers_read`` and ``pieces_checked`` say what the load read), in order: for tests and benchmarks that count
    a load's work through the public functions."""
    made: list[CheckpointFiles] = []
    real = CheckpointFiles.__init__

    def remembered(self: CheckpointFiles, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        made.append(self)

    CheckpointFiles.__init__ = remembered  # type: ignore[method-assign]
    try:
        yield made
    finally:
        CheckpointFiles.__init__ = real  # type: ignore[method-assign]
        # a checkpoint's shard files: the views that read headers, not a trainer state's or a model file's
        made[:] = [files for files in made if files.checksums_in_headers and files.headers_read]


def reseal_index(directory: str | Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to the index of the checkpoint at ``directory`` and seal it again: for tests of the checks a
    sealed index would otherwise stop first (see [Note: what a load verifies]). Nothing else is rewritten."""
    path = Path(directory) / INDEX_FILE
    index = json.loads(path.read_text())
    edit(index)
    path.write_bytes(encode_index(index) if index.get("version") == FORMAT_VERSION else json.dumps(index).encode())


def header_digest(path: str | Path) -> str:
    """The digest a sealed index records of the safetensors file ``path``: the SHA-256 of its 8 bytes and header."""
    with open(path, "rb") as f:
        head = f.read(8)
        return hashlib.sha256(head + f.read(int.from_bytes(head, "little"))).hexdigest()
