"""Every rank agrees: a step that can fail on some ranks is raised on all of them, never left waiting.

The checkpoint readers and writers, and both front ends, run each step that touches files through
``agree``: the ranks all-reduce one flag (did this step fail anywhere?), and only when it did do they
exchange their error messages, so a damaged file or a full disk on one rank stops every rank with the
same ``CheckpointError`` instead of leaving the others in a collective. A step that succeeds everywhere
costs one 4-byte all-reduce, whatever the world size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.engine.progress import RECORD
from lightning_shard.engine.stall import watching

T = TypeVar("T")


def agree(fn: Callable[[], T], group: Any = None) -> T:
    """Run ``fn`` on every rank; if it raised on any rank, raise on all of them (naming the ranks and errors), as the
    module docstring says. Collective over ``group`` (the default group when ``None``)."""
    error: str | None = None
    result: Any = None
    try:
        result = fn()
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        error = f"{type(err).__name__}: {err}"
    if _failed_anywhere(error is not None, group):
        errors = _all_gather(error, group)
        raise CheckpointError(ranks_and_errors(errors))
    return result


def ranks_and_errors(errors: list[str | None]) -> str:
    """Each distinct error once, after the ranks that raised it (``"ranks 0-3, 5: ..."``), in rank order."""
    by_error: dict[str, list[int]] = {}
    for rank, error in enumerate(errors):
        if error is not None:
            by_error.setdefault(error, []).append(rank)
    return "; ".join(f"{_rank_list(ranks)}: {error}" for error, ranks in by_error.items())


def _rank_list(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def broadcast_str(value: str) -> str:
    """``value`` as rank 0 holds it (a path every rank must use alike)."""
    if not dist.is_initialized():
        return value
    box = [value]
    with watching(RECORD.enter("checkpoint path broadcast")):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_on_first_rank(record: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``record`` (a JSON value), in rank order, on the group's first rank (the one that writes an
    index); ``None`` on the others, which send their record and receive nothing. Collective over ``group`` (the
    default group when ``None``): one all-reduce of the longest record's length, then one gather of the records as
    bytes padded to it, so only the first rank's memory grows with the world size, and nothing is pickled."""
    if not _distributed(group):
        return [record]
    data = json.dumps(record).encode()
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    longest = torch.tensor([len(data)], dtype=torch.int64, device=device)
    first = dist.get_rank(group) == 0
    with watching(RECORD.enter("checkpoint records to rank 0")):
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        payload = torch.zeros(_LENGTH_BYTES + int(longest.item()), dtype=torch.uint8)
        payload[:_LENGTH_BYTES] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        payload[_LENGTH_BYTES : _LENGTH_BYTES + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        payload = payload.to(device)
        received = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))] if first else None
        dist.gather(payload, received, group=group, group_dst=0)
    if received is None:
        return None
    out = []
    for row in received:
        row = row.cpu()
        length = int(row[:_LENGTH_BYTES].view(torch.int64).item())
        out.append(json.loads(bytes(row[_LENGTH_BYTES : _LENGTH_BYTES + length].numpy())))
    return out


_LENGTH_BYTES = 8  # each gathered record starts with its length


def _distributed(group: Any) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _failed_anywhere(failed: bool, group: Any) -> bool:
    if not _distributed(group):
        return failed
    on_gpu = dist.get_backend(group) == "nccl"
    flag = torch.tensor([int(failed)], dtype=torch.int32, device="cuda" if on_gpu else "cpu")
    with watching(RECORD.enter("checkpoint agreement")):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _all_gather(error: str | None, group: Any) -> list[str | None]:
    if not _distributed(group):
        return [error]
    out: list[Any] = [None] * dist.get_world_size(group)
    with watching(RECORD.enter("checkpoint errors")):
        dist.all_gather_object(out, error, group=group)
    return out
