"""Loading a checkpoint directory into a sharded model (and, for a module that is not sharded, its full tensors).

Each rank reads only the rows of each tensor that its shards hold, whatever world size, mesh,
sharding strategy or wrap policy wrote the checkpoint, opening only the files that hold them (see
[Note: reading only what a rank needs]). Every load step ends with the ranks agreeing on success, so
a damaged file stops all ranks with the same error instead of leaving some waiting.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import (
    INDEX_FILE,
    MAX_JSON_BYTES,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    TRAINER_STATE_JSON,
    TRAINER_STATE_TENSORS,
    CheckpointError,
    check_loadable,
    member_named,
)
from lightning_shard.checkpoint.format.trainer_state import from_json_tree
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.io.index import LEFT_OUT, checkpoint_files, iter_index_tensors, model_ties, read_index
from lightning_shard.checkpoint.io.layout import StoredTensor, require_complete
from lightning_shard.checkpoint.io.reader import FileHandles, RowReads, read_tensor
from lightning_shard.checkpoint.io.selection import expect_left_out
from lightning_shard.checkpoint.io.storage import Location
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.sharded_module import ShardedModule, sharded_module_of
from lightning_shard.engine.whole_tensor_step import note_loaded_split


@dataclass(frozen=True)
class LoadResult:
    """Keys the model expected but the checkpoint lacks, and keys the checkpoint has but the model does not."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_trainer_state(
    directory: Location, index: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict without model and optimizer tensors, and the index (``index``, when it was read
    already). Never unpickles. Both files are read whole and, in a sealed checkpoint, checked against their SHA-256
    first (see [Note: what a load verifies])."""
    from safetensors.torch import load

    index = read_index(directory) if index is None else index
    files = checkpoint_files(directory, index)
    json_name, tensors_name = (member_named(index["files"], n) for n in (TRAINER_STATE_JSON, TRAINER_STATE_TENSORS))
    if index["files"].get(json_name, {}).get("size", 0) > MAX_JSON_BYTES:
        raise CheckpointError(f"{directory / json_name} is larger than {MAX_JSON_BYTES} bytes, which no checkpoint"
                              " writes; not read.")
    state_json = _parsed(directory / json_name, files.read_all(json_name), json.loads)
    tensors = _parsed(directory / tensors_name, files.read_all(tensors_name), load)
    try:
        state = from_json_tree(state_json, tensors)
    except Exception as err:  # noqa: BLE001 - damaged, or the two files do not agree: name them
        raise CheckpointError(
            f"The trainer state in {directory / json_name} (with {tensors_name}) cannot be decoded"
            f" ({type(err).__name__}: {err}): it is damaged. Use another checkpoint, or save this one again."
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{directory / json_name} holds a {type(state).__name__}, not an object.")
    return state, index


def _parsed(path: Any, data: bytes, parse: Callable[[bytes], Any]) -> Any:
    """``parse(data)``, the contents of the file ``path``; what it cannot parse is a ``CheckpointError`` naming it."""
    try:
        return parse(data)
    except Exception as err:  # noqa: BLE001 - a damaged file: name it
        raise CheckpointError(
            f"Checkpoint file {path} cannot be read ({type(err).__name__}: {err}): it is damaged. Use another"
            " checkpoint, or save this one again."
        ) from None


def sharded_engine(module: nn.Module, caller: str, error: type[Exception] = CheckpointError) -> ShardedModule:
    """The engine that sharded ``module``, for ``caller`` (``"load_gguf_into()"``); ``error`` when there is none."""
    engine = sharded_module_of(module)
    if engine is None:
        raise error(
            f"{caller} needs the model lightning_shard has sharded (the LightningModule after the Trainer set it up,"
            " e.g. from on_fit_start, the module fabric.setup_module() returned, or the one given to shard_model());"
            f" this {type(module).__name__} is not sharded."
        )
    return engine


def load_model(
    engine: ShardedModule, module: nn.Module, directory: Location, index: dict[str, Any], strict: bool = True
) -> LoadResult:
    """Copy this rank's rows of every parameter (and every buffer) from the checkpoint into ``module``. Collective."""
    return load_model_and_optimizers(engine, module, None, directory, index, strict)


def load_optimizers(
    engine: ShardedModule, optimizers: Sequence[Optimizer], directory: Location, index: dict[str, Any],
    strict: bool = True,
) -> None:
    """Load every optimizer's state (this rank's rows of per-parameter tensors) from the checkpoint. Collective.

    With ``strict=False``, parameters the checkpoint does not know start with fresh optimizer state."""
    load_model_and_optimizers(engine, None, optimizers, directory, index, strict)


