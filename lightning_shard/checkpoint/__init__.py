"""Checkpoints as directories of safetensors and JSON (no pickle), loadable at any world size; built on the engine,
used by both front ends. ``save_checkpoint`` / ``load_checkpoint`` are the plain-PyTorch entry points; ``format``
(the files and the index), ``save``, ``load`` (and ``load_safetensors_into``), ``consolidate`` (one file,
``inspect``) and ``agreement`` (every rank raises what any rank raised) are the parts."""

from lightning_shard.checkpoint.state import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
