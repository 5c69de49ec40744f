"""What the tests that start whole jobs (Lightning's launcher, torchrun agents, the examples) share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

# Rank and rendezvous variables a launcher sets for its ranks. A test may itself run inside a launched process (or
# a worker that inherited them): a job started from it must not see them, or it would join that job's rendezvous.
LAUNCH_ENV_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK")


def job_env(**extra: str) -> dict[str, str]:
    """The environment for a job started from a test: this process's without any launcher's variables, one thread
    per rank (``OMP_NUM_THREADS=1``), and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_VARS and not k.startswith("TORCHELASTIC")}
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
