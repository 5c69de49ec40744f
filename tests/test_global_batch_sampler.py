"""``GlobalBatchLoader`` / ``GlobalBatchSampler``: every step trains on the same samples at every world size, and a
fit preempted mid-epoch resumes on another world size with exactly the batches it had left, under the Trainer (the
loader's position travels in the checkpoint by itself) and under Fabric (the loader in ``fabric.save``'s state)."""

from __future__ import annotations

import json
import math
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_shard import GlobalBatchLoader, GlobalBatchSampler, ShardStrategy
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy
from lightning_shard.testing import run_on_ranks
from lightning_shard.trainer.preemption import Preempted
from tests.fabric_fits import optimizer_for
from tests.models import LitModel, MLPBlock, MLPStack, make_dataset

GLOBAL_BATCH = 12  # divisible by 2 and by 3
SEED = 7
STEPS_PER_EPOCH = 96 // GLOBAL_BATCH  # make_dataset's 96 samples
PREEMPTED_AT = 12  # the signal comes as step 11 starts; the ranks stop after it: 4 of epoch 1's 8 batches done
MAX_STEPS = 20  # into epoch 2: the resumed run crosses an epoch boundary


def reference_batches(
    n: int, global_batch: int, epochs: int, *, seed: int = SEED, shuffle: bool = True, drop_last: bool = False
) -> list[list[int]]:
    """The global batches of ``epochs`` epochs, written out from the definition: a permutation seeded by
    ``seed + epoch`` cut into consecutive global batches, the last one completed from the start of the order."""
    batches = []
    for epoch in range(epochs):
        if shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        else:
            order = list(range(n))
        steps = n // global_batch if drop_last else math.ceil(n / global_batch)
        order = (order * 2)[: steps * global_batch]
        batches += [order[s * global_batch : (s + 1) * global_batch] for s in range(steps)]
    return batches


def indexed(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def global_steps(loaders: list[Any], epochs: int = 1) -> list[list[int]]:
    """Each step's global batch: the ranks' batches in rank order, for ``epochs`` epochs of ``set_epoch`` passes."""
    steps: list[list[int]] = []
    for epoch in range(epochs):
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # as the Trainer does
        per_rank = [[batch[0].tolist() for batch in loader] for loader in loaders]
        steps += [sum((rank[s] for rank in per_rank), []) for s in range(len(per_rank[0]))]
    return steps


# Order #


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 12])
def test_every_step_trains_on_the_same_samples_at_every_world_size(world_size: int) -> None:
    loaders = [GlobalBatchLoader(indexed(30), 12, num_replicas=world_size, rank=r, seed=SEED) for r in
               range(world_size)]  # fmt: skip
    assert [len(loader) for loader in loaders] == [3] * world_size  # ceil(30 / 12) steps, whatever the world size
    assert global_steps(loaders, epochs=2) == reference_batches(30, 12, epochs=2)


def test_drop_last_leaves_out_the_last_partial_global_batch_and_shuffle_false_keeps_the_dataset_order() -> None:
    loaders = [GlobalBatchLoader(indexed(30), 12, num_replicas=3, rank=r, drop_last=True) for r in range(3)]
    assert global_steps(loaders, epochs=2) == reference_batches(30, 12, 2, seed=0, drop_last=True)
    plain = [GlobalBatchLoader(indexed(30), 12, num_replicas=2, rank=r, shuffle=False) for r in range(2)]
    assert global_steps(plain) == [[*range(12)], [*range(12, 24)], [*range(24, 30), *range(6)]]


def test_the_sampler_alone_serves_a_plain_data_loader() -> None:
    samplers = [GlobalBatchSampler(indexed(30), 12, num_replicas=3, rank=r, seed=SEED) for r in range(3)]
    loaders = [DataLoader(indexed(30), batch_size=s.local_batch_size, sampler=s) for s in samplers]
    assert global_steps(loaders, epochs=2) == reference_batches(30, 12, epochs=2)


# Position #


