"""What the tests that start whole jobs (Lightning's launcher, torchrun agents, the examples) share.

[Note: jobs in the background]
A launched job spends most of its time in one interpreter importing torch and Lightning: Lightning's launcher starts
the other ranks only once its own process has imported them, and a torchrun agent imports before its workers do. So
one job keeps about one core busy. A module that starts several independent jobs hands them all to the module's
``background`` (``tests/conftest.py``) when its first test runs, and each test waits for the job it checks:
``AT_ONCE`` jobs run at a time, which keeps a 2-core machine's cores busy without more processes than memory holds.
Only the jobs of the tests this session runs are started (``start_jobs``). Jobs that time a rank's silence (the stall,
preemption and elastic tests) run alone, in the foreground.

[Note: early checks]
A check that keeps a process or a job busy for seconds and needs nothing from the rest of the session (the type check
of the package, building and installing the wheel, a fresh interpreter's imports, the quickstart page in sequence)
starts when the session starts: a background thread runs these checks one at a time, in the tests' order, on what the
other tests leave idle (a launched job's ranks waiting for each other, a test's single process). Its test, when its
turn comes, waits for what is left, or runs its check itself if the thread has not reached it yet. A test opts in
with ``@pytest.mark.early(check=check)``; its ``early`` fixture (``tests/conftest.py``) is ``check()``'s result, or
raises what ``check()`` raised. The check's processes run with the session's environment and in a folder of their own
or the repository (``run_early``, ``job_env``), whatever a test running meanwhile does to this process's. They keep
the normal priority: at the lowest, a machine busy with other work would starve them while their test waits.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

AT_ONCE = 2  # background jobs running at once: see [Note: jobs in the background]
ROOT = Path(__file__).resolve().parents[1]
# The environment when the session started, for an early check's processes: a test running meanwhile may change this
# process's environment (``monkeypatch.setenv``) or working directory.
SESSION_ENV = dict(os.environ)
_EARLY: dict[Callable[[], Any], Future[Any]] = {}  # each early check's result (tests that name one check share it)
_EARLY_QUEUE: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()  # the checks not yet taken, in test order
_TAKEN: set[Callable[[], Any]] = set()  # the checks a thread has taken to run
_TAKING = threading.Lock()

# Rank and rendezvous variables a launcher sets for its ranks. A test may itself run inside a launched process (or
# a worker that inherited them): a job started from it must not see them, or it would join that job's rendezvous.
LAUNCH_ENV_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK")


def job_env(**extra: str) -> dict[str, str]:
    """The environment for a job started from a test: the session's without any launcher's variables, one thread
    per rank (``OMP_NUM_THREADS=1``), and ``extra``. (Not this process's now: a job may run in the background while
    a test changes it, ``monkeypatch.setenv("SLURM_JOB_ID", ...)`` say.)"""
    env = {k: v for k, v in SESSION_ENV.items() if k not in LAUNCH_ENV_VARS and not k.startswith("TORCHELASTIC")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a job's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_role(script: Path, root: Path, role: str, devices: int) -> list[Any]:
    """Run ``script --role ROLE --devices N --root ROOT`` in a fresh process (it launches its own ranks, as a user
    runs it) and return what each rank saved as ``ROOT/ROLE-RANK.pt``."""
    import torch

    done = subprocess.run([sys.executable, str(script), "--role", role, "--devices", str(devices), "--root", str(root)],
                          capture_output=True, text=True, timeout=900,
                          env=job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))  # fmt: skip
    assert done.returncode == 0, f"{role}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    return [torch.load(root / f"{role}-{rank}.pt") for rank in range(devices)]


def script_function(rank: int, world_size: int, script: str, function: str, *args: Any) -> Any:
    """``function(*args)`` from the launch script ``script`` (imported as a module: its ``__main__`` block does not
    run), on a pooled rank: ``run_on_ranks(script_function, 2, str(SCRIPT), "fit", ...)``. For what needs no fresh
    process, such as the script's own reference fit."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)(*args)


def start_jobs(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor, key: Callable[[pytest.Item], K],
    job: Callable[[K], T],
) -> dict[K, Future[T]]:
    """Start ``job(key(test))`` in ``background``, once a key, for every test this session runs (after ``-k``, ``-m``
    or node ids) that uses the requesting fixture, in the tests' order; return the futures by key."""
    started: dict[K, Future[T]] = {}
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and request.fixturename in getattr(item, "fixturenames", ()):
            name = key(item)
            if name not in started:
                started[name] = background.submit(job, name)
    return started


def param(item: pytest.Item, name: str, default: Any = None) -> Any:
    """The value of ``item``'s parameter ``name`` (``default`` for a test without it)."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(name, default) if callspec is not None else default


def run_early(
    command: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 600.0
) -> subprocess.CompletedProcess:
    """``command`` run to its end for an early check (see [Note: early checks]), in ``cwd``, with ``env`` (the
    session's environment unless given), its output captured as text."""
    return subprocess.run(command, cwd=cwd, env=SESSION_ENV if env is None else env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def start_early_checks(items: Iterable[pytest.Item]) -> None:
    """Queue the early check of each of ``items`` marked ``early`` (see [Note: early checks]), once a check, for the
    background thread that runs them one at a time in the tests' order."""
    for item in items:
        check = _early_check(item)
        if check is not None and check not in _EARLY:
            if not _EARLY:
                threading.Thread(target=_run_queued_checks, name="early", daemon=True).start()
            _EARLY[check] = Future()
            _EARLY_QUEUE.put(check)


def early_result(item: pytest.Item) -> Any:
    """What ``item``'s early check returned; raises what the check raised. A check still queued when its test asks
    runs now, in the test's own thread, instead of after the checks queued before it."""
    check = _early_check(item)
    assert check is not None, f"{item.nodeid} uses the early fixture without an early mark"
    start_early_checks([item])
    _run_if_not_taken(check)
    return _EARLY[check].result()


def _early_check(item: pytest.Item) -> Callable[[], Any] | None:
    marker = item.get_closest_marker("early")
    return None if marker is None else marker.kwargs["check"]


def _run_queued_checks() -> None:
    while True:
        _run_if_not_taken(_EARLY_QUEUE.get())


def _run_if_not_taken(check: Callable[[], Any]) -> None:
    with _TAKING:
        if check in _TAKEN:
            return
        _TAKEN.add(check)
    try:
        _EARLY[check].set_result(check())
    except BaseException as err:  # noqa: BLE001 - raised in the test that waits for it
        _EARLY[check].set_exception(err)
