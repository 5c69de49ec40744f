"""LightningCLI builds ShardStrategy from YAML, by class_path with init_args and by registry name, and refuses a
bad value naming it; the ``lightning-shard`` command's errors are one line naming what is wrong, exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_shard import ModuleClassWrapPolicy, ShardingStrategy, ShardStrategy
from lightning_shard.cli import main
from lightning_shard.engine.option_choices import PipelineSchedule, StateDictType
from tests.models import LitModel

FIXTURE_CHECKPOINT = Path(__file__).parent / "fixtures" / "checkpoint_v1" / "checkpoint"

BY_CLASS_PATH = """
trainer:
  accelerator: cpu
  devices: 4
  logger: false
  strategy:
    class_path: lightning_shard.ShardStrategy
    init_args:
      sharding_strategy: HYBRID_SHARD
      device_mesh: [2, 2]
      auto_wrap_policy: [GPTBlock, MLPBlock]
model:
  kind: mlp
"""

BY_NAME = """
trainer:
  accelerator: cpu
  devices: 2
  logger: false
  strategy: shard_grad_op
model:
  kind: gpt
"""


def _cli(tmp_path: Path, text: str) -> LightningCLI:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    return LightningCLI(LitModel, run=False, args=["--config", str(config)], save_config_callback=None)


def test_strategy_from_class_path_and_init_args(tmp_path: Path) -> None:
    strategy = _cli(tmp_path, BY_CLASS_PATH).trainer.strategy
    assert isinstance(strategy, ShardStrategy)
    assert strategy.sharding_strategy is ShardingStrategy.HYBRID_SHARD
    assert strategy.options.device_mesh == (2, 2)
    assert strategy.options.wrap_policy == ModuleClassWrapPolicy(frozenset({"GPTBlock", "MLPBlock"}))


def test_the_command_line_overrides_an_init_arg_of_the_yaml_files_strategy(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(BY_CLASS_PATH.replace("sharding_strategy: HYBRID_SHARD\n      device_mesh: [2, 2]",
                                            "pipeline_schedule: gpipe\n      state_dict_type: full"))
    cli = LightningCLI(LitModel, run=False, save_config_callback=None,
                       args=["--config", str(config), "--trainer.strategy.init_args.tensor_parallel_size", "2"])
    options = cli.trainer.strategy.options
    assert (options.pipeline_schedule, options.state_dict_type) == (PipelineSchedule.GPIPE, StateDictType.FULL)
    assert options.tensor_parallel_size == 2
    assert options.wrap_policy == ModuleClassWrapPolicy(frozenset({"GPTBlock", "MLPBlock"}))


def test_strategy_from_registry_name(tmp_path: Path) -> None:
    strategy = _cli(tmp_path, BY_NAME).trainer.strategy
    assert isinstance(strategy, ShardStrategy)
    assert strategy.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP


def test_bad_sharding_strategy_in_yaml_is_refused_naming_it_and_the_valid_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _cli(tmp_path, BY_CLASS_PATH.replace("HYBRID_SHARD", "ZERO4"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert 'Parser key "sharding_strategy"' in err and "Given value: ZERO4" in err, err
    assert "{FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,HYBRID_SHARD}" in err, err


# --------------------------------------------------------------------------------------------------
# The lightning-shard command
# --------------------------------------------------------------------------------------------------


def _command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run ``lightning-shard *argv`` in this process: its exit status (argparse's own errors exit) and stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    return code, capsys.readouterr().err


def test_command_names_a_directory_that_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _command(capsys, "consolidate", str(tmp_path / "nowhere"), str(tmp_path / "m.safetensors"))
    assert code == 2 and err.startswith(f"lightning-shard: {tmp_path / 'nowhere'} is not a lightning_shard"), err
    code, err = _command(capsys, "inspect", str(tmp_path))
    assert (code, err) == (2, f"lightning-shard: {tmp_path / 'index.json'} is missing: {tmp_path} is not a complete"
                              " checkpoint.\n")


def test_command_refuses_an_unknown_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _command(capsys, "merge")
    expected = "invalid choice: 'merge' (choose from 'consolidate', 'inspect', 'estimate', 'export', 'convert')"
    assert code == 2 and expected in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sharding-strategy", "ZERO4"], "lightning-shard: Unknown sharding_strategy 'ZERO4'. Valid values are:"
                                           " 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD'.\n"),
        (["--optimizer", "lion"], "lightning-shard: Unknown optimizer 'lion'. Valid values are: adamw, adam, sgd,"
                                  " sgd_momentum.\n"),
        (["--wrap", "Nope"], "lightning-shard: auto_wrap_policy names Nope, but no module of the model has that"
                             " class. Module classes present: Embedding, GPTBlock, LayerNorm, Linear, ModuleList,"
                             " TinyGPT.\n"),
    ],
    ids=["sharding_strategy", "optimizer", "wrap"],
)
def test_estimate_names_a_bad_option_in_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert _command(capsys, "estimate", "tests.models:TinyGPT", "--world-size", "2", *args) == (2, message)


@pytest.mark.parametrize(
    ("factory", "reason"),
    [("tests.models:Nope", "module 'tests.models' has no attribute 'Nope'"),
     ("no_such_module:build", "No module named 'no_such_module'"),
     ("tests.models", "no ':callable' part")],
    ids=["no_such_callable", "no_such_module", "no_colon"],
)
def test_estimate_names_a_factory_it_cannot_load(capsys: pytest.CaptureFixture[str], factory: str, reason: str) -> None:
    expected = (f"lightning-shard: cannot load the model factory {factory!r} (module:callable): {reason}. Modules are"
                " imported from the current directory and PYTHONPATH.\n")
    assert _command(capsys, "estimate", factory, "--world-size", "2") == (2, expected)


def test_estimate_refuses_a_world_size_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _command(capsys, "estimate", "tests.models:TinyGPT", "--world-size", "0")
    assert code == 2 and "argument --world-size: must be a whole number of at least 1, got '0'" in err, err


def _console(*argv: str, cwd: Path, stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess:
    """The installed ``lightning-shard`` console script, as a user runs it in ``cwd``, with PYTHONPATH unset."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = Path(sys.executable).parent / "lightning-shard"
    return subprocess.run([str(script), *argv], cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=120)


