"""How long the command line and the package take to start: wall time of fresh processes, median of 3 by default.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/startup.py
    git archive e8842b1 | tar -x -C /tmp/before && .venv/bin/python benchmarks/startup.py --source /tmp/before

Each case runs in a new interpreter, so nothing is cached in memory but what the operating system caches on disk;
the cases alternate round by round so that a busy machine slows them alike. ``--source`` measures another checkout
(for example an older commit, as above) with the same interpreter and installed libraries: it goes first on
``PYTHONPATH`` and is the working directory. The interpreter on its own is measured too, the floor of every other
figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "lightning-shard"  # the console script pip installed

CASES: dict[str, list[str]] = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "lightning-shard --help": [str(SCRIPT), "--help"],
    "lightning-shard inspect --help": [str(SCRIPT), "inspect", "--help"],
    "import lightning_shard": [sys.executable, "-c", "import lightning_shard"],
    "from lightning_shard import ShardStrategy": [sys.executable, "-c", "from lightning_shard import ShardStrategy"],
}


def _time(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--source", type=Path, default=None, help="a checkout to measure instead of this one")
    args = parser.parse_args()
    env, cwd = dict(os.environ), ROOT
    if args.source is not None:  # first on the path, and the working directory `python -c` puts before it
        cwd = args.source.resolve()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), env.get("PYTHONPATH")]))
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, argv in CASES.items():
            times[name].append(_time(argv, env, cwd))
    print(f"| command | median of {args.repeats} (s) | all runs (s) |")
    print("|---|---|---|")
    for name, runs in times.items():
        print(f"| `{name}` | {statistics.median(runs):.2f} | {' '.join(f'{t:.2f}' for t in runs)} |")


if __name__ == "__main__":
    main()