def load_model_and_optimizers(
    engine: ShardedModule,
    module: nn.Module | None,
    optimizers: Sequence[Optimizer] | None,
    directory: Location,
    index: dict[str, Any],
    strict: bool = True,
) -> LoadResult:
    """``load_model`` (unless ``module`` is ``None``), then ``load_optimizers`` (unless ``optimizers`` is ``None``),
    in one read: each shard file is opened once for both (see [Note: reading only what a rank needs]). Collective."""
    ties = model_ties(index)
    entries = dict(iter_index_tensors(index, MODEL_PREFIX))
    result, available = LoadResult([], []), set[str]()
    plan, buffers, mismatched = model_targets(engine, module, entries, ties) if module is not None else ([], [], [])
    if module is not None:
        available = covered_keys(engine, set(entries) | set(ties))
        # A checkpoint that left weights out: they are checked before the next forward instead of counting as missing
        # (see [Note: weights a checkpoint leaves out]).
        accounted = expect_left_out(engine, module, index.get(LEFT_OUT, {}), directory, strict)
        available -= other_stages_keys(module, available)  # see [Note: the user's forward runs on every stage]
        result = check_model_keys(module, available | accounted, strict, "The checkpoint", mismatched)

    def read() -> tuple[RowReads, list[Tensor], list[dict[str, Any]]]:
        reads = RowReads()
        if mismatched:  # checked before anything is allocated or read
            raise CheckpointError("Checkpoint tensors do not match the model's shapes: " + "; ".join(mismatched))
        require_complete(directory, entries, [key for key, _ in plan] + [key for key, _ in buffers])
        for key, p in plan:  # a failure stops all ranks via agree()
            start, stop, columns = p.rows_in_full()
            reads.add(entries[key], start, stop, p.sharded, columns)
        for key, buf in buffers:
            reads.add(entries[key], 0, entries[key].rows, buf)
        pending: list[_Pending] = []
        saved = index.get("optimizers", [])  # ``optimizers`` must be all the checkpoint holds
        if optimizers is not None and len(saved) != len(optimizers):
            raise CheckpointError(f"The checkpoint holds {len(saved)} optimizer states; the model has"
                                  f" {len(optimizers)}.")
        states = [_optimizer_state(engine, opt, i, meta, directory, index, strict, reads, pending)
                  for i, (opt, meta) in enumerate(zip(optimizers or [], saved))]
        results = reads.read()
        for slot in pending:
            slot.into[slot.name] = results[slot.result].reshape(slot.shape)
        return reads, results, states

    reads, results, states = agree(read)  # see [Note: a failed load changes nothing]
    reads.commit(results)
    if module is not None:
        engine.mark_initialized(available)  # see [Note: parameters nothing initialises]
    for i, (optimizer, state) in enumerate(zip(optimizers or [], states)):
        optimizer.load_state_dict(state)
        _tell_whole_states(engine, optimizer, index["optimizers"][i])
    return result


# [Note: a failed load changes nothing]
# Every tensor a load reads lands in a new tensor first, checked (see [Note: every byte that lands is checked]); the
# ranks then agree that every one of them read everything, and only then are the model's shards and buffers
# overwritten (``RowReads.commit``) and the optimizers given their new state. A load that fails on any rank (a
# damaged or missing file, a model that does not match) raises on every rank and leaves every model and optimizer as
# it was, so a job can catch the error and load an older checkpoint. The cost: while a load runs, a rank holds a
# second copy of its rows of the model (in the checkpoint's dtype); the optimizer's state is read into the tensors
# it then keeps, so it costs nothing more (docs/checkpoint_format.md).


class _Pending(NamedTuple):
    """An optimizer state tensor a ``RowReads`` is reading: where it goes once read, and in what shape."""

    into: dict[str, Any]
    name: str
    result: int
    shape: tuple[int, ...]


def covered_keys(engine: ShardedModule, stored: set[str]) -> set[str]:
    """The model keys a checkpoint storing ``stored`` fills: a tied weight stored under any one of its names covers
    them all."""
    covered = set(stored)
    for p in engine.sharded_params():
        if covered.intersection(p.fqns):
            covered |= set(p.fqns)
    return covered


def other_stages_keys(module: nn.Module, keys: set[str]) -> set[str]:
    """The keys of ``keys`` that other pipeline stages hold: those under a ``SkippedModule`` of ``module``."""
    from lightning_shard.engine.parallel.pipeline import SkippedModule

    skipped = [name + "." for name, m in module.named_modules() if isinstance(m, SkippedModule)]
    if not skipped:
        return set()
    own = set(module.state_dict())  # a skipped module keeps the weights this stage shares with it (tied)
    return {key for key in keys if key not in own and any(key.startswith(prefix) for prefix in skipped)}


