"""Tensor parallelism composed with sharding, in fresh processes under Lightning's launcher (see
``tests/scripts/tensor_parallel_fit.py``), against DDP on two ranks at fp32 ``assert_close`` defaults, and against
Lightning's ModelParallelStrategy + ``fully_shard`` with the same plan; checkpoints resumed at other sizes."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_shard.testing import run_on_ranks
from tests.jobs import free_port, job_env, script_function, start_jobs

pytestmark = pytest.mark.launch

SCRIPT = Path(__file__).parent / "scripts" / "tensor_parallel_fit.py"


def _launch(root: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--root", str(root)], capture_output=True, text=True,
                          env=job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())), timeout=600)
    assert done.returncode == 0, f"{args}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"


def _losses(root: Path, name: str, ranks: int) -> list[dict[str, Any]]:
    return [torch.load(root / f"{name}-{rank}.pt") for rank in range(ranks)]


def _fits(root: Path) -> Path:
    """The oracle (DDP) on the pooled ranks, with a (dp=2, tp=1) checkpoint after step 3 (it needs no fresh process);
    then two launches: (dp=2, tp=2) saving after step 3, then resuming the (2, 1) checkpoint at (2, 2); the (2, 2)
    checkpoint resumed at (2, 1) and at (1, 2)."""
    for rank, named in enumerate(run_on_ranks(script_function, 2, str(SCRIPT), "run", root, "reference")):
        for name, result in named.items():
            torch.save(result, root / f"{name}-{rank}.pt")
    _launch(root, "--role", "tp", "--devices", "4")
    _launch(root, "--role", "resume", "--devices", "2")
    return root


def _torchrun(root: Path) -> Path:
    script = Path(__file__).parent / "scripts" / "tensor_parallel_torchrun.py"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(script)],
        capture_output=True, text=True, env=job_env(), timeout=300, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    return root


@pytest.fixture(scope="module")
def jobs(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[Path]]:
    """Both jobs, started with the first test, each in a folder of its own: the fits the other tests read ("fits";
    this module's tests call no pooled rank themselves, so the job may) and the torchrun test's ("torchrun")."""
    jobs = {"fits": _fits, "torchrun": _torchrun}
    return start_jobs(request, background, lambda item: "torchrun" if "torchrun" in item.originalname else "fits",
                      lambda name: jobs[name](tmp_path_factory.mktemp(name)))  # fmt: skip


@pytest.fixture
def runs(jobs: dict[str, Future[Path]]) -> Path:
    return jobs["fits"].result()


def test_two_by_two_trains_as_ddp_on_two_ranks_and_as_model_parallel_strategy(runs: Path) -> None:
    """Trainer (our GPT, fp32 with gradient clipping; Hugging Face Llama with its config's plan) and Fabric
    (``parallelize_fn``): the losses DDP has on two ranks with the same global batch, on every rank. Both with the
    model built on the meta device (``torch.device("meta")`` in ``configure_model``, Fabric's
    ``init_module(empty_init=True)``): the losses of the same job without the plan on two ranks. Lightning's
    ModelParallelStrategy + ``fully_shard`` with the same plan has ours without clipping (it cannot clip this
    model)."""
    ddp = _losses(runs, "reference", 2)[0]
    for rank, ours in enumerate(_losses(runs, "tp", 4)):
        assert ours["created"], "the process group existed before the strategy ran: not a fresh process"
        torch.testing.assert_close(ours["fp32"], ddp["fp32"][:3], msg=f"fp32, rank {rank}")
        torch.testing.assert_close(ours["llama"], ddp["llama"], msg=f"Llama, rank {rank}")
        torch.testing.assert_close(ours["fabric"], ddp["fabric"], msg=f"Fabric, rank {rank}")
        for meta in ("trainer_meta", "fabric_meta"):
            torch.testing.assert_close(ours[meta], ddp[meta], msg=f"{meta}: built on the meta device, rank {rank}")
        torch.testing.assert_close(ours["model_parallel"], ours["unclipped"], msg=f"ModelParallelStrategy, rank {rank}")


def test_bf16_mixed_trains_close_to_ddp_in_bf16_mixed(runs: Path) -> None:
    ddp = torch.tensor(_losses(runs, "reference", 2)[0]["bf16"])
    for ours in _losses(runs, "tp", 4):
        torch.testing.assert_close(torch.tensor(ours["bf16"]), ddp, rtol=1.6e-2, atol=0.0)


@pytest.mark.parametrize(
    ("name", "ranks", "steps"),
    [("tp1", 2, slice(3, 6)), ("dp1", 2, slice(3, 6)), ("back", 4, slice(3, 8))],
    ids=["(2,2)->(2,1)", "(2,2)->(1,2)", "(2,1)->(2,2)"],
)
def test_a_checkpoint_resumes_at_other_data_and_tensor_parallel_sizes(
    runs: Path, name: str, ranks: int, steps: slice
) -> None:
    """Every tensor is stored whole: a job resumed at other sizes continues with the uninterrupted losses."""
    ddp = _losses(runs, "reference", 2)[0]["fp32"]
    for rank, resumed in enumerate(_losses(runs, name, ranks)):
        torch.testing.assert_close(resumed["fp32"], ddp[steps], msg=f"{name}, rank {rank}")


def test_inspect_verifies_a_tensor_parallel_checkpoint_and_consolidate_writes_the_whole_model(runs: Path) -> None:
    from safetensors.torch import load_file

    import lightning_shard

    summary = lightning_shard.inspect(runs / "tp-ckpt")
    assert summary.problems == [] and summary.tensor_parallel_size == 2
    assert "x tensor-parallel 2" in str(summary).splitlines()[0]
    whole = load_file(str(lightning_shard.consolidate(runs / "tp-ckpt", runs / "tp.safetensors")))
    from_tp1 = load_file(str(lightning_shard.consolidate(runs / "tp1-ckpt", runs / "tp1.safetensors")))
    assert whole["model.blocks.0.fc.weight"].shape == (128, 32)  # column-wise: rows of both parts
    assert whole["model.blocks.0.out.weight"].shape == (32, 128)  # row-wise: columns of both parts
    assert whole.keys() == from_tp1.keys() and all(whole[k].shape == from_tp1[k].shape for k in whole)


def test_shard_model_with_a_plan_under_torchrun_trains_as_the_whole_model(jobs: dict[str, Future[Path]]) -> None:
    """The plain-PyTorch mode (``shard_model(..., tensor_parallel_size=2)``) in fresh processes under torchrun: the
    script itself checks losses, clipping norms and the whole weights against the unsharded model."""
    jobs["torchrun"].result()
