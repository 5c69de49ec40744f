"""What users bring trains right: torch.optim's optimizers under sharding equal one process, or are refused before
the first step; the user's own ``torch.nn.utils.clip_grad_norm_`` sees whole gradients."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lightning_shard.testing import run_on_ranks
from tests.jobs import free_port, job_env, param, start_jobs
from tests.optimizer_fits import (
    OptimizerRun,
    adafactor_small_head,
    engine_alone,
    lightning_grad_norms,
    one_process,
    setup_refusal,
    sharded,
    trainer_fit,
)


def assert_same_params(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(ours[name], expected, msg=lambda found, name=name: f"{name}: {found}")


@pytest.mark.parametrize("optimizers", ["muon", "adafactor"])
def test_matrix_wise_optimizers_equal_one_process(optimizers: str) -> None:
    run = OptimizerRun(optimizers=optimizers)
    reference = one_process(run)
    for result in run_on_ranks(sharded, 2, run):
        assert_same_params(result["params"], reference["params"])


def test_users_own_clip_grad_norm_equals_one_process() -> None:
    run = OptimizerRun(optimizers="AdamW", clip=0.05)
    reference = one_process(run)
    for result in run_on_ranks(sharded, 2, run):
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]))
        assert_same_params(result["params"], reference["params"])


ELEMENTWISE = ["SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD"]


@pytest.mark.parametrize("optimizer", ELEMENTWISE)
def test_elementwise_optimizers_equal_one_process(optimizer: str) -> None:
    run = OptimizerRun(optimizers=optimizer, steps=3)
    reference = one_process(run)
    for result in run_on_ranks(sharded, 2, run):
        assert_same_params(result["params"], reference["params"])


def test_every_torch_optimizer_is_classified() -> None:
    """A new torch.optim optimizer is either in the rule or refused by name: never run on shards by default."""
    from lightning_shard.engine.optimizer_rule import _DECLARED, _REFUSED

    shipped = {name for name in dir(torch.optim) if isinstance(getattr(torch.optim, name), type)
               and issubclass(getattr(torch.optim, name), torch.optim.Optimizer) and name != "Optimizer"}
    known = {cls.__name__ for cls in _DECLARED if cls.__module__.startswith("torch.optim")}
    assert shipped == known | set(_REFUSED)
    assert set(ELEMENTWISE) | {"Muon", "Adafactor"} == known


@pytest.mark.parametrize(
    ("sharding", "world_size", "mesh"),
    [("SHARD_GRAD_OP", 2, None), ("NO_SHARD", 2, None), ("FULL_SHARD", 3, None), ("HYBRID_SHARD", 4, (2, 2))],
)
def test_muon_under_every_sharding_strategy(sharding: str, world_size: int, mesh: tuple[int, int] | None) -> None:
    kwargs = {"sharding_strategy": sharding} | ({"device_mesh": mesh} if mesh else {})
    run = OptimizerRun(optimizers="muon", steps=3, strategy_kwargs=kwargs)
    if world_size == 3:
        run.optimizers = "adafactor"  # rows three ranks do not divide: a rank holds a short chunk or none
    reference = one_process(run)
    for result in run_on_ranks(sharded, world_size, run):
        assert_same_params(result["params"], reference["params"])


def test_a_users_matrix_wise_optimizer_declared_per_tensor_equals_one_process() -> None:
    run = OptimizerRun(optimizers="NormalizedSGD", steps=3)
    reference = one_process(run)
    for result in run_on_ranks(sharded, 2, run):
        assert_same_params(result["params"], reference["params"])


def test_a_subclass_that_keeps_its_parents_update_runs() -> None:
    assert run_on_ranks(setup_refusal, 2, "AdamWithWarmup") == [None, None]


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("LBFGS", "ShardStrategy cannot run LBFGS: its line search"),
        ("SparseAdam", "ShardStrategy cannot run SparseAdam: it needs sparse gradients"),
        ("NormalizedSGD", 'declare_optimizer_update(NormalizedSGD, "per_tensor")'),
    ],
)
def test_what_cannot_run_exactly_is_refused_before_the_first_step(kind: str, words: str) -> None:
    errors = run_on_ranks(setup_refusal, 2, kind)
    assert all(error is not None and words in error for error in errors), errors


@pytest.mark.parametrize(("optimizers", "world_size"), [("muon", 4), ("adafactor", 3)])
def test_whole_tensor_optimizers_resume_at_another_world_size(tmp_path, optimizers: str, world_size: int) -> None:
    path = str(tmp_path / "ckpt")
    first = OptimizerRun(optimizers=optimizers, steps=2, save_to=path)
    run_on_ranks(sharded, 2, first)
    resumed = OptimizerRun(optimizers=optimizers, steps=2, first_step=2, resume_from=path)
    reference = one_process(OptimizerRun(optimizers=optimizers, steps=4))
    for result in run_on_ranks(sharded, world_size, resumed):
        assert_same_params(result["params"], reference["params"])


def _launch(front: str, root: Path) -> Path:
    script = [str(Path(__file__).parent / "scripts" / "optimizer_fit.py"), "--front", front, "--devices", "2",
              "--root", str(root)]  # fmt: skip
    port = str(free_port())
    if front == "fabric":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", port, *script]  # fmt: skip
        env = job_env()
    else:
        command, env = [sys.executable, *script], job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-6000:]
    return root


@pytest.fixture(scope="module")
def launched(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[Path]]:
    """Each front's job, both started with the first test: the folder its ranks saved in."""
    return start_jobs(request, background, lambda item: param(item, "front"),
                      lambda front: _launch(front, tmp_path_factory.mktemp(front)))  # fmt: skip


