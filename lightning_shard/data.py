"""``GlobalBatchLoader``: the same global batch at every optimizer step whatever the number of processes, and an
epoch that resumes mid-way from a checkpoint, at any world size, with exactly the batches it had left.

    from lightning_shard import GlobalBatchLoader

    class Model(L.LightningModule):
        def train_dataloader(self):
            return GlobalBatchLoader(dataset, global_batch_size=48, seed=0)

Step ``s`` of epoch ``e`` trains on the samples ``order[s * G:(s + 1) * G]`` of the epoch's order (a permutation
seeded by ``seed + e``, or ``0..N-1`` with ``shuffle=False``); rank ``r`` of ``W`` takes the ``r``-th ``G / W`` of
them. See [Note: the same global batch at any world size] in docs/operations.md.

The loader's ``state_dict()`` is its position: the epoch and the global samples consumed in it. The Trainer saves it
in every checkpoint and restores it on ``fit(ckpt_path=...)`` (it does so for any training loader that has
``state_dict``/``load_state_dict``); under Fabric, put the loader in the state dict given to ``fabric.save`` and
``fabric.load``. The state is plain integers and booleans, stored as JSON.

``GlobalBatchSampler`` is the sampler underneath, for a ``DataLoader`` of one's own.

[Note: a GlobalBatchSampler is a DistributedSampler]
The Trainer (with its default use_distributed_sampler=True) and Fabric's setup_dataloaders() replace a training
loader's sampler by a DistributedSampler, or wrap a custom one in a DistributedSamplerWrapper, unless it already
is a DistributedSampler. Wrapped, each rank would train on a 1/W share of its own share, silently. Being a
DistributedSampler (which it is: it splits the data over the ranks) keeps both away, so the user writes nothing
and use_distributed_sampler may be True or False. Its num_samples and total_size keep DistributedSampler's meaning
(this rank's and all ranks' samples per epoch); its drop_last is about the last global batch, not the last ranks.

[Note: the position counts delivered batches]
A DataLoader with worker processes draws indices from its sampler ahead of training (prefetch_factor batches per
worker), so the batches a sampler has handed out are not the batches trained on. A GlobalBatchLoader moves the
position as it hands each batch to the loop; the Trainer checkpoints at a step's end, after that step's batch was
handed over, so the position saved is the batches trained on. The position is counted in global samples, neither
batches nor one rank's samples, so that it means the same at every world size.

[Note: set_epoch after a restore]
The Trainer restores the loader's state, then calls set_epoch(epoch) with the restored epoch, then draws the first
batch: the position stays. It calls it with a later epoch when the checkpoint says the restored epoch ended: written
after the epoch's last batch (the epoch is complete: nothing is lost), or at the end of a fit that max_steps stopped
mid-epoch (Lightning counts that epoch as finished: its remaining batches are skipped, with a warning). Fabric's
setup_dataloaders() wrapper calls set_epoch(n) at its n-th pass, n counting from 0 in every process: after restoring
epoch 2 it would start epoch 0 over. Going back to an earlier epoch is refused until the first batch is drawn.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

# What identifies the order a position refers to: a checkpoint's position only means something for the same values.
_ORDER_KEYS = ("global_batch_size", "dataset_size", "shuffle", "seed", "drop_last")
_POSITION_KEYS = ("epoch", "consumed_samples")


class _Counting(enum.Enum):
    """What moves a ``GlobalBatchSampler``'s position forward. See [Note: the position counts delivered batches]."""

    HANDED_OUT = "handed out"  # the sampler itself, per global batch it hands to its DataLoader
    DELIVERED = "delivered"  # its GlobalBatchLoader, per batch it delivers to the training loop


class _Origin(enum.Enum):
    """Where the current position came from. See [Note: set_epoch after a restore]."""

    REACHED = "reached"  # set_epoch, then the batches counted since
    RESTORED = "restored"  # load_state_dict, and no batch drawn since


