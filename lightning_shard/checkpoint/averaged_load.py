"""Reading a checkpoint's averaged weights back on resume (see [Note: averaged weights in a checkpoint] in
``io/averaged.py``, which holds their keys and ``AveragedTensors``). It reads through a ``CheckpointSource``
(``open.py``), so it sits at the top of the checkpoint layer beside ``state.py``; the ``io`` room, which a
save imports, could not hold it."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.io.averaged import AVERAGE_PREFIX, AveragedTensors
from lightning_shard.checkpoint.io.index import LEFT_OUT, iter_index_tensors, model_ties
from lightning_shard.checkpoint.io.layout import require_complete
from lightning_shard.checkpoint.io.reader import RowReads
from lightning_shard.checkpoint.open import CheckpointSource, ShardDirectory
from lightning_shard.engine.sharded_module import ShardedModule


def has_average(source: CheckpointSource) -> bool:
    """Whether ``source`` holds averaged weights."""
    return isinstance(source, ShardDirectory) and any(True for _ in iter_index_tensors(source.index, AVERAGE_PREFIX))


def load_averaged(source: CheckpointSource, engine: ShardedModule, into: AveragedTensors) -> None:
    """Read this rank's rows of the averaged weights of ``source`` into ``into``'s tensors. Collective."""
    if not isinstance(source, ShardDirectory) or not has_average(source):
        raise CheckpointError(f"{source.path} holds no averaged weights (it was not saved with weight averaging).")
    reads, results = agree(lambda: _read(source, engine, into))
    reads.commit(results)  # once every rank has read everything (see [Note: a failed load changes nothing])


def _read(source: ShardDirectory, engine: ShardedModule, into: AveragedTensors) -> tuple[RowReads, list[Tensor]]:
    entries = dict(iter_index_tensors(source.index, AVERAGE_PREFIX))
    ties = model_ties(source.index)
    # The average of a weight the save left out is not stored: it keeps the value it was built with, the weight
    # itself (see [Note: weights a checkpoint leaves out]).
    left_out = {key.removeprefix(MODEL_PREFIX) for key in source.index.get(LEFT_OUT, {})}
    reads, wanted, done = RowReads(), [], set(left_out)
    for p in engine.sharded_params():
        name = next((f for f in p.fqns if f in into.tensors), None)
        if name is None or left_out.intersection(p.fqns):
            continue
        key = next((ties.get(f, f) for f in p.fqns if ties.get(f, f) in entries), None)
        if key is None:
            raise CheckpointError(f"{source.path} holds no averaged weights for {name!r}.")
        _check(source, key, entries[key].shape, tuple(p.full_shape))
        wanted.append(key)
        start, stop, columns = p.rows_in_full()
        reads.add(entries[key], start, stop, into.tensors[name], columns)
        done.update(p.fqns)
    for name, tensor in into.tensors.items():  # buffers: whole
        if name in done:
            continue
        if name not in entries:
            raise CheckpointError(f"{source.path} holds no averaged value for the buffer {name!r}.")
        _check(source, name, entries[name].shape, tuple(tensor.shape))
        wanted.append(name)
        reads.add(entries[name], 0, entries[name].rows, tensor)
    require_complete(source.path, entries, wanted)
    return reads, reads.read()


def _check(source: ShardDirectory, key: str, stored: Any, expected: Any) -> None:
    if tuple(stored) != tuple(expected):
        raise CheckpointError(
            f"{source.path}: the averaged {key!r} has shape {tuple(stored)}, the model's is {tuple(expected)}."
        )
