"""Every rank agrees: a step that can fail on some ranks is raised on all of them, never left waiting.

The checkpoint readers and writers, and both front ends, run each step that touches files through
``agree``: the ranks exchange one small record each, so a damaged file or a full disk on one rank
stops every rank with the same ``CheckpointError`` instead of leaving the others in a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.engine.progress import RECORD
from lightning_shard.engine.stall import watching

T = TypeVar("T")


def agree(fn: Callable[[], T], group: Any = None) -> T:
    """Run ``fn`` on every rank; if it raised on any rank, raise on all of them (naming the ranks and errors).

    The ranks exchange one small record each (over ``group``, the default group when ``None``), so a failure on
    one rank never leaves the others waiting in a collective.
    """
    error: str | None = None
    result: Any = None
    try:
        result = fn()
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        error = f"{type(err).__name__}: {err}"
    errors = gather_records(error, group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in failed))
    return result


def broadcast_str(value: str) -> str:
    """``value`` as rank 0 holds it (a path every rank must use alike)."""
    if not dist.is_initialized():
        return value
    box = [value]
    with watching(RECORD.enter("checkpoint path broadcast")):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_records(records: Any, group: Any = None) -> list[Any]:
    """Every rank's ``records``, in rank order (``agree`` returns only this rank's; an index needs all). Collective
    over ``group`` (the default group when ``None``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [records]
    out: list[Any] = [None] * dist.get_world_size()
    with watching(RECORD.enter("checkpoint agreement")):
        dist.all_gather_object(out, records, group=group)
    return out
