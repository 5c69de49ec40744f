"""The examples run as their docstrings say (with fewer steps)."""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.jobs import job_env, start_jobs

pytestmark = pytest.mark.launch  # every test here starts whole jobs

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _demo(out: Path) -> list[subprocess.CompletedProcess]:
    return [_run("examples/train_gpt.py", "--max-steps", "3", "--sample-chars", "20")]


def _lightning_cli(out: Path) -> list[subprocess.CompletedProcess]:
    cli = ROOT / "examples" / "cli"
    return [_run("main.py", "fit", "--config", "config.yaml", "--trainer.max_steps", "4", cwd=cli)]


def _resume_and_consolidate(out: Path) -> list[subprocess.CompletedProcess]:
    script = "examples/resume_and_consolidate.py"
    return [
        _run(script, "--devices", "2", "--max-steps", "4", "--out", str(out)),
        _run(script, "--devices", "3", "--max-steps", "8", "--out", str(out), "--resume"),
        _run("-m", "lightning_shard.cli", "consolidate", str(out / "last.ckpt"), str(out / "model.safetensors")),
    ]


def _finetune_adapters(out: Path) -> list[subprocess.CompletedProcess]:
    from transformers import GPT2Config, GPT2LMHeadModel

    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import DATA_PATH, CharDataset

    vocab = CharDataset(DATA_PATH.read_text(encoding="utf-8"), 64).vocab_size
    base = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    state = {k: v.contiguous() for k, v in base.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    save_file(state, str(out / "gpt2.safetensors"))
    return [_run("examples/finetune_adapters.py", "--max-steps", "3", "--weights", str(out / "gpt2.safetensors"))]


def _fabric_train_and_resume(out: Path) -> list[subprocess.CompletedProcess]:
    script = "examples/fabric_train_gpt.py"
    return [
        _run(script, "--devices", "2", "--steps", "3", "--out", str(out)),
        _run(script, "--devices", "3", "--steps", "5", "--out", str(out), "--resume"),
    ]


# What each test runs, in order, in a folder of its own.
_JOBS = {
    "test_demo_trains_then_samples_after_fit": _demo,
    "test_lightning_cli_example": _lightning_cli,
    "test_resume_on_another_process_count_then_consolidate": _resume_and_consolidate,
    "test_adapter_finetuning_from_a_local_model_file": _finetune_adapters,
    "test_fabric_example_trains_saves_and_resumes_on_another_process_count": _fabric_train_and_resume,
}


@pytest.fixture(scope="module")
def started(
    request: pytest.FixtureRequest, background: ThreadPoolExecutor, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[tuple[Path, list[subprocess.CompletedProcess]]]]:
    """Each test's runs, all started with the first test, by test."""

    def run(test: str) -> tuple[Path, list[subprocess.CompletedProcess]]:
        out = tmp_path_factory.mktemp(test.removeprefix("test_")[:40])
        return out, _JOBS[test](out)

    return start_jobs(request, background, lambda item: item.originalname, run)


@pytest.fixture
def runs(request: pytest.FixtureRequest, started: dict) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """This test's folder and its runs, in order."""
    return started[request.node.originalname].result()


def test_demo_trains_then_samples_after_fit(runs: tuple) -> None:
    """The demo (``make demo``) with fewer steps: both ranks train, then sample together after the Trainer has torn
    its process group down, so the forward still reaches the group's own send/recv and collectives."""
    _, (done,) = runs
    assert "rank 0: final loss" in done.stdout and "rank 1: final loss" in done.stdout
    sample = done.stdout.split("-" * 60)[1]
    assert sample.strip().startswith("TOBIAS:") and len(sample.strip()) > len("TOBIAS:")


def test_lightning_cli_example(runs: tuple) -> None:
    _, (done,) = runs
    assert done.returncode == 0


def test_resume_on_another_process_count_then_consolidate(runs: tuple) -> None:
    out, (_, resumed, _) = runs
    assert "starting at step 4" in resumed.stdout and "step 8:" in resumed.stdout
    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.tok_emb.weight"].shape[1] == 64


def test_adapter_finetuning_from_a_local_model_file(runs: tuple) -> None:
    _, (done,) = runs
    assert "trained 2,048 of" in done.stdout
    new_keys = ast.literal_eval(done.stdout.split("not in the file (new): ")[1].splitlines()[0])
    assert set(new_keys) == {f"model.transformer.h.{i}.attn.c_attn.{m}" for i in range(2) for m in "AB"}


def test_fabric_example_trains_saves_and_resumes_on_another_process_count(runs: tuple) -> None:
    _, (first, resumed) = runs
    assert "starting at step 0" in first.stdout and "step 3:" in first.stdout
    assert "starting at step 3" in resumed.stdout and "step 5:" in resumed.stdout