def check_model_keys(
    module: nn.Module, available: set[str], strict: bool, source: str, shape_mismatches: Sequence[str] = ()
) -> LoadResult:
    """The model's missing and unexpected keys against ``available``; with ``strict`` either kind raises, naming
    ``source`` (what is being loaded). ``shape_mismatches``: the keys both hold in other shapes, as described by
    ``model_targets``; then ``strict_loading = False`` would not help, and the error does not suggest it."""
    expected = set(module.state_dict().keys())
    result = LoadResult(sorted(expected - available), sorted(available - expected))
    if strict and (result.missing_keys or result.unexpected_keys):
        head = (f"{source} does not match the model: missing keys {_some(result.missing_keys)}, unexpected keys"
                f" {_some(result.unexpected_keys)}.")
        if shape_mismatches:
            raise CheckpointError(
                f"{head} Of the keys both have, {len(shape_mismatches)} differ in shape ({_some(shape_mismatches)}):"
                " it is a checkpoint of another model, which strict_loading = False would not load either. Load it"
                " into the model that saved it."
            )
        raise CheckpointError(f"{head} Set LightningModule.strict_loading = False to load the keys that match.")
    return result


def _some(items: Sequence[str], shown: int = 8) -> str:
    """At most ``shown`` items of a list, and how many more there are."""
    listed = ", ".join(items[:shown])
    return f"[{listed}, and {len(items) - shown} more]" if len(items) > shown else f"[{listed}]"


def optimizer_groups(
    engine: ShardedModule, optimizer: Optimizer, what: str
) -> tuple[list[list[str]], dict[str, int]]:
    """The names of the parameters of each of ``optimizer``'s groups, and the position of each in its state dict;
    ``what`` names the optimizer when it holds a tensor that is not a sharded parameter of ``engine``."""
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    unknown = [q for g in optimizer.param_groups for q in g["params"] if id(q) not in by_shard]
    if unknown:
        raise CheckpointError(f"{what}: the optimizer holds {len(unknown)} tensors that are not sharded parameters.")
    groups = [[by_shard[id(q)].fqn for q in g["params"]] for g in optimizer.param_groups]
    return groups, {name: j for j, name in enumerate(n for g in groups for n in g)}


def check_named_groups(
    stored_groups: Sequence[Sequence[Any]], groups: Sequence[Sequence[str]], what: str, strict: bool
) -> None:
    """A name-keyed optimizer state's groups hold the names of the optimizer's groups (with ``strict=False``, the
    same number of groups suffices: parameters the checkpoint does not know start fresh)."""
    stored = [sorted(map(str, g)) for g in stored_groups]
    if stored != [sorted(g) for g in groups] and (strict or len(stored) != len(groups)):
        raise CheckpointError(
            f"{what} has parameter groups {[list(g) for g in stored_groups]}, the model's optimizer has"
            f" {[list(g) for g in groups]}."
        )


def model_targets(
    engine: ShardedModule, module: nn.Module, stored: Mapping[str, Any], ties: Mapping[str, str]
) -> tuple[list[tuple[str, ShardedParam]], list[tuple[str, Tensor]], list[str]]:
    """What of the model each tensor of ``stored`` (key -> anything with a ``shape`` and a ``dtype``) fills, as
    ``(key, parameter)`` and ``(key, buffer)`` (a tied weight through the name ``ties`` says it is stored under), and
    each of those that cannot be loaded, described (``check_loadable``)."""
    plan = [(key, p) for p in engine.sharded_params()
            if (key := next((ties.get(f, f) for f in p.fqns if ties.get(f, f) in stored), None)) is not None]
    owned = {f for p in engine.sharded_params() for f in p.fqns}
    buffers = [(ties.get(k, k), b) for k, b in module.named_buffers(remove_duplicate=False)
               if ties.get(k, k) in stored and k not in owned]
    targets = [(key, p.full_shape, p.dtype) for key, p in plan] + [(key, b.shape, b.dtype) for key, b in buffers]
    problems = [problem for key, shape, dtype in targets
                if (problem := check_loadable(key, stored[key].shape, stored[key].dtype, shape, dtype))]
    return plan, buffers, problems


def _tell_whole_states(engine: ShardedModule, optimizer: Optimizer, meta: dict[str, Any]) -> None:
    """Hand the index's ``whole_param_states`` to an optimizer that runs each tensor whole (``note_loaded_split``)."""
    whole = meta.get("whole_param_states", {})
    by_shard = {id(p.sharded): p.fqn for p in engine.sharded_params()}
    held = [q for group in optimizer.param_groups for q in group["params"] if id(q) in by_shard]
    note_loaded_split(optimizer, {id(q): set(whole.get(by_shard[id(q)], ())) for q in held})


