"""Checkpoints as directories of safetensors and JSON (no pickle), loadable at any world size; built on the engine,
used by both front ends. ``save_checkpoint`` / ``load_checkpoint`` (``state``) are the plain-PyTorch entry points.
The parts are in rooms by responsibility, each importing only from the rooms before it: ``format`` (names, limits,
errors, dtypes, safe names, safetensors headers, the trainer state as JSON, peft adapters), ``io`` (locations,
files, ``index.json``, which file holds which rows, reading rows, writing files, ``agreement``: every rank raises
what any rank raised), ``save`` (writing a directory, committing it, in the background) and ``load`` (reading it
back, and ``load_safetensors_into``), ``foreign`` (``sources``: what a path holds and the one way to open it;
checkpoints of other strategies read without running their pickles, loaded or converted) and ``tools``
(``consolidate`` and ``inspect``, exports to Hugging Face, PEFT, DCP and a Lightning ``.ckpt``). ``state`` and
``averaged_load`` (averaged weights read back on resume) sit above ``foreign``, below ``tools``."""

from lightning_shard.checkpoint.state import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
