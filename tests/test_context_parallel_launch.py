"""Context parallelism in fresh processes under Lightning's launcher (``tests/scripts/context_parallel_fit.py``), as
users run it: 2 data x 2 context ranks train as DDP on 2 ranks (the script's reference, on the pooled ranks), for our
causal LM and Hugging Face Llama."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_shard.testing import run_on_ranks
from tests.jobs import launch_role, script_function
from tests.test_parity import assert_same_training

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).parent / "scripts" / "context_parallel_fit.py"


def test_two_by_two_trains_as_ddp_on_two_ranks(tmp_path: Path, background: ThreadPoolExecutor) -> None:
    launched = background.submit(launch_role, SCRIPT, tmp_path, "cp", 4)
    # The oracle (DDP) needs no fresh process: it runs on the pooled ranks while the job runs.
    reference = {model: run_on_ranks(script_function, 2, str(SCRIPT), "fit", "reference", 2, model == "llama")
                 for model in ("gpt", "llama")}  # fmt: skip
    ours = launched.result()
    for model in ("gpt", "llama"):
        assert all(result["created"] for result in ours), "the process group existed before the strategy ran"
        assert_same_training([r[model] for r in ours], [reference[model][rank // 2] for rank in range(4)])
