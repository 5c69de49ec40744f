"""A second copy of the model's tensors in a checkpoint: the running average of the weights (EMA/SWA).

[Note: averaged weights in a checkpoint]
A weight-averaging callback keeps, on every rank, the average of this rank's rows of every
parameter (and of every buffer). A save stores it beside the model, laid out like it: index keys
``"average/" + <the model's state_dict key>``, each rank writing its rows of the parameters (rank
0 the buffers) in its own shard file, so nothing is gathered. A load reads each rank's rows back,
whatever world size wrote them, straight into the averaged tensors. The front end passes the
averaged tensors to the save under ``AVERAGED_MODEL_KEY`` in the checkpoint dict (the save takes
them out before the trainer state is written) and asks ``load_averaged`` for them on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from lightning_shard.checkpoint.agreement import agree
from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError
from lightning_shard.checkpoint.index import LEFT_OUT, iter_index_tensors, model_ties
from lightning_shard.checkpoint.layout import require_complete
from lightning_shard.checkpoint.reader import RowReads
from lightning_shard.checkpoint.sources import CheckpointSource, ShardDirectory
from lightning_shard.engine.sharded_module import ShardedModule

AVERAGE_PREFIX = "average/"  # index keys of averaged tensors: "average/" + the model's state_dict key
AVERAGED_MODEL_KEY = "lightning_shard_averaged_model"  # the checkpoint dict's entry a save takes out


@dataclass(frozen=True)
class AveragedTensors:
    """This rank's averaged tensors, keyed by the model's parameter and buffer names: for a parameter, a tensor of
    this rank's rows (shaped like its shard); for a buffer, the whole buffer."""

    tensors: dict[str, Tensor] = field(repr=False)


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
        _check(source, key, entries[key].shape, tuple(p.global_shape))
        wanted.append(key)
        reads.add(entries[key], p.first_row, p.first_row + p.local_rows, into.tensors[name])
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


Weights = Literal["current", "averaged"]


def weights_prefix(index: dict[str, Any], weights: Weights | str, where: Any) -> str:
    """The index prefix of the weights a reader of checkpoint ``where`` named: ``"current"`` (the model as trained)
    or ``"averaged"`` (the running average a weight-averaging callback kept; refused if the checkpoint has none)."""
    if weights == "current":
        return MODEL_PREFIX
    if weights != "averaged":
        raise ValueError(f"weights={weights!r} is not one of 'current', 'averaged'.")
    if not any(True for _ in iter_index_tensors(index, AVERAGE_PREFIX)):
        raise CheckpointError(
            f"{where} holds no averaged weights: it was not saved during a fit with a WeightAveraging callback."
            " Use weights='current' (--weights current)."
        )
    return AVERAGE_PREFIX
