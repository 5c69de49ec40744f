"""The examples run as their docstrings say (with fewer steps)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.jobs import job_env

pytestmark = pytest.mark.launch  # every test here starts whole jobs

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_demo_trains_then_samples_after_fit() -> None:
    """The demo (``make demo``) with fewer steps: both ranks train, then sample together after the Trainer has torn
    its process group down, so the forward still reaches the group's own send/recv and collectives."""
    done = _run("examples/train_gpt.py", "--max-steps", "3", "--sample-chars", "20")
    assert "rank 0: final loss" in done.stdout and "rank 1: final loss" in done.stdout
    sample = done.stdout.split("-" * 60)[1]
    assert sample.strip().startswith("TOBIAS:") and len(sample.strip()) > len("TOBIAS:")


def test_lightning_cli_example() -> None:
    _run("main.py", "fit", "--config", "config.yaml", "--trainer.max_steps", "4", cwd=ROOT / "examples" / "cli")


def test_resume_on_another_process_count_then_consolidate(tmp_path: Path) -> None:
    script = "examples/resume_and_consolidate.py"
    _run(script, "--devices", "2", "--max-steps", "4", "--out", str(tmp_path))
    resumed = _run(script, "--devices", "3", "--max-steps", "8", "--out", str(tmp_path), "--resume")
    assert "starting at step 4" in resumed.stdout and "step 8:" in resumed.stdout
    _run("-m", "lightning_shard.cli", "consolidate", str(tmp_path / "last.ckpt"), str(tmp_path / "model.safetensors"))
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights["model.tok_emb.weight"].shape[1] == 64


def test_adapter_finetuning_from_a_local_model_file(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import DATA_PATH, CharDataset

    vocab = CharDataset(DATA_PATH.read_text(encoding="utf-8"), 64).vocab_size
    base = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    state = {k: v.contiguous() for k, v in base.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    save_file(state, str(tmp_path / "gpt2.safetensors"))
    done = _run("examples/finetune_adapters.py", "--max-steps", "3", "--weights", str(tmp_path / "gpt2.safetensors"))
    assert "trained 2,048 of" in done.stdout
    new_keys = ast.literal_eval(done.stdout.split("not in the file (new): ")[1].splitlines()[0])
    assert set(new_keys) == {f"model.transformer.h.{i}.attn.c_attn.{m}" for i in range(2) for m in "AB"}


def test_fabric_example_trains_saves_and_resumes_on_another_process_count(tmp_path: Path) -> None:
    script = "examples/fabric_train_gpt.py"
    first = _run(script, "--devices", "2", "--steps", "3", "--out", str(tmp_path))
    assert "starting at step 0" in first.stdout and "step 3:" in first.stdout
    resumed = _run(script, "--devices", "3", "--steps", "5", "--out", str(tmp_path), "--resume")
    assert "starting at step 3" in resumed.stdout and "step 5:" in resumed.stdout
