"""Whether the Trainer is inside its own ``trainer.save_checkpoint``: there, state read through the strategy is the
sharded views the save writes from, never a full gather.

[Note: a Trainer save gathers nothing it does not write]
``trainer.save_checkpoint`` first builds Lightning's checkpoint dict (``_CheckpointConnector.dump_checkpoint``), which
calls ``strategy.lightning_module_state_dict()`` and ``strategy.optimizer_state(optimizer)`` for every save, then runs
the callbacks' and the LightningModule's ``on_save_checkpoint(checkpoint)``, then hands the dict to
``strategy.save_checkpoint``, which writes the model and optimizers from the shards themselves and drops
``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"]``. Under ``state_dict_type="full"`` the full state
dict would be gathered onto rank 0 (the whole model and optimizer state in CPU memory, one all-gather per tensor) for
nothing, before the save gathers every tensor again to write it.

So the strategy wraps the Trainer's ``save_checkpoint`` (on the Trainer instance, at the first set-up; it stays for
the Trainer's life, so a save after ``fit`` returned is covered too): while it runs, the scope is
``SaveScope.TRAINER_SAVE`` and state read through the strategy is the sharded layout, whatever ``state_dict_type``
says: ``DTensor`` views of this rank's rows, which cost no copy and no communication (a 0-dim parameter costs one
broadcast of one element). That is what ``on_save_checkpoint`` hooks find in ``checkpoint["state_dict"]`` and
``checkpoint["optimizer_states"]`` under either layout; a hook that wants full tensors calls ``full_tensor()`` on them
on every rank (every rank runs the hooks). Outside the save (a callback's ``on_train_epoch_end``, an exporter after
``fit``), the strategy gives the layout ``state_dict_type`` names. Wrapping the Trainer's own entry point rather than
the connector's ``dump_checkpoint`` keeps a direct call of ``dump_checkpoint`` on the full contract, and needs no
guess about who called.
"""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl


class SaveScope(enum.Enum):
    """Where state read through the strategy is read from."""

    OUTSIDE = "outside"  # a caller of the strategy's methods: the layout state_dict_type names
    TRAINER_SAVE = "trainer_save"  # inside trainer.save_checkpoint: the sharded views (see the note)


_WATCHED_BY = "_lightning_shard_save_scope"  # attribute of the wrapper: the TrainerSaves that installed it


class TrainerSaves:
    """Follows ``trainer.save_checkpoint`` calls (see [Note: a Trainer save gathers nothing it does not write])."""

    def __init__(self) -> None:
        self.scope = SaveScope.OUTSIDE

    def watch(self, trainer: pl.Trainer) -> None:
        """Wrap ``trainer.save_checkpoint`` so that ``scope`` is ``TRAINER_SAVE`` while it runs; once per Trainer."""
        original = trainer.save_checkpoint
        if getattr(original, _WATCHED_BY, None) is self:
            return

        @functools.wraps(original)
        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            previous, self.scope = self.scope, SaveScope.TRAINER_SAVE
            try:
                original(*args, **kwargs)
            finally:
                self.scope = previous

        setattr(save_checkpoint, _WATCHED_BY, self)
        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
