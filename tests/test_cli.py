"""LightningCLI builds ShardStrategy from YAML, by class_path with init_args and by registry name."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_shard import ModuleClassWrapPolicy, ShardingStrategy, ShardStrategy
from tests.models import LitModel

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
    assert strategy._device_mesh == (2, 2)
    assert strategy._wrap_policy == ModuleClassWrapPolicy(frozenset({"GPTBlock", "MLPBlock"}))


def test_strategy_from_registry_name(tmp_path: Path) -> None:
    strategy = _cli(tmp_path, BY_NAME).trainer.strategy
    assert isinstance(strategy, ShardStrategy)
    assert strategy.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP


def test_bad_sharding_strategy_in_yaml_is_refused(tmp_path: Path) -> None:
    with pytest.raises((SystemExit, ValueError)):
        _cli(tmp_path, BY_CLASS_PATH.replace("HYBRID_SHARD", "ZERO4"))
