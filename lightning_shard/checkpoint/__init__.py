"""Checkpoints as directories of safetensors and JSON (no pickle), loadable at any world size; built on the engine,
used by both front ends. ``save_checkpoint`` / ``load_checkpoint`` (``state``) are the plain-PyTorch entry points.
The parts are in rooms, each importing only from the rooms before it: ``format`` (the on-disk spec: names, limits,
errors, dtypes, safe names, safetensors headers, the trainer state as JSON, the peft adapters a save records), ``io``
(where bytes live and how they move: locations, files, ``index.json``, which file holds which rows, reading rows,
writing files, ``agreement``: every rank raises what any rank raised), ``save`` (writing a directory, committing
it, in the background) and ``load`` (reading it back, ``inspect``), ``interop`` (every other format, read and
written in one module each: Hugging Face and peft, DCP, Lightning ``.ckpt``, GGUF; one exporter interface), then
``open`` (the opener of every checkpoint) and what builds on it: ``state``, ``averaged_load`` (averaged weights read
back on resume) and ``convert``; ``state_dicts`` gives a sharded model's state dicts."""

from lightning_shard.checkpoint.state import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