def _optimizer_state(
    engine: ShardedModule,
    optimizer: Optimizer,
    i: int,
    meta: dict[str, Any],
    directory: Location,
    index: dict[str, Any],
    strict: bool,
    reads: RowReads,
    pending: list[_Pending],
) -> dict[str, Any]:
    """Optimizer ``i``'s state dict, its per-parameter tensors to be filled from ``reads`` (added to it and to
    ``pending`` here)."""
    current, position = optimizer_groups(engine, optimizer, f"Optimizer {i}")
    stored = [group["params"] for group in meta["param_groups"]]
    if engine.mesh.pipeline is not None:  # a pipeline stage's optimizer holds its own parameters only
        held = {name for group in current for name in group}
        stored = [[name for name in group if name in held] for group in stored]
    check_named_groups(stored, current, f"Optimizer {i} in the checkpoint", strict)
    groups = []
    for group, names_in_group in zip(meta["param_groups"], current):
        options = _decoded(group["options"], f"Optimizer {i}'s options", directory)
        groups.append({**options, "params": [position[n] for n in names_in_group]})
    state: dict[int, dict[str, Any]] = {}
    sharded = {p.fqn: p for p in engine.sharded_params()}
    entries = [(key, entry) for key, entry in iter_index_tensors(index, f"{OPTIMIZER_PREFIX}{i}/")
               if key.rsplit("/", 1)[0] in position]  # strict=False: the model may no longer have a parameter
    whole_states = meta.get("whole_param_states", {})  # see docs/checkpoint_format.md; checked by read_index
    whole = {f"{fqn}/{name}" for fqn, names in whole_states.items() for name in names}
    _check_optimizer_shapes(i, [(k, e) for k, e in entries if k not in whole], sharded)  # before anything is read
    require_complete(directory, dict(entries))
    row_states = meta.get("scalar_param_states", {})  # see docs/checkpoint_format.md; checked by read_index
    for key, entry in entries:  # each read into a tensor shaped as the model's rows, as saved whole, or 0-dim
        fqn, name = key.rsplit("/", 1)
        p = sharded[fqn]
        slot = state.setdefault(position[fqn], {})  # load_state_dict() moves each tensor as the optimizer wants
        if key in whole:  # every rank held it whole (Adafactor's row and column statistics): so does each again
            pending.append(_Pending(slot, name, reads.add(entry, 0, entry.rows), entry.shape))
        elif entry.shape or (not p.global_shape and name in row_states.get(fqn, ())):
            start, stop, columns = p.rows_in_full()
            read = reads.add(entry, start, stop, columns=columns)
            pending.append(_Pending(slot, name, read, tuple(p.sharded.shape)))
        else:
            pending.append(_Pending(slot, name, reads.add(entry, 0, 1), ()))
    for fqn, values in meta.get("values", {}).items():
        if fqn in position:
            decoded = {k: _decoded(v, f"Optimizer {i}'s {k!r} of {fqn}", directory) for k, v in values.items()}
            state.setdefault(position[fqn], {}).update(decoded)

    return {"state": state, "param_groups": groups}


def _decoded(value: Any, what: str, directory: Location) -> Any:
    """The Python value of ``value``, JSON from the index; a damaged one is a ``CheckpointError`` naming ``what``."""
    try:
        return from_json_tree(value, {})
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - untrusted JSON: name what was damaged
        raise CheckpointError(
            f"{what} in {directory / INDEX_FILE} cannot be decoded ({type(err).__name__}: {err}): the index is damaged."
        ) from None


def _check_optimizer_shapes(i: int, entries: list[tuple[str, StoredTensor]], sharded: dict[str, Any]) -> None:
    """Per-parameter optimizer state that the index does not list as whole is either a scalar (e.g. Adam's step) or
    shaped like its parameter."""
    problems = []
    for key, entry in entries:
        p = sharded[key.rsplit("/", 1)[0]]
        if entry.shape:
            problem = check_loadable(f"{OPTIMIZER_PREFIX}{i}/{key}", entry.shape, entry.dtype, p.full_shape, p.dtype)
            if problem:
                problems.append(problem)
    if problems:
        raise CheckpointError(
            f"Optimizer {i}'s state in the checkpoint does not match the model's parameters: " + "; ".join(problems)
        )


def full_model_state(directory: Location, index: dict[str, Any]) -> dict[str, Any]:
    """Every model tensor of the checkpoint in full under the LightningModule's keys (tied weights under each name),
    in memory: for a module that is not sharded (``fabric.load_raw`` into a plain module)."""
    require_complete(directory, index["tensors"])
    with FileHandles() as handles:
        state = {key: read_tensor(entry, handles) for key, entry in iter_index_tensors(index, MODEL_PREFIX)}
    for alias, stored in model_ties(index).items():
        state[alias] = state[stored]
    return state
