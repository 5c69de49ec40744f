"""The character-level GPT of ``examples/train_gpt.py`` driven by LightningCLI, configured from YAML.

Run from this directory:

    python main.py fit --config config.yaml

``config.yaml`` picks ``lightning_shard.ShardStrategy`` by class path with its arguments, the precision,
and the ``ShardMonitor`` callback; any of them can be overridden on the command line, for example
``--trainer.devices 4`` or ``--trainer.strategy.init_args.sharding_strategy SHARD_GRAD_OP``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the model lives in examples/train_gpt.py

from train_gpt import DATA_PATH, CharDataset, CharGPT  # noqa: E402

import lightning_shard  # noqa: E402,F401 - registers the "shard" strategy names


class CharData(L.LightningDataModule):
    """Windows of ``block_size + 1`` characters from the bundled play."""

    def __init__(self, block_size: int = 64, batch_size: int = 16) -> None:
        super().__init__()
        self.dataset = CharDataset(DATA_PATH.read_text(encoding="utf-8"), block_size)
        self.batch_size = batch_size

    @property
    def vocab_size(self) -> int:
        return self.dataset.vocab_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.block_size", "model.block_size")


if __name__ == "__main__":
    CLI(CharGPT, CharData, save_config_callback=None)  # a logger-less run has nowhere to save it