@pytest.mark.launch
@pytest.mark.parametrize("front", ["trainer", "fabric"])
def test_muon_and_the_users_clip_in_a_launched_job_equal_one_process(launched: dict, front: str) -> None:
    """As plain-PyTorch users write it, in fresh processes: the Trainer (manual optimization) started by Lightning's
    launcher, a Fabric loop started by torchrun."""
    reference = one_process(OptimizerRun(optimizers="muon", clip=0.05))  # while the jobs run
    root = launched[front].result()
    for rank in range(2):
        result = torch.load(root / f"shard-{rank}.pt")
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]))
        assert_same_params(result["params"], reference["params"])


def test_adafactor_with_a_scheduler_in_the_trainer_equals_ddp() -> None:
    """Automatic optimization: the closure runs before the whole-tensor step, the scheduler still steps."""
    reference = run_on_ranks(trainer_fit, 2, "ddp")
    for ours, theirs in zip(run_on_ranks(trainer_fit, 2, "shard"), reference):
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]))
        assert_same_params(ours["params"], theirs["params"])


def test_grad_norm_gives_lightnings_keys_with_whole_tensor_norms() -> None:
    reference = lightning_grad_norms(0, 1)
    for ours in run_on_ranks(lightning_grad_norms, 2):
        assert ours.keys() == reference.keys()
        for key, expected in reference.items():
            torch.testing.assert_close(ours[key], expected, msg=lambda found, key=key: f"{key}: {found}")


def test_the_trainer_warns_when_a_module_uses_lightnings_grad_norm() -> None:
    from lightning_shard.engine.torch_norms import warn_if_lightning_grad_norm
    from tests.scripts.grad_norm_module import LoggingGradNorm

    said: list[str] = []
    warn_if_lightning_grad_norm(LoggingGradNorm(), said.append)
    assert len(said) == 1 and "lightning_shard.grad_norm(self, norm_type)" in said[0]
    warn_if_lightning_grad_norm(torch.nn.Linear(2, 2), said.append)  # a module whose source does not import it
    assert len(said) == 1


def test_the_engine_alone_runs_muon_prepared_and_refuses_it_unprepared() -> None:
    reference = one_process(OptimizerRun(optimizers="muon"))
    for result in run_on_ranks(engine_alone, 2, True):
        assert not isinstance(result, str), result
        assert_same_params(result["params"], reference["params"])
    for error in run_on_ranks(engine_alone, 2, False):
        assert isinstance(error, str) and "lightning_shard.engine.prepare_optimizer(optimizer, model)" in error, error


def test_whole_state_shaped_like_a_ranks_rows_saves_whole_and_resumes(tmp_path) -> None:
    """Adafactor's (1, C) column statistics of a 2-row head at 2 ranks look like each rank's one row: the save stores
    them whole, as the step holds them, and a resume at 3 ranks goes on as one process."""
    path = str(tmp_path / "ckpt")
    reference = adafactor_small_head(0, 1, path, False)
    run_on_ranks(adafactor_small_head, 2, path, False)
    for result in run_on_ranks(adafactor_small_head, 3, path, True, timeout=120):
        assert_same_params(result, reference)
