"""What both front ends need to read each other's checkpoint directories (see [Note: Fabric state in a checkpoint
directory] in ``lightning_shard.fabric.checkpoint``)."""

from __future__ import annotations

from typing import Any

FABRIC_OBJECTS = "lightning_shard_fabric_objects"  # trainer-state key: which Fabric state keys held module, optimizers


def as_trainer_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict for a directory's trainer state. A Fabric-written one has no loop counters,
    schedulers or version: the Trainer then starts its loops at zero with the model and optimizer state loaded,
    and Fabric's own values (e.g. ``"step"``) stay in the dict for ``on_load_checkpoint`` to read."""
    if state.pop(FABRIC_OBJECTS, None) is None:
        return state
    import lightning

    state.setdefault("pytorch-lightning_version", lightning.__version__)
    state.setdefault("lr_schedulers", [])
    return state
