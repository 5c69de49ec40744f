"""Checkpoints as directories of safetensors and JSON (no pickle), loadable at any world size; built on the engine,
used by both front ends. ``save_checkpoint`` / ``load_checkpoint`` are the plain-PyTorch entry points; ``format``
(names, limits, safe files and their headers), ``index`` (``index.json``), ``layout`` (which file holds which rows),
``reader`` (reading rows), ``save``, ``load`` (and ``load_safetensors_into``), ``consolidate`` (one file,
``inspect``) and ``agreement`` (every rank raises what any rank raised) are the parts. Checkpoints of other
strategies come in through ``sources`` (what a path holds; ``lightning_ckpt`` and ``dcp`` read them, ``safe_pickle``
without running their pickles, ``foreign_load`` loads them, ``convert`` rewrites them) and go out through
``dcp_export``."""

from lightning_shard.checkpoint.state import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
