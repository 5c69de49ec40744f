"""Every Python block in README.md and docs/ runs, and every YAML block builds its Trainer through LightningCLI.

Each block runs on its own, in a temporary working directory, in a namespace that defines what the prose
assumes: ``L``, ``torch``, ``nn``, ``F``, ``Block`` (a transformer block class), ``build_gpt`` (a small GPT
containing Blocks), ``model`` (a LightningModule), ``datamodule`` and ``loader`` (batches of (tokens,
next tokens) for ``build_gpt``). ``Trainer.fit``/``validate``/``test``/``predict`` only record the call, so
blocks that build a Trainer and call ``fit`` run quickly in one process; the Trainer and strategy
construction, and every other line, run for real. A ``Fabric`` runs for real too, in this one process:
it is built with ``devices=1`` (the only change), so a Fabric block trains, saves and loads at world size 1.
A block that initialises the process group itself finds the environment ``torchrun`` would set for one rank.
``dataset`` is the map-style dataset behind ``loader`` (96 pairs of (tokens, next tokens)).

Every YAML block is a LightningCLI config; it is built with ``LightningCLI(run=False)`` and the test model, so the
Trainer and the strategy it names are really constructed. A block that names a GPU accelerator is built with
``accelerator: cpu`` where no GPU is present (the only line changed).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from tests.jobs import free_port
from tests.models import GPTBlock, LitModel, TinyGPT, loader, make_dataset

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(language: str) -> list[Any]:
    found = []
    for doc in DOCS:
        for i, match in enumerate(_BLOCK.finditer(doc.read_text())):
            if match.group(1) == language:
                found.append(pytest.param(match.group(2), id=f"{doc.name}-{i}"))
    return found


class _Data(L.LightningDataModule):
    def train_dataloader(self) -> Any:
        return loader("gpt")




class _OneProcessFabric(L.Fabric):
    """``L.Fabric`` as a doc block builds it, with ``devices=1`` so that it runs inside the test process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **(kwargs | {"devices": 1}))