def test_a_position_saved_on_2_ranks_resumes_on_3_with_exactly_the_remaining_batches() -> None:
    before = [GlobalBatchLoader(indexed(96), 12, num_replicas=2, rank=r, seed=SEED) for r in range(2)]
    iterators = []
    for loader in before:
        loader.set_epoch(1)
        iterators.append(iter(loader))
    trained = [sum((next(it)[0].tolist() for it in iterators), []) for _ in range(3)]
    state = before[0].state_dict()
    assert state == before[1].state_dict()  # the same position on every rank
    assert (state["epoch"], state["consumed_samples"]) == (1, 36)  # in global samples: the world size is not in it

    after = [GlobalBatchLoader(indexed(96), 12, num_replicas=3, rank=r, seed=SEED) for r in range(3)]
    for loader in after:
        loader.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it: JSON
        loader.set_epoch(1)  # what the Trainer does after restoring: the position stays
    per_rank = [[batch[0].tolist() for batch in loader] for loader in after]
    remaining = [sum((rank[s] for rank in per_rank), []) for s in range(len(per_rank[0]))]
    assert trained + remaining == reference_batches(96, 12, epochs=2)[8:]
    assert after[0].state_dict()["consumed_samples"] == 96  # the epoch is complete
    after[0].set_epoch(2)
    assert after[0].state_dict()["consumed_samples"] == 0  # a new epoch starts from its beginning


def test_the_position_counts_batches_delivered_not_those_workers_prefetched() -> None:
    loader = GlobalBatchLoader(indexed(96), 12, num_replicas=2, rank=0, num_workers=2, prefetch_factor=2)
    batches = iter(loader)
    for _ in range(3):
        next(batches)  # the workers have drawn up to 4 batches more from the sampler by now
    assert loader.state_dict()["consumed_samples"] == 36
    del batches
    again = [batch[0].tolist() for batch in loader]  # a new pass continues after the delivered batches
    assert len(again) == STEPS_PER_EPOCH - 3 and loader.state_dict()["consumed_samples"] == 96


def test_the_state_is_plain_json_values() -> None:
    state = GlobalBatchLoader(indexed(30), 12, num_replicas=2, rank=1).state_dict()
    assert json.loads(json.dumps(state)) == state
    assert all(type(v) in (int, bool) for v in state.values()), state


def test_a_complete_epoch_is_not_started_again_without_set_epoch() -> None:
    loader = GlobalBatchLoader(indexed(30), 12, num_replicas=1, rank=0)
    assert len(list(loader)) == 3
    with pytest.raises(RuntimeError, match=r"epoch 0 is complete .* Call set_epoch\(1\)"):
        next(iter(loader))


def restored_at(epoch: int, batches: int) -> GlobalBatchLoader:
    """A loader restored from the position of one that was at ``epoch`` after ``batches`` batches."""
    saved = GlobalBatchLoader(indexed(96), 12, num_replicas=1, rank=0)
    saved.set_epoch(epoch)
    for _, _ in zip(range(batches), saved):
        pass
    loader = GlobalBatchLoader(indexed(96), 12, num_replicas=1, rank=0)
    loader.load_state_dict(saved.state_dict())
    return loader


def test_after_a_restore_set_epoch_to_an_earlier_epoch_is_refused() -> None:
    loader = restored_at(2, 1)
    with pytest.raises(ValueError, match=r"set_epoch\(0\) right after a checkpoint restored .*epoch 2, 12 of 96.*"
                                         r" earlier epoch.*iterate the GlobalBatchLoader itself"):  # fmt: skip
        loader.set_epoch(0)  # what Fabric's setup_dataloaders() wrapper does on its first pass in a new process
    loader.set_epoch(2)  # what the Trainer does: the position stays
    assert len(list(loader)) == STEPS_PER_EPOCH - 1


def test_after_a_restore_a_later_epoch_skips_the_rest_of_the_restored_one_with_a_warning() -> None:
    loader = restored_at(2, 1)
    with pytest.warns(UserWarning, match=r"moved to epoch 3 .*epoch 2, 12 of 96 .*the rest of epoch 2 is skipped"):
        loader.set_epoch(3)  # the Trainer, resuming from the end of a fit that max_steps stopped mid-epoch
    assert loader.state_dict()["consumed_samples"] == 0 and len(list(loader)) == STEPS_PER_EPOCH

    complete = restored_at(2, STEPS_PER_EPOCH)  # written after the epoch's last batch: nothing to skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        complete.set_epoch(3)
    assert complete.state_dict()["consumed_samples"] == 0


# Refusals #


def test_a_global_batch_the_world_size_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=8 is not divisible by the world size 3.*e\.g\. 6 or 9"):
        GlobalBatchLoader(indexed(96), 8, num_replicas=3, rank=0)


