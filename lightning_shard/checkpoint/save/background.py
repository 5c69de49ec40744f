"""Saving in the background: training waits only while each rank copies its shards aside.

[Note: background saves]
``BackgroundSaver.save`` does on the calling thread only what every rank must do together on the
default process group (agree on the temporary directory, turn the trainer state into JSON) and what
must not race with training (copy this rank's rows of the parameters and optimizer state into
memory of their own: at most this rank's shard, on the CPU, and the small tensors it stores whole,
which it receives from the other ranks of its shard group there: see [Note: small tensors stored
whole]). A worker thread then writes this
rank's file and finishes the directory as a synchronous save does, agreeing over a gloo process
group of its own, so its collectives never interleave with the training's on the default group.
The directory appears (renamed into place by rank 0) only once every rank has written its file.
At most one save is in flight: the next save, ``wait()`` and the end of training wait for it, and
a failure in the background is raised on every rank there (the worker's agreement told every rank).
Only the sharded layout is written in the background; the full layout gathers every tensor on the
default group, which cannot leave the training thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.io.storage import Location
from lightning_shard.checkpoint.save.directory import PreparedSave, _ShardedWriter, prepare_save
from lightning_shard.engine.option_choices import StateDictType
from lightning_shard.engine.sharded_module import ShardedModule


def refuse_full_layout_in_background(layout: StateDictType, switch: str, instead: str) -> None:
    """Refuse background saves (``switch``: the setting that asked for them) of the full layout, which gathers every
    tensor on the training's process group; ``instead``: how to save in the foreground."""
    if layout is not StateDictType.SHARDED:
        raise ValueError(
            f"{switch} saves the sharded layout in the background; state_dict_type='full' gathers every tensor on the"
            f" training's process group. Use state_dict_type='sharded' or {instead}."
        )


class BackgroundSaver:
    """Writes checkpoint directories in a worker thread, one at a time (see [Note: background saves])."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: Any = None  # a gloo group for the worker's agreement, created at the first save

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        engine: ShardedModule,
        module: nn.Module,
        optimizers: Sequence[Optimizer],
        checkpoint: dict[str, Any],
        path: Location,
        layout: StateDictType,
    ) -> None:
        """Start writing ``checkpoint`` at ``path`` in the background, after the previous save has finished (whose
        failure, if any, is raised here on every rank). Collective: every rank must call it."""
        assert layout is StateDictType.SHARDED, "refused when the strategy is set up: refuse_full_layout_in_background"
        self.wait()
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # collective: every rank creates it at its first save
        prepared = prepare_save(engine, module, optimizers, checkpoint, path, layout)
        plan = prepared.plan
        assert isinstance(plan, _ShardedWriter)
        copies = [(key, _copy_aside(t), rows) for key, t, rows in plan.local_tensors()]
        prepared.tensors = {k: _copy_aside(t) for k, t in prepared.tensors.items()}
        self._thread = threading.Thread(
            target=self._write, args=(prepared, copies), name="lightning_shard-background-save", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Wait for the save in flight; raise its failure (on every rank, as every rank saw it fail)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the save in flight and release the worker's process group."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():  # else it went with the default group
                dist.destroy_process_group(self._group)
            self._group = None

    def _write(self, prepared: PreparedSave, copies: list[tuple[str, Tensor, tuple[int, int] | None]]) -> None:
        plan = prepared.plan
        assert isinstance(plan, _ShardedWriter)
        try:
            prepared.write(lambda: plan.write_tensors(copies), self._group)
        except BaseException as err:  # noqa: BLE001 - raised on the training thread by wait()
            self._error = err


def _copy_aside(tensor: Tensor) -> Tensor:
    """A CPU copy that training cannot change any more (pinned for a fast device-to-host copy on GPUs)."""
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    out.copy_(tensor.detach(), non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return out
