"""Preemption for both front ends: a signal on any rank stops every rank together, after one complete checkpoint.

[Note: preemption at a step boundary]
Schedulers announce preemption with a signal to some processes (SIGTERM from SLURM, Kubernetes and spot
instances; SLURM's requeue signal, SIGUSR1 by default, ahead of a time limit). A handler that communicates
(Lightning's broadcasts from inside its SIGTERM handler) can land in the middle of the engine's own
collectives and leave the ranks in different collectives. Here the handler only records the signal; the
ranks learn of it together at the next optimizer-step boundary, where each rank contributes its record to
one all-reduce of a single integer (the largest signal number seen wins). That is the only cost while no
signal arrives: one one-element all-reduce per optimizer step. Once the ranks agree, every rank is at the
same step with no collective in flight, so they write one checkpoint together and exit together with
``128 + signal number`` (143 for SIGTERM), the status a process killed by that signal would have: torchrun
restarts its workers on it (``--max-restarts``), Kubernetes counts it as a retryable failure, and SLURM
records the job as failed unless it was requeued (with ``SLURMEnvironment(auto_requeue=True)`` global
rank 0 requeues the job, as Lightning does).

A signal that arrives during a save or a collective only sets the record, so it cannot corrupt either; saves
are atomic directories anyway (see [Note: atomic checkpoint saves]), so a process killed outright during a
save leaves the previous checkpoint in place.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment

log = logging.getLogger(__name__)


class PreemptionState(enum.Enum):
    """Where a rank stands with preemption."""

    WATCHING = "watching"  # no signal seen by any rank, as far as this rank knows
    SIGNALLED = "signalled"  # this rank received a signal; the others learn of it at the next step boundary
    AGREED = "agreed"  # every rank knows: save a checkpoint together and exit


class PreemptionWatcher:
    """Records preemption signals on this rank and lets all ranks agree on them at a step boundary.

    ``install()`` replaces the handlers of ``signals`` with one that only records the signal (main thread only:
    Python delivers signals there); ``restore()`` puts the previous handlers back. ``agree()`` is collective.
    """

    def __init__(self, signals: Sequence[signal.Signals], requeue_signal: signal.Signals | None = None) -> None:
        self.signals = tuple(dict.fromkeys(signals))
        self.requeue_signal = requeue_signal  # the signal after which the SLURM job is requeued
        self._received: int = 0  # the first signal number received on this rank, 0 for none
        self._agreed: int = 0  # the signal number all ranks agreed on, 0 while none
        self._previous: dict[signal.Signals, Any] = {}

    # Handlers #

    def install(self) -> None:
        """Route ``signals`` to this watcher (a no-op outside the main thread, where signals cannot be handled)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        """Put back the handlers that ``install()`` replaced."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only record: see [Note: preemption at a step boundary]. No logging here (it takes locks).
        if not self._received:
            self._received = int(signum)

    # State #

    @property
    def state(self) -> PreemptionState:
        if self._agreed:
            return PreemptionState.AGREED
        return PreemptionState.SIGNALLED if self._received else PreemptionState.WATCHING

    @property
    def agreed_signal(self) -> signal.Signals | None:
        """The signal the ranks stop for, once they agreed (``None`` before)."""
        return signal.Signals(self._agreed) if self._agreed else None

    @property
    def exit_code(self) -> int:
        """``128 + signal number`` of the agreed signal (143 for SIGTERM), the status of a process the signal
        killed; see [Note: preemption at a step boundary]."""
        if not self._agreed:
            raise RuntimeError("No preemption was agreed on: there is no exit status to report.")
        return 128 + self._agreed

    def agree(self, device: torch.device) -> bool:
        """Whether any rank received a preemption signal; the same answer on every rank. Collective: every rank
        calls it at the same step boundary (one one-element all-reduce; nothing without a process group)."""
        if self._agreed:
            return True
        seen = self._received
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([seen], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            seen = int(flag.item())
        self._agreed = seen
        return bool(seen)

    def requeue_if_asked(self, global_rank: int) -> None:
        """After the agreed requeue signal, global rank 0 requeues the SLURM job (``scontrol requeue``)."""
        if global_rank != 0 or self.requeue_signal is None or self._agreed != int(self.requeue_signal):
            return
        requeue_slurm_job()


def preemption_signals(
    cluster_environment: ClusterEnvironment | None,
) -> tuple[list[signal.Signals], signal.Signals | None]:
    """The signals that announce preemption, and the one after which the job is requeued: SIGTERM always, and the
    SLURM requeue signal (``SLURMEnvironment(requeue_signal=...)``, SIGUSR1 by default) with ``auto_requeue``."""
    signals = [signal.SIGTERM]
    requeue = None
    if isinstance(cluster_environment, SLURMEnvironment) and cluster_environment.auto_requeue:
        requeue = cluster_environment.requeue_signal or signal.SIGUSR1
        signals.append(requeue)
    return signals, requeue


def requeue_slurm_job() -> None:
    """Ask SLURM to requeue this job (array task) once it exits; failure is logged, never raised."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        log.warning(f"Cannot requeue: no SLURM job id in the environment (found {job!r}).")
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], check=False).returncode
    except OSError as err:
        log.warning(f"Requeuing SLURM job {job} failed: {err}")
        return
    if result == 0:
        log.info(f"Requeued SLURM job {job}.")
    else:
        log.warning(f"Requeuing SLURM job {job} failed with exit status {result}.")