class GlobalBatchSampler(DistributedSampler[int]):
    """This rank's indices of every global batch of ``global_batch_size`` samples, from the position reached.

    Each global batch holds the same samples at any world size that divides ``global_batch_size``; rank ``r`` of
    ``W`` gets its ``r``-th ``global_batch_size // W`` of them (``local_batch_size``, the batch size of its
    ``DataLoader``). An epoch has ``steps_per_epoch`` global batches: ``len(dataset) // global_batch_size`` with
    ``drop_last=True`` (the samples of the last, partial global batch are left out of that epoch), else
    ``ceil(len(dataset) / global_batch_size)``, the last one completed with samples from the start of the epoch's
    order (as ``DistributedSampler`` pads). ``set_epoch(epoch)`` chooses the order (seeded by ``seed + epoch``) and
    starts that epoch from its beginning; called with the epoch it is at, it keeps the position.

    ``len()`` is the whole epoch's count for this rank, wherever the position is, so that a loop counts the batches
    of a resumed epoch as in an uninterrupted one. ``state_dict()`` is the position (epoch and global samples
    consumed, whatever the world size) with the values that fix the order; ``load_state_dict`` refuses a position
    recorded for another order. Used in a plain ``DataLoader``, the position counts the batches the sampler handed
    out, which is what was trained on only for a loader without worker processes; ``GlobalBatchLoader`` counts the
    batches it delivers (see [Note: the position counts delivered batches]).

    ``num_replicas`` and ``rank`` default to the default process group's; without one, pass them.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        global_batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(
                f"GlobalBatchSampler needs a map-style dataset with a length; a {type(dataset).__name__} has none."
                " An IterableDataset decides its own order: split it over the ranks inside the dataset instead."
            )
        num_replicas, rank = _world(num_replicas, rank)
        _check_global_batch_size(global_batch_size, num_replicas)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"GlobalBatchSampler: seed must be an int, got {seed!r}.")
        dataset_size = len(dataset)
        steps = dataset_size // global_batch_size if drop_last else math.ceil(dataset_size / global_batch_size)
        if steps == 0:
            raise ValueError(
                f"GlobalBatchSampler: the dataset has {dataset_size} samples, not one global batch of"
                f" {global_batch_size}{' with drop_last=True' if drop_last else ''}. Use a smaller global_batch_size"
                + ("." if dataset_size == 0 else " or drop_last=False (the batch is completed from the epoch's start).")
            )
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // num_replicas
        self.dataset_size = dataset_size
        self.steps_per_epoch = steps
        self.num_samples = steps * self.local_batch_size  # DistributedSampler's meaning: this rank's, per epoch
        self.total_size = steps * global_batch_size  # all ranks', per epoch
        self._consumed = 0  # global samples of this epoch consumed; a multiple of global_batch_size
        self._counting = _Counting.HANDED_OUT
        self._origin = _Origin.REACHED

    # Position #

    @property
    def consumed_samples(self) -> int:
        """Global samples of the current epoch consumed so far (at every world size the same number)."""
        return self._consumed

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first global batch, or keep the position when already at ``epoch``.

        Right after ``load_state_dict`` an earlier epoch than the restored one is refused, and a later one, while
        the restored epoch is not complete, drops its remaining batches with a warning (see [Note: set_epoch after a
        restore]).
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"GlobalBatchSampler.set_epoch: epoch must be an int >= 0, got {epoch!r}.")
        if epoch == self.epoch:
            return  # keeps the position: the one restored, or the one reached in this epoch
        if self._origin is _Origin.RESTORED:
            self._leave_restored_epoch(epoch)
        self.epoch, self._consumed, self._origin = epoch, 0, _Origin.REACHED

    def state_dict(self) -> dict[str, Any]:
        """The position (``epoch``, ``consumed_samples``) and the values that fix the order; plain ints and bools."""
        return {
            "epoch": self.epoch,
            "consumed_samples": self._consumed,
            "global_batch_size": self.global_batch_size,
            "dataset_size": self.dataset_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from the position of ``state_dict`` (written at any world size); the next pass starts there.

        Raises ``ValueError`` if it was recorded for another order (global batch size, dataset size, shuffle, seed
        or drop_last differ) or is not a position of this epoch's global batches."""
        _check_keys(state_dict)
        mine = self.state_dict()
        differ = [f"{k}={state_dict[k]!r} (now {mine[k]!r})" for k in _ORDER_KEYS if state_dict[k] != mine[k]]
        if differ:
            raise ValueError(
                "GlobalBatchSampler: the data position in the checkpoint was recorded for another order: "
                + ", ".join(differ)
                + ". Build the loader with the values the checkpoint was written with to resume its epoch exactly."
            )
        epoch, consumed = state_dict["epoch"], state_dict["consumed_samples"]
        valid = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, consumed))
        if not valid or consumed % self.global_batch_size or consumed > self.total_size:
            raise ValueError(
                f"GlobalBatchSampler: epoch={epoch!r}, consumed_samples={consumed!r} is not a position: it needs an"
                f" epoch >= 0 and a multiple of global_batch_size={self.global_batch_size} up to {self.total_size}."
            )
        self.epoch, self._consumed, self._origin = epoch, consumed, _Origin.RESTORED

    # Iteration #

    def __iter__(self) -> Iterator[int]:
        first_step = self._begin_pass()
        order = self._epoch_order()
        share = self.local_batch_size
        for step in range(first_step, self.steps_per_epoch):
            if self._counting is _Counting.HANDED_OUT:
                self._consumed = (step + 1) * self.global_batch_size
            # See [Note: the same global batch at any world size] in docs/operations.md.
            start = step * self.global_batch_size + self.rank * share
            yield from order[start : start + share]

    def __len__(self) -> int:
        return self.num_samples

    def _begin_pass(self) -> int:
        """The first global batch of a pass: where the position is. Runs at the pass's first ``next()``, so after
        the ``set_epoch`` that the Trainer calls once it has created the iterator."""
        if self._epoch_complete:
            raise RuntimeError(
                f"GlobalBatchSampler: epoch {self.epoch} is complete (all {self.steps_per_epoch} global batches were"
                f" consumed). Call set_epoch({self.epoch + 1}) before the next pass; the Trainer and Fabric's"
                " setup_dataloaders() do it for you."
            )
        self._origin = _Origin.REACHED
        return self._consumed // self.global_batch_size

    def _epoch_order(self) -> list[int]:
        """All the epoch's sample indices in training order, completed to ``total_size`` from the start."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        missing = self.total_size - len(order)
        if missing > 0:  # drop_last=False: the last global batch takes samples from the start of the order
            order += (order * math.ceil(missing / len(order)))[:missing]
        return order

    def _leave_restored_epoch(self, epoch: int) -> None:
        """``set_epoch(epoch)`` to another epoch than the restored one, before any batch of it was drawn."""
        where = f"epoch {self.epoch}, {self._consumed} of {self.total_size} samples consumed"
        if epoch < self.epoch:
            raise ValueError(
                f"GlobalBatchSampler.set_epoch({epoch}) right after a checkpoint restored the data position ({where})"
                f" would go back to an earlier epoch. Iterate epoch {self.epoch} next (call set_epoch({self.epoch}) or"
                " leave the epoch alone). Under Fabric, iterate the GlobalBatchLoader itself, not the loader"
                " fabric.setup_dataloaders() returns: that wrapper sets the epoch to the number of passes it started,"
                " counting from 0 in every process."
            )
        if not self._epoch_complete and self.rank == 0:
            warnings.warn(
                f"GlobalBatchSampler: the loop moved to epoch {epoch} right after a checkpoint restored the data"
                f" position ({where}); the rest of epoch {self.epoch} is skipped. The Trainer does this when it"
                " resumes from a checkpoint saved at the end of a fit that max_steps stopped mid-epoch. A checkpoint"
                " saved at a step's end (ModelCheckpoint(every_n_train_steps=...), a preemption) resumes mid-epoch"
                " exactly.",
                stacklevel=3,
            )

    def _advance(self) -> None:
        """A ``GlobalBatchLoader`` delivered one global batch. See [Note: the position counts delivered batches]."""
        self._consumed += self.global_batch_size

    @property
    def _epoch_complete(self) -> bool:
        return self._consumed >= self.total_size


class GlobalBatchLoader(DataLoader):
    """A ``DataLoader`` of this rank's share of every global batch, whose position saves and restores.

    ``GlobalBatchLoader(dataset, global_batch_size, shuffle=True, seed=0, drop_last=False, num_replicas=None,
    rank=None, **dataloader_kwargs)``: the order is ``GlobalBatchSampler``'s (``loader.sampler``), the batch size
    ``global_batch_size // world_size``; other ``DataLoader`` arguments (``num_workers``, ``collate_fn``,
    ``pin_memory``...) pass through. ``state_dict()``/``load_state_dict()`` are the sampler's, the position counting
    the batches this loader delivered (exact with worker processes that prefetch ahead). A pass starts from the
    position, so a new pass after a ``break`` continues where the last one stopped; ``set_epoch(epoch)`` moves to
    another epoch (the Trainer calls it every epoch; a loop of one's own calls it before each pass).

    Build it where the processes exist: in ``LightningModule.train_dataloader()`` or a ``LightningDataModule``, or
    after ``fabric.launch()``; elsewhere (a script's top level under Lightning's launcher) pass
    ``num_replicas=trainer.world_size, rank=trainer.global_rank``. The Trainer leaves its sampler in place with or
    without ``use_distributed_sampler`` (see [Note: a GlobalBatchSampler is a DistributedSampler]).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        clashes = sorted(set(dataloader_kwargs) & {"batch_size", "sampler", "batch_sampler"})
        if clashes:
            raise TypeError(
                f"GlobalBatchLoader sets {', '.join(clashes)} itself from global_batch_size and the world size;"
                " remove the argument."
            )
        sampler = GlobalBatchSampler(
            dataset, global_batch_size, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
            drop_last=drop_last,
        )  # fmt: skip
        sampler._counting = _Counting.DELIVERED
        super().__init__(dataset, batch_size=sampler.local_batch_size, sampler=sampler, **dataloader_kwargs)
        self._global_batch_sampler = sampler

    @property
    def epoch(self) -> int:
        """The epoch the loader is at (the last ``set_epoch``, or the restored one)."""
        return self._global_batch_sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """``GlobalBatchSampler.set_epoch``: start ``epoch`` from its beginning, or keep the position within it."""
        self._global_batch_sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches this loader delivered; see ``GlobalBatchSampler.state_dict``."""
        return self._global_batch_sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a position saved at any world size; see ``GlobalBatchSampler.load_state_dict``."""
        self._global_batch_sampler.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return self._deliver()

    def _deliver(self) -> Iterator[Any]:
        """The batches of one pass, each counted as it is handed to the loop. A generator: the underlying iterator
        (and with it the sampler's pass and any workers' prefetching) starts at the first ``next()``."""
        for batch in super().__iter__():
            self._global_batch_sampler._advance()
            yield batch


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """The world size and this process's rank: as given, else the default process group's."""
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "GlobalBatchSampler: no process group is initialized, so the world size and this process's rank are"
                " unknown. Build the loader once the processes run (in LightningModule.train_dataloader(), a"
                " LightningDataModule, or after fabric.launch()), or pass num_replicas and rank (e.g."
                " num_replicas=trainer.world_size, rank=trainer.global_rank)."
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"GlobalBatchSampler: rank {rank} is not one of num_replicas={num_replicas} ranks.")
    return num_replicas, rank


def _check_global_batch_size(global_batch_size: int, world_size: int) -> None:
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise ValueError(f"GlobalBatchSampler: global_batch_size must be a positive int, got {global_batch_size!r}.")
    if global_batch_size % world_size:
        below = global_batch_size // world_size * world_size
        options = " or ".join(str(n) for n in (below, below + world_size) if n > 0)
        raise ValueError(
            f"GlobalBatchSampler: global_batch_size={global_batch_size} is not divisible by the world size"
            f" {world_size}, so the ranks cannot take equal shares of each global batch. Use a multiple of"
            f" {world_size} (e.g. {options}); a job that may restart on other world sizes needs one that all of"
            " them divide (12 serves 1, 2, 3, 4, 6 and 12 ranks)."
        )


def _check_keys(state_dict: Any) -> None:
    expected = set(_POSITION_KEYS + _ORDER_KEYS)
    if not isinstance(state_dict, dict) or set(state_dict) != expected:
        found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"GlobalBatchSampler: a data position has the keys {sorted(expected)}; got {found}. Was it saved by"
            " another kind of loader?"
        )