@pytest.mark.launch
def test_a_factory_in_the_current_directory_is_found_as_python_m_finds_it(tmp_path: Path) -> None:
    (tmp_path / "mymodels.py").write_text(
        "from torch import nn\n\n\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(64, 64)\n\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n\n\n"
        "def build():\n"
        "    return nn.Sequential(*[Block() for _ in range(4)])\n"
    )
    done = _console("estimate", "mymodels:build", "--world-size", "8", "--wrap", "Block", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("per rank: parameters"), done.stdout


@pytest.mark.launch
def test_inspect_into_a_pipe_its_reader_closed_ends_quietly(tmp_path: Path) -> None:
    """``lightning-shard inspect CKPT | head``: the reader may go before everything is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone: every write fails with EPIPE
    try:
        done = _console("inspect", str(FIXTURE_CHECKPOINT), cwd=tmp_path, stdout=write_end)
    finally:
        os.close(write_end)
    assert done.stderr == "" and done.returncode == 0, done.stderr


def fit_by_registry_name(rank: int, world_size: int, strategy_name: str) -> list[str]:
    """A fit with ``Trainer(strategy=...)`` given by name; the warnings rank 0 saw that mention units."""
    import warnings

    import lightning as L

    from tests.models import loader

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy_name, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LitModel("gpt"), train_dataloaders=loader("gpt"))
    return [str(w.message) for w in caught if "one unit" in str(w.message)]


def test_a_model_left_one_unit_on_several_ranks_is_warned_about_naming_the_fix() -> None:
    from lightning_shard.testing import run_on_ranks

    ranks = run_on_ranks(fit_by_registry_name, 2, "shard")
    assert len(ranks[0]) == 1 and ranks[1] == [], ranks  # once, by rank 0
    assert "made the whole LitModel one unit" in ranks[0][0] and "auto_wrap_policy={YourBlock}" in ranks[0][0]
    assert "class_path: lightning_shard.ShardStrategy" in ranks[0][0]
