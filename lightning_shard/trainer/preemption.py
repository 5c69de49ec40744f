"""Preemption in the Trainer: the signal handlers, the step-boundary check and the ``last.ckpt`` it writes.

``ShardStrategy`` attaches this for ``fit``: Lightning's signal connector is replaced by one that installs
``PreemptionWatcher``'s record-only handlers (Lightning's own SIGTERM handler broadcasts from inside the
handler; see [Note: preemption at a step boundary]), and a callback checks at every optimizer-step boundary.
Once the ranks agree, they save ``last.ckpt`` together and the fit ends with ``Preempted``, a
``SIGTERMException`` whose exit status is ``128 + signal number``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_shard.common.preemption import PreemptionWatcher, preemption_signals

if TYPE_CHECKING:
    import lightning.pytorch as pl

LAST_NAME = "last"  # ModelCheckpoint.CHECKPOINT_NAME_LAST; also the name under default_root_dir without one


class Preempted(SIGTERMException):
    """The fit stopped for a preemption signal after every rank saved ``checkpoint_path``; the process exits with
    ``code`` (``128 + signal number``, 143 for SIGTERM) unless the script catches it."""

    def __init__(self, code: int, checkpoint_path: str) -> None:
        super().__init__(code)
        self.checkpoint_path = checkpoint_path


class PreemptionSignalConnector(_SignalConnector):
    """Lightning's signal connector with the preemption signals routed to a ``PreemptionWatcher`` instead of
    Lightning's handlers; the previous handlers come back at the end of the fit, as with Lightning's own."""

    def __init__(self, trainer: pl.Trainer, watcher: PreemptionWatcher, replaced: _SignalConnector) -> None:
        super().__init__(trainer)
        self.watcher = watcher
        self.replaced = replaced  # Lightning's connector, put back by detach_preemption

    @override
    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self._original_handlers = self._get_current_signal_handlers()
        self.watcher.install()

    @override
    def teardown(self) -> None:
        self.watcher.restore()
        super().teardown()


class PreemptionCheckpoint(Callback):
    """At every optimizer-step boundary, asks all ranks whether any received a preemption signal; if so, saves
    ``last.ckpt`` (see ``last_checkpoint_path``) on every rank together and raises ``Preempted``."""

    def __init__(self, watcher: PreemptionWatcher, finish_saves: Callable[[], None]) -> None:
        self.watcher = watcher
        self.finish_saves = finish_saves  # waits for a background save (AsyncCheckpointIO) to be complete
        self._checked_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._checked_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kw: Any) -> None:
        if trainer.global_step == self._checked_step:  # mid-accumulation: not a step boundary
            return
        self._checked_step = trainer.global_step
        if not self.watcher.agree(trainer.strategy.root_device):
            return
        path = save_last_checkpoint(trainer)
        self.finish_saves()
        signal_name = self.watcher.agreed_signal.name if self.watcher.agreed_signal else "a signal"
        rank_zero_info(
            f"Preempted by {signal_name} at step {trainer.global_step}: saved {path}; exiting with status"
            f" {self.watcher.exit_code}. Resume with trainer.fit(..., ckpt_path={_resume_hint(trainer, path)})."
        )
        self.watcher.requeue_if_asked(trainer.global_rank)
        raise Preempted(self.watcher.exit_code, path)


def last_checkpoint_path(trainer: pl.Trainer) -> str:
    """Where a preemption saves: ModelCheckpoint's ``last`` name in its directory (so ``fit(ckpt_path="last")``
    finds it) when the Trainer has one, else ``<default_root_dir>/last.ckpt``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint):
        candidates = callback._monitor_candidates(trainer)
        return callback.format_checkpoint_name(candidates, callback.CHECKPOINT_NAME_LAST)
    return os.path.join(trainer.default_root_dir, LAST_NAME + ModelCheckpoint.FILE_EXTENSION)


def save_last_checkpoint(trainer: pl.Trainer) -> str:
    """Save the state after this step at ``last_checkpoint_path`` (collective), as the ModelCheckpoint's ``last``
    (its ``last_model_path`` is saved with it); one whose ``save_last`` already wrote this step is not saved again."""
    path = last_checkpoint_path(trainer)
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint):
        trainer.save_checkpoint(path)
        return path
    saved_now = callback._last_global_step_saved == trainer.global_step
    if callback.save_last and saved_now and callback.last_model_path == path:
        return path  # its save_last already wrote this step
    previous, callback.last_model_path = callback.last_model_path, path  # part of the saved state, as in its saves
    callback._save_checkpoint(trainer, path)
    if previous and previous != path and callback._should_remove_checkpoint(trainer, previous, path):
        callback._remove_checkpoint(trainer, previous)
    return path


def attach_preemption(trainer: pl.Trainer, finish_saves: Callable[[], None]) -> PreemptionCheckpoint:
    """Install the preemption handling for a fit: the signal connector and the step-boundary callback."""
    signals, requeue = preemption_signals(trainer._accelerator_connector.cluster_environment)
    watcher = PreemptionWatcher(signals, requeue)
    callback = PreemptionCheckpoint(watcher, finish_saves)
    replaced = trainer._signal_connector
    if isinstance(replaced, PreemptionSignalConnector):  # a previous fit's, left by an interrupted teardown
        replaced = replaced.replaced
    trainer._signal_connector = PreemptionSignalConnector(trainer, watcher, replaced)
    _set_callbacks(trainer, [*_other_callbacks(trainer), callback])  # last: after ModelCheckpoint's own saves
    return callback


def detach_preemption(trainer: pl.Trainer) -> None:
    """Undo ``attach_preemption``: restore the signal handlers and Lightning's connector, drop the callback."""
    connector = trainer._signal_connector
    if not isinstance(connector, PreemptionSignalConnector):
        return
    connector.teardown()
    trainer._signal_connector = connector.replaced
    _set_callbacks(trainer, _other_callbacks(trainer))


def _other_callbacks(trainer: pl.Trainer) -> list[Callback]:
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector
    return [cb for cb in callbacks if not isinstance(cb, PreemptionCheckpoint)]


def _set_callbacks(trainer: pl.Trainer, callbacks: list[Callback]) -> None:
    trainer.callbacks = callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector


def _resume_hint(trainer: pl.Trainer, path: str) -> str:
    return '"last"' if isinstance(trainer.checkpoint_callback, ModelCheckpoint) else repr(path)
