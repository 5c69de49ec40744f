"""A collective that did not complete within the timeout becomes a ``StalledRanksError`` naming what this rank
waited for and the ranks that had not arrived.

[Note: how a wait ends]
``bound_waits(timeout, group)`` makes the strategy's ``timeout`` bound every wait on the group: collectives the
engine does not issue itself (a barrier, the object collectives) take it from the group's options, which
``_set_pg_timeout`` changes after set-up; every wait of the engine's own collectives passes it explicitly
(``collectives.wait_for``), because not every backend reads the changed options: gloo's point-to-point pairs and
NCCL's works keep the timeout the group was created with (on one H200, an NCCL wait under blocking waits outlasted
a 3 s strategy timeout until the explicit one). The group is created with a longer timeout
(``rendezvous_timeout``): its set-up waits for every rank to start, which may take longer than a collective should.
Past the timeout, gloo raises a ``RuntimeError`` ("Timed out waiting 30000ms for recv operation to complete") on the
rank that waited; ranks that are still alive all end up waiting on some collective, so each of them raises, at most
one timeout later. The engine enters every wait of its collectives through ``watching(activity)``, which turns that
error into a ``StalledRanksError``: it reads the peers' progress records (see [Note: progress records]) and says
which ranks had not entered the collective. Other errors (a peer's connection closed because its process died) pass
unchanged.

On NCCL a wait does not block the CPU unless ``TORCH_NCCL_BLOCKING_WAIT=1``: by default NCCL's watchdog ends the
process after the timeout with its own message; with blocking waits the timeout is raised here and named like gloo's.
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist

from lightning_shard.engine import progress
from lightning_shard.engine.progress import Activity, PeerRecord

STORE_READ_S = 5.0  # how long a timed-out rank tries to read its peers' records before it raises anyway
RENDEZVOUS_MIN = timedelta(minutes=10)  # the least time set-up waits for every rank to start and connect

_wait_timeout: timedelta | None = None  # see wait_timeout()


def rendezvous_timeout(timeout: timedelta) -> timedelta:
    """How long creating the process group may wait for every rank to start: ``timeout``, or more (see
    [Note: how a wait ends])."""
    return max(timeout, RENDEZVOUS_MIN)


def bound_waits(timeout: timedelta, group: Any = None) -> None:
    """Make ``timeout`` bound every wait on ``group`` (the default group when ``None``), collectives and
    point-to-point alike (see [Note: how a wait ends])."""
    global _wait_timeout
    dist.distributed_c10d._set_pg_timeout(timeout, group)
    _wait_timeout = timeout


def wait_timeout() -> timedelta | None:
    """The timeout to pass to a point-to-point work's ``wait`` (``None``: the group's own, set at its creation)."""
    return _wait_timeout


class StalledRanksError(RuntimeError):
    """A collective did not complete within the timeout. ``waited_for`` is what this rank waited for;
    ``missing_ranks`` the ranks whose published progress shows they had not entered it (empty when unknown)."""

    def __init__(self, message: str, waited_for: Activity, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.waited_for = waited_for
        self.missing_ranks = missing_ranks


class watching:  # noqa: N801 - used like a function: ``with watching(activity):``
    """Turn a timeout of the collective ``activity`` inside the block into a ``StalledRanksError``
    (see [Note: how a wait ends]); ``None`` watches nothing."""

    __slots__ = ("activity",)

    def __init__(self, activity: Activity | None) -> None:
        self.activity = activity

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None or self.activity is None or not is_timeout(exc) or isinstance(exc, StalledRanksError):
            return
        raise stall_error(self.activity, exc) from exc


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a backend's report that a wait exceeded the process group's timeout."""
    if not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def stall_error(activity: Activity, cause: BaseException) -> StalledRanksError:
    """The ``StalledRanksError`` for ``activity`` having timed out with ``cause``: reads the peers' records."""
    publisher = progress.publisher()
    if publisher is None:
        return StalledRanksError(
            f"This rank waited in vain for the {activity.describe()} (collective #{activity.index}): it did not"
            f" complete within the process group's timeout. Which ranks did not arrive is unknown: progress is"
            f" published once a ShardStrategy has set up the process group. Backend error: {_first_line(cause)}",
            activity,
            [],
        )
    within = STORE_READ_S
    if publisher.timeout is not None:
        within = min(within, max(1.0, publisher.timeout.total_seconds()))
    records, answered = progress.read_peer_records(publisher.store, publisher.world_size, within)
    return _diagnosis(activity, publisher.rank, publisher.world_size, publisher.timeout, records, answered, cause)


def _diagnosis(
    activity: Activity,
    rank: int,
    world_size: int,
    timeout: timedelta | None,
    records: dict[int, PeerRecord],
    answered: bool,
    cause: BaseException,
) -> StalledRanksError:
    within = f"within the timeout of {_seconds(timeout)}" if timeout is not None else "within the timeout"
    head = (
        f"Rank {rank} waited for the {activity.describe()} (collective #{activity.index}), which did not complete"
        f" {within}."
    )
    peers = [r for r in range(world_size) if r != rank]
    missing = [r for r in peers if r in records and records[r].index < activity.index]
    unknown = [r for r in peers if r not in records]
    parts = [head]
    if missing:
        parts.append(
            f"Ranks that had not arrived: {', '.join(map(str, missing))}. "
            + " ".join(_last_seen(records[r]) for r in missing)
        )
    if unknown:
        if answered:
            parts.append(f"No progress published by {_ranks(unknown)}.")
        else:
            parts.append(
                f"The store did not answer within {STORE_READ_S:g} s, so the progress of {_ranks(unknown)} is"
                f" unknown: the store is served by global rank 0's process, which is then likely the rank that"
                f" stopped."
            )
    arrived = [r for r in peers if r in records and r not in missing]
    if arrived and missing:
        parts.append(f"Arrived and waiting too: {_ranks(arrived)}.")
    elif not missing and not unknown:
        parts.append(
            "Every rank had entered it (a peer may have stopped inside it, or is too slow for the timeout)."
        )
    parts.append(
        "A rank stops answering when its data loading, file system or a debugger blocks it or it was suspended;"
        " raise ShardStrategy(timeout=...) if a step legitimately takes longer (see 'Timeouts and stalled ranks' in"
        f" the user guide). Backend error: {_first_line(cause)}"
    )
    stalled = missing or (unknown if not answered else [])
    return StalledRanksError(" ".join(parts), activity, stalled)


def _last_seen(record: PeerRecord) -> str:
    if record.index == 0:
        return f"Rank {record.rank} had entered no collective since set-up ({record.age_s():.1f} s ago)."
    return (
        f"Rank {record.rank}'s last collective: #{record.index}, the {record.what}"
        f" (published {record.age_s():.1f} s ago)."
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g} s"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
