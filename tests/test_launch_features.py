"""The fine-tuning and storage features as users run them (``tests/scripts/features_fit.py``): fresh jobs under
Lightning's own launcher, where ``ShardStrategy`` creates the process group, against DDP in the same process.

A 2-rank job trains with ``EMAWeightAveraging`` and a ``GlobalBatchLoader``, checkpointing to ``s3://`` (the S3 test
server on 127.0.0.1) with ``save_trainable_only=True`` (frozen embeddings left out), and samples with ``generate``
(sharded weights, a different length per rank) and inside ``summon_full_params``; a 3-rank job resumes from the
bucket's ``last.ckpt`` (``ckpt_path="last"``) to the uninterrupted DDP run, writing no ``last-v1.ckpt`` beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.jobs import job_env
from tests.s3_server import running_s3_server

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).parent / "scripts" / "features_fit.py"
URL = "s3://features/run"


def _launch(root: Path, env: dict[str, str], devices: int, steps: int, *extra: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", str(devices), "--steps", str(steps), "--url", URL,
         "--root", str(root), *extra],
        env=job_env(**env), cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"


def _results(root: Path, devices: int) -> list[tuple[dict, dict]]:
    return [
        (torch.load(root / f"shard-{devices}-{rank}.pt"), torch.load(root / f"ddp-{devices}-{rank}.pt"))
        for rank in range(devices)
    ]


def test_averaging_sampling_and_an_s3_checkpoint_in_fresh_jobs_match_ddp(tmp_path: Path) -> None:
    import s3fs

    with running_s3_server() as server:
        s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint}).mkdir(
            "features"
        )
        _launch(tmp_path, server.env, 2, 4)
        bucket = s3fs.S3FileSystem(
            key="testing", secret="testing", client_kwargs={"endpoint_url": server.endpoint}, skip_instance_cache=True
        )
        objects = bucket.ls("features/run/last.ckpt")
        index = json.loads(bucket.cat("features/run/last.ckpt/index.json"))
        _launch(tmp_path, server.env, 3, 8, "--resume")
        after_resume = bucket.ls("features/run", refresh=True)

    assert any(name.endswith("/index.json") for name in objects)
    assert sorted(name.rsplit("/", 1)[1] for name in after_resume) == ["last.ckpt"]  # resumed into, not beside
    frozen = ["model/model.blocks.0.qkv.weight", "model/model.wpe.weight", "model/model.wte.weight"]
    assert sorted(index["left_out"]) == frozen  # the test GPT's own frozen weights, and the embeddings
    assert not (tmp_path / "s3:").exists()  # the URL was never taken for a local path
    for rank, (ours, ddp) in enumerate(_results(tmp_path, 2)):
        assert ours["created"], "the process group existed before the strategy ran: not a fresh process"
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), msg=f"rank {rank}")
        for name, expected in ddp["weights"].items():  # the average, copied in at the end of fit
            torch.testing.assert_close(ours["weights"][name], expected, msg=f"{name}, rank {rank}")
        assert len(ours["tokens"]["own_length"]) == 3 + 3 + rank
        assert ours["tokens"]["own_length"] == ddp["tokens"]["own_length"] == ours["tokens"]["full_weights"]
    for rank, (ours, ddp) in enumerate(_results(tmp_path, 3)):
        assert ours["created"]
        assert len(ours["losses"]) == 4  # steps 5 to 8: the loader resumed where the 2-rank job stopped
        # Losses after resharding 2 -> 3 ranks: the suite's resume tolerance (tests/test_checkpoint.py).
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"][4:]), rtol=0, atol=1e-5)
        for name, expected in ddp["weights"].items():
            torch.testing.assert_close(ours["weights"][name], expected, msg=f"{name}, rank {rank}")
