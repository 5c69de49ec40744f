"""How far this rank has come in its sequence of collectives, and the record of it every rank publishes, so that a
rank left waiting can tell which peers did not arrive (see ``lightning_shard.engine.stall``).

[Note: progress records]
Every rank issues the engine's collectives in the same order, so the n-th collective a rank enters is the n-th on
every rank. ``RECORD.enter(op)`` numbers each one as it is issued and remembers what it is (an ``Activity``: the
operation, the unit it belongs to, forward or backward, the training step): a counter increment and one small
object, nothing that talks to another process. A daemon thread (``ProgressPublisher``) copies the latest activity
into the process group's key-value store (the ``TCPStore`` the ranks met through) at most twice a second, and only
when it changed, so the training loop never waits for the store. A suspended rank's thread is suspended with it:
its record then holds where it was, to within half a second.

When a collective times out, the waiting rank reads every peer's record: a peer whose count is below the number of
the collective waited for has not entered it. That is "as far as the ranks can know": a record half a second old can
lag one collective behind a rank that stopped just after entering the next one.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import wraps
from typing import Any, TypeVar

import torch

PUBLISH_INTERVAL_S = 0.5  # how stale a suspended rank's record can be; the thread costs nothing between wake-ups
STOP_WAIT_S = 5.0  # at most this long for a store call in flight when publishing stops
_KEY_PREFIX = "lightning_shard/progress/"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class Activity:
    """One collective this rank entered: the ``index``-th (1-based, the same on every rank) and what it is for."""

    index: int
    op: str  # "all-gather", "reduce-scatter", "barrier", ...
    unit: str | None  # the sharding unit's name ("" is the root unit); None outside a unit
    in_backward: bool
    step: int | None  # the training step, where the front end tells it (the Trainer's global_step)

    def describe(self) -> str:
        """E.g. ``"all-gather of unit blocks.3 in backward, step 1520"``."""
        text = self.op
        if self.unit is not None:
            text += f" of unit {self.unit or '<root>'} in {'backward' if self.in_backward else 'forward'}"
        elif self.in_backward:
            text += " in backward"
        if self.step is not None:
            text += f", step {self.step}"
        return text


class ProgressRecord:
    """This process's count of collectives entered and the last one (``RECORD``, one per process: one rank)."""

    def __init__(self) -> None:
        self.index = 0
        self.last: Activity | None = None
        self.unit: str | None = None  # set while a unit issues its collectives (``about_unit``)
        self.step: int | None = None

    def enter(self, op: str) -> Activity:
        """Count a collective as entered (call it as the collective is issued) and return what it is."""
        self.index += 1
        activity = Activity(self.index, op, self.unit, torch._C._current_graph_task_id() != -1, self.step)
        self.last = activity
        return activity

    def reset(self) -> None:
        """Start counting from zero (every rank together, when a process group's training starts)."""
        self.index, self.last, self.unit, self.step = 0, None, None, None


RECORD = ProgressRecord()


def note_step(step: int) -> None:
    """Label the collectives entered from now on with the training step ``step``."""
    RECORD.step = step


class about:  # noqa: N801 - used like a function: ``with about(unit_name):``
    """Attribute the collectives entered inside the block to the unit named ``unit`` (``None``: to none)."""

    __slots__ = ("unit", "previous")

    def __init__(self, unit: str | None) -> None:
        self.unit = unit
        self.previous: str | None = None

    def __enter__(self) -> None:
        self.previous, RECORD.unit = RECORD.unit, self.unit

    def __exit__(self, *exc: object) -> None:
        RECORD.unit = self.previous


def about_unit(method: F) -> F:
    """Decorate a ``ShardUnit`` method: the collectives it enters are attributed to its unit (``self.name``)."""

    @wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with about(self.name):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


# Publishing #


@dataclass(frozen=True)
class PeerRecord:
    """A rank's published progress, as another rank reads it."""

    rank: int
    index: int
    what: str  # the activity's description ("" before the first collective)
    published: float  # time.time() when it was written

    def age_s(self) -> float:
        return max(0.0, time.time() - self.published)


class _PublishingThread(threading.Thread):
    """The publisher's daemon thread. Its ``stop()`` stops publishing (as ``stop_publishing`` does): test suites that
    fail a test leaving a thread behind, Lightning's among them, stop a daemon thread that has one."""

    def __init__(self, publisher: ProgressPublisher) -> None:
        super().__init__(target=publisher._run, name="lightning_shard-progress", daemon=True)
        self._publisher = publisher

    def stop(self) -> None:
        if _PUBLISHER is self._publisher:
            stop_publishing()
        else:
            self._publisher.stop()


class ProgressPublisher:
    """The daemon thread that copies ``RECORD.last`` into the store when it changed (see [Note: progress records])."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: timedelta | None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._stop = threading.Event()
        self._published: Activity | None = None
        self._thread = _PublishingThread(self)

    def start(self) -> None:
        self._publish(None)  # a first record at once: "set up, no collective yet"
        self._thread.start()

    def stop(self) -> None:
        """Stop publishing and wait (briefly) for the thread to leave the store. A daemon thread still inside a
        store call when the interpreter finalises aborts the process ("terminate called without an active
        exception"), so this runs before the process group is destroyed and at exit."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_WAIT_S)

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            last = RECORD.last
            if last is not self._published:
                if not self._publish(last):
                    return  # the store is gone (the process group was destroyed)

    def _publish(self, activity: Activity | None) -> bool:
        record = {
            "index": activity.index if activity is not None else 0,
            "what": activity.describe() if activity is not None else "",
            "published": time.time(),
        }
        try:
            self.store.set(record_key(self.rank), json.dumps(record))
        except Exception:  # noqa: BLE001 - publishing is best effort; a failing store must not fail training
            return False
        self._published = activity
        return True


def record_key(rank: int) -> str:
    return f"{_KEY_PREFIX}{rank}"


def read_peer_records(store: Any, world_size: int, within_s: float) -> tuple[dict[int, PeerRecord], bool]:
    """Every rank's published record, read from ``store`` for at most ``within_s`` seconds; the second value says
    whether the store answered in time (a suspended rank 0 also suspends the store it serves)."""
    records: dict[int, PeerRecord] = {}

    def read() -> None:
        for rank in range(world_size):
            key = record_key(rank)
            if store.check([key]):
                raw = json.loads(store.get(key))
                records[rank] = PeerRecord(rank, int(raw["index"]), str(raw["what"]), float(raw["published"]))

    reader = threading.Thread(target=read, name="lightning_shard-progress-read", daemon=True)
    reader.start()
    reader.join(within_s)
    return dict(records), not reader.is_alive()


_PUBLISHER: ProgressPublisher | None = None


@atexit.register
def _stop_publishing_at_exit() -> None:
    stop_publishing()


def start_publishing(store: Any, rank: int, world_size: int, timeout: timedelta | None) -> None:
    """Count collectives from zero and publish this rank's progress to ``store`` (replacing an earlier publisher)."""
    global _PUBLISHER
    stop_publishing()
    RECORD.reset()
    _PUBLISHER = ProgressPublisher(store, rank, world_size, timeout)
    _PUBLISHER.start()


def stop_publishing() -> None:
    global _PUBLISHER
    if _PUBLISHER is not None:
        _PUBLISHER.stop()
        _PUBLISHER = None


def publisher() -> ProgressPublisher | None:
    """The running publisher (``None``: progress is counted but not published, so peers cannot be named)."""
    return _PUBLISHER