ONE_RANK = {"num_replicas": 1, "rank": 0}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (ONE_RANK | {"global_batch_size": 0}, ValueError, "global_batch_size must be a positive int, got 0"),
        ({"global_batch_size": 12, "num_replicas": 2, "rank": 2}, ValueError, "rank 2 is not one of num_replicas=2"),
        ({"global_batch_size": 12}, ValueError, "no process group is initialized.*pass num_replicas and rank"),
        (ONE_RANK | {"global_batch_size": 128, "drop_last": True}, ValueError, "96 samples, not one global batch"),
        (ONE_RANK | {"global_batch_size": 12, "batch_size": 6}, TypeError, "sets batch_size itself"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_do(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GlobalBatchLoader(indexed(96), **kwargs)


def test_an_iterable_dataset_is_refused() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(10))

    with pytest.raises(TypeError, match="needs a map-style dataset"):
        GlobalBatchLoader(Stream(), 2, num_replicas=1, rank=0)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"global_batch_size": 6}, r"another order: global_batch_size=6 \(now 12\)"),
        ({"seed": 1, "dataset_size": 90}, r"dataset_size=90 \(now 96\), seed=1 \(now 7\)"),
        ({"consumed_samples": 30}, "consumed_samples=30 is not a position"),
        ({"consumed_samples": 108}, "consumed_samples=108 is not a position"),
        ({"epoch": -1}, "epoch=-1, consumed_samples=0 is not a position"),
        ({"step": 3}, "a data position has the keys"),
    ],
)
def test_a_position_for_another_order_is_refused(change: dict, match: str) -> None:
    loader = GlobalBatchLoader(indexed(96), 12, num_replicas=2, rank=0, seed=SEED)
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(loader.state_dict() | change)


# Trainer and Fabric, on several ranks #


def indexed_mlp_data() -> TensorDataset:
    """``make_dataset("mlp")`` with each sample's index, for the fits to record what they trained on."""
    x, y = make_dataset("mlp").tensors
    return TensorDataset(x, y, torch.arange(len(x)))


class RecordingModel(LitModel):
    """Trains on a ``GlobalBatchLoader``; records each step's sample indices and this rank's loss."""

    def __init__(self) -> None:
        super().__init__("mlp")
        self.seen: dict[int, tuple[list[int], float]] = {}

    def train_dataloader(self) -> GlobalBatchLoader:
        return GlobalBatchLoader(indexed_mlp_data(), GLOBAL_BATCH, seed=SEED)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, index = batch
        loss = super().training_step((x, y), batch_idx)
        self.seen[self.trainer.global_step] = (index.tolist(), self.losses[-1])
        return loss