def quickstart_script() -> str:
    """quickstart.md's first Python block: the ``quickstart.py`` the reader saves."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    return next(m.group(2) for m in _BLOCK.finditer(text) if m.group(1) == "python")


@pytest.fixture
def namespace(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    import signal

    import torch.distributed as dist

    sigterm_handler = signal.getsignal(signal.SIGTERM)  # a Fabric block may watch for preemption
    calls: list[str] = []
    for name in ("fit", "validate", "test", "predict"):
        monkeypatch.setattr(L.Trainer, name, lambda self, *a, _n=name, **k: calls.append(_n))
    monkeypatch.chdir(tmp_path)
    # What torchrun sets, for a block that calls torch.distributed.init_process_group() itself: one rank.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    # quickstart.md's later blocks import from the quickstart.py its first block saves.
    (tmp_path / "quickstart.py").write_text(quickstart_script())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "quickstart", raising=False)
    lightning = type(L)("lightning")  # the block's `import lightning as L` must see the one-process Fabric
    lightning.__dict__.update(L.__dict__ | {"Fabric": _OneProcessFabric})
    monkeypatch.setitem(__import__("sys").modules, "lightning", lightning)
    yield {"L": lightning, "torch": torch, "nn": nn, "F": F, "Block": GPTBlock, "build_gpt": TinyGPT,
           "model": LitModel("gpt"), "datamodule": _Data(), "loader": loader("gpt"),
           "dataset": make_dataset("gpt"), "__name__": "__doc_snippet__"}
    if dist.is_initialized():  # a Fabric block initialised a one-rank process group in this process
        dist.destroy_process_group()
    signal.signal(signal.SIGTERM, sigterm_handler)


# Names a block may use without defining them: what the prose says is the reader's own code (see the docstring).
_PLACEHOLDERS = ("Block", "build_gpt", "model", "datamodule", "loader", "dataset", "MyModel", "make_loader",
                 "resume_from")
_PYTHON_BLOCKS = _blocks("python")


def test_every_python_block_imports_what_it_uses(tmp_path: Path) -> None:
    """A reader copies a block into a file of their own: every name it uses is imported or defined in it (``L``,
    ``torch`` and ``F`` too, which the namespace above also gives), except the reader's own code the prose names."""
    files = []
    for i, block in enumerate(_PYTHON_BLOCKS):
        files.append(tmp_path / f"{block.id.replace('.', '_').replace('-', '_')}_{i}.py")
        files[-1].write_text(block.values[0])
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run(
        [str(ruff), "check", "--no-cache", "--isolated", "--select", "F821", "--output-format", "concise",
         "--config", f"builtins={list(_PLACEHOLDERS)}", *map(str, files)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("code", _PYTHON_BLOCKS)
def test_python_block_runs(code: str, namespace: dict[str, Any]) -> None:
    exec(compile(code, "<doc>", "exec"), namespace)  # noqa: S102 - the docs' own code


_CLI_SECTIONS = {"seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path"}


@pytest.mark.parametrize("text", _blocks("yaml"))
def test_yaml_block_builds_its_trainer_through_lightning_cli(text: str, tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = yaml.safe_load(text)
    assert isinstance(config, dict) and set(config) <= _CLI_SECTIONS, (
        f"not a LightningCLI config (top-level keys {sorted(config) if isinstance(config, dict) else config!r});"
        " a YAML block of another kind needs its own check here"
    )
    path = tmp_path / "config.yaml"
    path.write_text(text)
    args = ["--config", str(path), "--model.kind", "gpt"]
    if config.get("trainer", {}).get("accelerator") in ("gpu", "cuda") and not torch.cuda.is_available():
        args += ["--trainer.accelerator", "cpu"]
    cli = LightningCLI(LitModel, run=False, args=args, save_config_callback=None)
    strategy = config.get("trainer", {}).get("strategy")
    if isinstance(strategy, dict):  # class_path and init_args: an instance of exactly that class
        module, _, name = strategy["class_path"].rpartition(".")
        assert type(cli.trainer.strategy) is getattr(importlib.import_module(module), name)


# The defaults the docs state, against the code's #

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _argument_table() -> dict[str, str]:
    """The user guide's "Constructor arguments" table: argument name -> the Default cell."""
    text = (DOCS / "user_guide.md").read_text()
    table = text[text.index("## Constructor arguments"):].split("\n\n")[1]
    rows: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        names, default = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for name in re.findall(r"`(\w+)`", names):
            rows[name] = default
    return rows


def _stated_value(cell: str) -> Any:
    """The value a Default cell states: a Python literal in backticks, or a number of minutes."""
    if minutes := re.fullmatch(r"(\d+) minutes", cell):
        from datetime import timedelta

        return timedelta(minutes=int(minutes.group(1)))
    literal = re.match(r"`([^`]+)`", cell)
    assert literal, f"a Default cell that states no value: {cell!r}"
    return eval(literal.group(1), {})  # noqa: S307 - the docs' own literals ("FULL_SHARD", None, True)


def test_every_default_the_user_guide_states_is_the_codes() -> None:
    import inspect

    from lightning_shard import ShardStrategy
    from lightning_shard.common.options import DEFAULT_TIMEOUT
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    table = _argument_table()
    not_in_the_table = {"self", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                        "precision_plugin", "precision", "storage_options", "activation_checkpointing"}
    fronts = [inspect.signature(cls.__init__).parameters for cls in (ShardStrategy, FabricShardStrategy)]
    for parameters in fronts:
        left_out = set(parameters) - not_in_the_table - table.keys()
        assert not left_out, f"arguments the table leaves out: {sorted(left_out)}"
    from lightning_shard.common.options import ShardOptions

    for name, parsed in inspect.signature(ShardOptions.parse).parameters.items():  # what validates them
        for parameters in fronts:
            assert parameters[name].default == parsed.default, f"{name}: a front end defaults it otherwise"
    for name, cell in table.items():
        stated = _stated_value(cell)
        defaults = [parameters[name].default for parameters in fronts if name in parameters]
        assert defaults, f"the table documents {name}, which neither front end takes"
        for actual in defaults:
            if name == "timeout":
                assert actual is None and stated == DEFAULT_TIMEOUT, (cell, DEFAULT_TIMEOUT)
            else:
                assert stated == actual, f"{name}: the docs say {cell}, the code has {actual!r}"


def test_every_page_that_states_the_collective_timeouts_default_states_the_codes() -> None:
    from lightning_shard.common.options import DEFAULT_TIMEOUT

    pages = [*DOCS.glob("*.md"), DOCS.parent / "README.md"]
    claims = []
    for page in pages:
        for line in page.read_text().splitlines():
            if "timeout" not in line.lower():
                continue
            # "default ... N minutes" about this package's timeout (PyTorch's own defaults are named as PyTorch's)
            for match in re.finditer(r"default[^.|]*?(\d+) minutes", line):
                if "PyTorch" not in line[max(0, match.start() - 20):match.start()]:
                    claims.append((page.name, int(match.group(1)), line.strip()[:100]))
    assert claims, "no page states the timeout's default"
    wrong = [c for c in claims if c[1] != DEFAULT_TIMEOUT.total_seconds() / 60]
    assert not wrong, wrong
