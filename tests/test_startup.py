"""Start-up costs only what it uses: ``import lightning_shard`` and the command line's parser import neither torch,
Lightning nor transformers, every command answers ``--help``, the strategy names still reach Lightning's registries
whichever is imported first, and each lazily imported name is the object its ``TYPE_CHECKING`` import names.
The times themselves are measured by ``benchmarks/startup.py``, not asserted here."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest

from lightning_shard.cli import build_parser
from tests.jobs import run_early

HEAVY = ("torch", "lightning", "pytorch_lightning", "transformers", "lightning_shard.engine",
         "lightning_shard.checkpoint")
LAZY_PACKAGES = ("lightning_shard", "lightning_shard.fabric", "lightning_shard.trainer")


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter, as an early check (see [Note: early checks] in tests/jobs.py)."""
    return run_early([sys.executable, "-c", textwrap.dedent(code)], timeout=300)


def _commands() -> list[str]:
    """Every subcommand the parser knows, so that a new one is checked too."""
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(subparsers.choices)


_IMPORTS_AND_HELP = f"""
    import contextlib, io, json, sys
    import lightning_shard, lightning_shard.fabric, lightning_shard.trainer
    from lightning_shard.cli import build_parser, main

    for command in {_commands()!r}:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main([command, "--help"])
    heavy = {HEAVY!r}
    print(json.dumps(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + "." for h in heavy)))))
"""


@pytest.mark.early(check=partial(_fresh_python, _IMPORTS_AND_HELP))
def test_importing_the_packages_and_asking_every_command_for_help_imports_no_framework(
    early: subprocess.CompletedProcess,
) -> None:
    assert early.returncode == 0, early.stderr
    assert json.loads(early.stdout) == []


@pytest.mark.parametrize("command", ["", *_commands()])
def test_every_command_answers_help(command: str) -> None:
    argv = [command, "--help"] if command else ["--help"]
    script = Path(sys.executable).parent / "lightning-shard"
    done = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: lightning-shard {command}".rstrip()), done.stdout


REGISTERED = """
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_shard.fabric

    names = sorted(n for n in StrategyRegistry if n.startswith("shard"))
    assert names == sorted(n for n in STRATEGY_REGISTRY if n.startswith("shard")), names
    trainer = Trainer(strategy="shard_offload", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is lightning_shard.ShardStrategy and trainer.strategy.cpu_offload
    fabric = Fabric(strategy="shard_grad_op", accelerator="cpu", devices=2)
    assert type(fabric.strategy) is lightning_shard.fabric.ShardStrategy
    print(fabric.strategy.sharding_strategy.name, *names)
"""


@pytest.mark.parametrize(
    "imports",
    [pytest.param(imports, marks=pytest.mark.early(check=partial(_fresh_python, imports + textwrap.dedent(REGISTERED))))
     for imports in ("import lightning_shard; import lightning", "import lightning; import lightning_shard")],
)  # fmt: skip
def test_strategy_names_reach_both_registries_whichever_is_imported_first(
    early: subprocess.CompletedProcess, imports: str
) -> None:
    assert early.returncode == 0, early.stderr
    assert early.stdout.split()[-5:] == ["SHARD_GRAD_OP", "shard", "shard_grad_op", "shard_hybrid", "shard_offload"]


def _type_checking_imports(package: str) -> dict[str, str]:
    """Name -> module, as the ``if TYPE_CHECKING:`` block of ``package``'s ``__init__.py`` imports it."""
    tree = ast.parse(Path(importlib.import_module(package).__file__ or "").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names}


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_each_lazy_name_is_the_object_type_checkers_see(package: str) -> None:
    module = importlib.import_module(package)
    seen = _type_checking_imports(package)
    assert sorted(seen) == sorted(set(module.__all__) - {"__version__"})
    for name, source in seen.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name), name
    assert set(module.__all__) <= set(dir(module))


def test_a_name_the_package_lacks_is_an_attribute_error() -> None:
    import lightning_shard

    with pytest.raises(AttributeError, match="module 'lightning_shard' has no attribute 'ShardStratgy'"):
        lightning_shard.ShardStratgy  # noqa: B018
    with pytest.raises(ImportError):
        from lightning_shard import ShardStratgy  # noqa: F401