class SignalAtStep(L.Callback):
    """SIGTERM to rank 1 when global step ``step`` starts, as a scheduler preempting the job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def trainer_fit(rank: int, world_size: int, root: str, max_steps: int, signal_at: int | None, resume: bool) -> dict:
    L.seed_everything(0)
    model = RecordingModel()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ShardStrategy(auto_wrap_policy={MLPBlock}),
        max_steps=max_steps, callbacks=[SignalAtStep(signal_at)] if signal_at is not None else [],
        enable_checkpointing=False, default_root_dir=root, logger=False, enable_progress_bar=False,
        enable_model_summary=False,  # use_distributed_sampler keeps its default, True
    )  # fmt: skip
    try:
        trainer.fit(model, ckpt_path=str(Path(root, "last.ckpt")) if resume else None)
    except Preempted:
        pass
    return {"seen": model.seen, "step": trainer.global_step}


def merged(results: list[dict]) -> dict[int, tuple[list[int], float]]:
    """Per step: the global batch (the ranks' samples in rank order) and its loss (the mean of the ranks')."""
    steps = results[0]["seen"].keys()
    assert all(r["seen"].keys() == steps for r in results)
    return {
        s: (sum((r["seen"][s][0] for r in results), []), sum(r["seen"][s][1] for r in results) / len(results))
        for s in sorted(steps)
    }


def assert_resumed_run_is_the_uninterrupted_one(
    uninterrupted: dict[int, tuple[list[int], float]],
    first: dict[int, tuple[list[int], float]],
    resumed: dict[int, tuple[list[int], float]],
) -> None:
    assert list(uninterrupted) == list(range(MAX_STEPS))
    assert [batch for batch, _ in uninterrupted.values()] == reference_batches(96, GLOBAL_BATCH, 3)[:MAX_STEPS]
    assert list(first) == list(range(PREEMPTED_AT)) and list(resumed) == list(range(PREEMPTED_AT, MAX_STEPS))
    for step, (batch, _) in (first | resumed).items():
        assert batch == uninterrupted[step][0], f"step {step}"
    losses = torch.tensor([loss for _, loss in resumed.values()])
    expected = torch.tensor([uninterrupted[s][1] for s in resumed])
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)  # 3 ranks sum in another order than 2


def test_a_trainer_fit_preempted_mid_epoch_on_2_ranks_resumes_on_3_with_the_remaining_batches(tmp_path: Path) -> None:
    uninterrupted = merged(run_on_ranks(trainer_fit, 2, str(tmp_path / "reference"), MAX_STEPS, None, False))
    root = str(tmp_path / "run")
    first = run_on_ranks(trainer_fit, 2, root, MAX_STEPS, PREEMPTED_AT - 1, False)
    assert [r["step"] for r in first] == [PREEMPTED_AT] * 2  # stopped after step 11: mid epoch 1
    state = json.loads(Path(root, "last.ckpt", "trainer_state.json").read_text())
    position = {"epoch": 1, "consumed_samples": (PREEMPTED_AT - STEPS_PER_EPOCH) * GLOBAL_BATCH}
    assert position.items() <= _find_position(state).items()
    resumed = run_on_ranks(trainer_fit, 3, root, MAX_STEPS, None, True)
    assert_resumed_run_is_the_uninterrupted_one(uninterrupted, merged(first), merged(resumed))


def _find_position(tree: Any) -> dict[str, Any]:
    """The loader's state inside the trainer state's JSON, wherever Lightning nests it."""
    if isinstance(tree, dict):
        if "consumed_samples" in tree:
            return tree
        found = [_find_position(v) for v in tree.values()]
    elif isinstance(tree, list):
        found = [_find_position(v) for v in tree]
    else:
        return {}
    return next((f for f in found if f), {})


def fabric_fit(rank: int, world_size: int, steps: int, save_to: str | None, resume_from: str | None) -> dict:
    """A Fabric loop over epochs of a ``GlobalBatchLoader``, saved in ``fabric.save``'s state with the model."""
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=FabricShardStrategy(auto_wrap_policy={MLPBlock}))
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(MLPStack())
    optimizer = fabric.setup_optimizers(optimizer_for(model))
    loader = GlobalBatchLoader(indexed_mlp_data(), GLOBAL_BATCH, seed=SEED)
    state = {"model": model, "optimizer": optimizer, "data": loader, "step": 0}
    wrapper_refusal = ""
    if resume_from is not None:
        fabric.load(resume_from, state)
        probe = GlobalBatchLoader(indexed_mlp_data(), GLOBAL_BATCH, seed=SEED)
        probe.load_state_dict(loader.state_dict())
        wrapped = fabric.setup_dataloaders(probe)  # keeps the sampler, and sets the epoch to 0 on its first pass
        assert wrapped.sampler is probe.sampler
        try:
            next(iter(wrapped))
        except ValueError as refused:
            wrapper_refusal = str(refused)
    seen: dict[int, tuple[list[int], float]] = {}
    for epoch in range(loader.epoch, 1000):
        loader.set_epoch(epoch)  # after fabric.load: the restored epoch, whose position stays
        for x, y, index in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen[state["step"]] = (index.tolist(), loss.item())
            state["step"] += 1
            if state["step"] == steps:
                break
        if state["step"] == steps:
            break
    if save_to is not None:
        fabric.save(save_to, state)
    return {"seen": seen, "refusal": wrapper_refusal}


def test_a_fabric_loop_saved_mid_epoch_on_2_ranks_resumes_on_3_with_the_remaining_batches(tmp_path: Path) -> None:
    uninterrupted = merged(run_on_ranks(fabric_fit, 2, MAX_STEPS, None, None))
    ckpt = str(tmp_path / "mid-epoch")
    first = run_on_ranks(fabric_fit, 2, PREEMPTED_AT, ckpt, None)
    resumed = run_on_ranks(fabric_fit, 3, MAX_STEPS, None, ckpt)
    assert_resumed_run_is_the_uninterrupted_one(uninterrupted, merged(first), merged(resumed))
    for r in resumed:
        assert "Under Fabric, iterate the GlobalBatchLoader itself" in r["refusal"], r["refusal"]
