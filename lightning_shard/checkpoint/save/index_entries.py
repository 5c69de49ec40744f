"""The entries of a save's index that follow from the model and optimizers: each tensor's, the head's, and the
parts of a pipeline-parallel save's stages merged into one model's.

[Note: pipeline-parallel checkpoints]
Under pipeline parallelism each stage holds its own modules only, so a save under it lists every piece, as a
tensor-parallel save does (see [Note: tensor-parallel checkpoints]): every rank of replica 0 writes its rows of its
stage's parameters and optimizer state, and the first rank of each stage that stage's buffers and scalar state.
Rank 0 builds the index from its own stage's tensors and the part the first rank of every later stage sends with
its file records (the tensors' keys, global shapes and dtypes, its ties and optimizer metadata), merged as the
unsplit model's: each optimizer's groups list the parameters of every stage, in stage order, which is the model's
order. A weight tied across stages is written by its first stage, under the name the unsplit model gives it. The
index records the split (``"pipeline"``: the stage count, the pipelined module and each stage's blocks) and the
writers' world size covers ``replicas x shard_size x tensor_parallel_size x pipeline stages``. A load at any
pipeline size (1 included) reads the rows it needs from the listed pieces, each checked as every read is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_shard.checkpoint.format import MODEL_PREFIX, dtype_from_name, dtype_name
from lightning_shard.checkpoint.format.adapters import ADAPTERS
from lightning_shard.checkpoint.io.index import LEFT_OUT, SavedTensor
from lightning_shard.checkpoint.io.layout import splits_by_rows


def stage_tensors_to_json(saved: list[SavedTensor]) -> list[list[Any]]:
    """A stage's tensors as the JSON its first rank sends rank 0: ``[key, shape, dtype name, split]`` each."""
    return [[t.key, list(t.shape), dtype_name(t.dtype), t.split] for t in saved]


def stage_tensors_from_json(entries: list[list[Any]]) -> list[SavedTensor]:
    """``stage_tensors_to_json``'s entries as the tensors they describe (rank 0, from its own ranks)."""
    return [SavedTensor(key, tuple(shape), dtype_from_name(dtype), split) for key, shape, dtype, split in entries]


def merge_stage_fields(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """The index fields of two pipeline stages' parts as one model's: ties, left-out weights and each adapter's
    tensors together, each optimizer's groups listing both stages' parameters (a tied weight once, by the name the
    first stage gave it)."""
    merged = {**first, "ties": {**first["ties"], **later["ties"]}}
    if LEFT_OUT in later:
        merged[LEFT_OUT] = {**first.get(LEFT_OUT, {}), **later[LEFT_OUT]}
    if ADAPTERS in later:  # each adapter's tensors on every stage
        record = first.get(ADAPTERS) or {**later[ADAPTERS], "adapters": {}}
        adapters = {name: {**entry, "tensors": {**entry["tensors"]}} for name, entry in record["adapters"].items()}
        for name, entry in later[ADAPTERS]["adapters"].items():
            adapters.setdefault(name, {**entry, "tensors": {}})["tensors"].update(entry["tensors"])
        merged[ADAPTERS] = {**record, "adapters": adapters}
    optimizers = []
    for a, b in zip(first["optimizers"], later["optimizers"], strict=True):
        seen = {name for group in a["param_groups"] for name in group["params"]} | set(merged["ties"])
        groups = [{**ga, "params": ga["params"] + [n for n in gb["params"] if n not in seen]}
                  for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True)]  # fmt: skip
        optimizer = {**a, "param_groups": groups, "values": {**b["values"], **a["values"]}}
        for entry in ("scalar_param_states", "whole_param_states"):
            if entry in a or entry in b:
                optimizer[entry] = {**b.get(entry, {}), **a.get(entry, {})}
        optimizers.append(optimizer)
    merged["optimizers"] = optimizers
    return merged


def saved_tensors(
    params: list[tuple[str, tuple[int, ...], torch.dtype]],
    buffers: list[tuple[str, Tensor]],
    optimizer_tensors: list[tuple[str, tuple[int, ...] | None, Tensor]],
    shard_size: int | None,
) -> list[SavedTensor]:
    """Every tensor a checkpoint stores: parameters (name, global shape, dtype), buffers, and optimizer tensors (key,
    the global shape of the parameter whose rows they are split like or ``None`` for scalar state, tensor). In a
    sharded save by ``shard_size`` shards, parameters and the optimizer state shaped like them are split by rows over
    the shards, but those stored whole (see [Note: small tensors stored whole]); ``None``: a full save."""
    out = [SavedTensor(MODEL_PREFIX + fqn, shape, dtype, split_by_rows(shape, dtype, shard_size))
           for fqn, shape, dtype in params]
    out += [SavedTensor(MODEL_PREFIX + k, tuple(v.shape), v.dtype, False) for k, v in buffers]
    for name, shape, value in optimizer_tensors:
        out.append(SavedTensor(name, shape if shape is not None else tuple(value.shape), value.dtype,
                               shape is not None and split_by_rows(shape, value.dtype, shard_size)))
    return out


def split_by_rows(shape: tuple[int, ...], dtype: torch.dtype, shard_size: int | None) -> bool:
    """Whether a tensor the shards hold by rows is split by rows in a save by ``shard_size`` shards (``None``: a full
    save, which splits nothing)."""
    return shard_size is not None and splits_by_rows(shape, dtype, shard_size)
