"""Every Python block in README.md and docs/ runs, and every YAML block parses.

Each block runs on its own in a namespace that defines what the prose assumes: ``L``, ``torch``, ``nn``,
``F``, ``Block`` (a transformer block class), ``build_gpt`` (a small GPT containing Blocks), ``model`` (a
LightningModule) and ``datamodule``. ``Trainer.fit``/``validate``/``test``/``predict`` only record the call,
so blocks that build a Trainer and call ``fit`` run quickly in one process; the Trainer and strategy
construction, and every other line, run for real.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from tests.models import GPTBlock, LitModel, TinyGPT, loader

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


@pytest.fixture
def namespace(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    calls: list[str] = []
    for name in ("fit", "validate", "test", "predict"):
        monkeypatch.setattr(L.Trainer, name, lambda self, *a, _n=name, **k: calls.append(_n))
    return {"L": L, "torch": torch, "nn": nn, "F": F, "Block": GPTBlock, "build_gpt": TinyGPT,
            "model": LitModel("gpt"), "datamodule": _Data(), "__name__": "__doc_snippet__"}


@pytest.mark.parametrize("code", _blocks("python"))
def test_python_block_runs(code: str, namespace: dict[str, Any]) -> None:
    exec(compile(code, "<doc>", "exec"), namespace)  # noqa: S102 - the docs' own code


@pytest.mark.parametrize("text", _blocks("yaml"))
def test_yaml_block_parses(text: str) -> None:
    assert yaml.safe_load(text) is not None
