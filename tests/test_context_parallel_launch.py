"""Context parallelism in fresh processes under Lightning's launcher (``tests/scripts/context_parallel_fit.py``), as
users run it: 2 data x 2 context ranks train as DDP on 2 ranks, for our causal LM and Hugging Face Llama."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobs import launch_role
from tests.test_parity import assert_same_training

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).parent / "scripts" / "context_parallel_fit.py"


def _launch(root: Path, role: str, devices: int) -> list[dict]:
    return launch_role(SCRIPT, root, role, devices)


def test_two_by_two_trains_as_ddp_on_two_ranks(tmp_path: Path) -> None:
    reference = _launch(tmp_path, "reference", 2)
    ours = _launch(tmp_path, "cp", 4)
    for model in ("gpt", "llama"):
        assert all(result["created"] for result in ours), "the process group existed before the strategy ran"
        assert_same_training([r[model] for r in ours], [reference[rank // 2][model] for rank in range(4)])
