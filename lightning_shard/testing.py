"""Run a function on N gloo CPU ranks from inside pytest, for multi-rank unit tests.

    from lightning_shard.testing import run_on_ranks

    def check_sum(rank: int, world_size: int) -> float:   # module-level, so workers can import it
        t = torch.tensor([float(rank)])
        torch.distributed.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_on_ranks(check_sum, world_size=2) == [1.0, 1.0]

The ranks are worker processes started once per world size and kept for the whole test session,
with the default process group already initialised (gloo, one thread each) and Lightning's
environment variables set, so a ``Trainer`` inside them runs in-process as that rank. If any rank
raises, or the call exceeds ``timeout``, every worker of that world size is killed (a rank left
inside a collective cannot be recovered) and the error is raised with each failing rank's
traceback; the next call starts fresh workers.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

_POOLS: dict[int, _RankPool] = {}


class RankFailure(RuntimeError):
    """One or more ranks raised (or the call timed out); the message holds their tracebacks."""


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, **kwargs: Any) -> list:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank and return the results in rank order.

    ``fn``, its arguments and its results cross process boundaries: ``fn`` must be importable
    (defined at module level) and everything must be picklable.
    """
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = _POOLS[world_size] = _RankPool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except RankFailure:
        pool.kill()
        _POOLS.pop(world_size, None)
        raise


def shutdown_ranks() -> None:
    """Stop every worker (each destroys its process group first). Registered at interpreter exit."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_ranks)


class _RankPool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results: Any = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(rank, world_size, port, self.inboxes[rank], self.results), daemon=True)
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list:
        for inbox in self.inboxes:
            inbox.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, payload = self.results.get(timeout=timeout if not failures else 10.0)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - results.keys() - failures.keys())
                if not failures:
                    failures[-1] = f"timed out after {timeout:.0f} s waiting for ranks {missing}"
                break
            (results if ok else failures)[rank] = payload
            if not self.alive and len(results) + len(failures) < self.world_size:
                failures.setdefault(-1, "a worker process died")
                break
        if failures:
            text = "\n".join(
                f"--- rank {r} ---\n{tb}" if r >= 0 else f"--- {tb} ---" for r, tb in sorted(failures.items())
            )
            raise RankFailure(f"{getattr(fn, '__name__', fn)} failed on {self.world_size} ranks:\n{text}")
        return [results[r] for r in range(self.world_size)]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=20)
        self.kill()


def _worker(rank: int, world_size: int, port: int, inbox: Any, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        while (task := inbox.get()) is not None:
            fn, args, kwargs = task
            try:
                results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
            except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
                results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
