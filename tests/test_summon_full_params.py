"""``summon_full_params``: the full weights inside the block are DDP's, a forward inside gives DDP's logits, writeback
persists edits into the shards (and its absence discards them), ``rank0_only`` gathers on rank 0 alone, the refusals
in the middle of a step, and the same under the Trainer and under Fabric (fp32 master weights under bf16-mixed)."""

from __future__ import annotations

import copy
import gc
import time
import weakref
from contextlib import nullcontext
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

from lightning_shard import MixedPrecision, ShardStrategy, summon_full_params
from lightning_shard.engine import ShardedModule, shard_model, sharded_module_of
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.fits import full_params, trainer_for
from tests.models import GPTBlock, LitModel, MLPBlock, MLPStack, TinyGPT, loader

VOCAB = 37


class GainGPT(TinyGPT):
    """``TinyGPT`` (a tied embedding and LM head, frozen weights, two block units besides the root) with a one-row
    output gain: a parameter with fewer rows than ranks, so rank 1 holds none of it."""

    def __init__(self, depth: int = 2) -> None:
        super().__init__(depth=depth)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, VOCAB).unsqueeze(0))  # (1, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        return super().forward(idx) * self.gain


def _tokens(seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: Tensor) -> None:
    optimizer.zero_grad()
    _loss(model, tokens).backward()
    optimizer.step()


class Pair:
    """The same ``GainGPT`` trained under DDP and sharded by ``shard_model``, each rank on its own batches."""

    def __init__(self, rank: int, strategy: str = "FULL_SHARD", steps: int = 3, depth: int = 2) -> None:
        torch.manual_seed(0)
        self.rank = rank
        self.reference = GainGPT(depth)
        self.model = copy.deepcopy(self.reference)
        self.ddp = nn.parallel.DistributedDataParallel(self.reference)
        self.ddp_optimizer = torch.optim.AdamW(self.reference.parameters(), lr=1e-2)
        self.engine: ShardedModule = shard_model(
            self.model, auto_wrap_policy={GPTBlock}, sharding_strategy=strategy, device="cpu"
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.batches = 0
        self.train(steps)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            tokens = _tokens(100 * self.rank + self.batches)
            self.batches += 1
            _step(self.ddp, self.ddp_optimizer, tokens)
            _step(self.model, self.optimizer, tokens)

    def assert_same_weights(self) -> None:
        """The shards, gathered without ``summon_full_params``, equal DDP's weights."""
        full = full_params(self.engine)
        for name, p in self.reference.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), msg=name)


# Full weights, names and logits #


def full_weights_inside(rank: int, world_size: int, strategy: str, offload_to_cpu: bool) -> None:
    pair = Pair(rank, strategy)
    model, reference = pair.model, pair.reference
    shard_shapes = {n: p.shape for n, p in model.named_parameters()}
    with summon_full_params(model, offload_to_cpu=offload_to_cpu):
        params = dict(model.named_parameters())
        assert params.keys() == dict(reference.named_parameters()).keys()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), msg=name)
            assert params[name].dtype == torch.float32 and params[name].device.type == "cpu"
            assert params[name].requires_grad == p.requires_grad, name
            assert params[name].grad is None, f"{name} shows no gradient inside the block"
        assert model.lm_head.weight is model.wte.weight, "the tied weight stays one tensor"
        state = model.state_dict()
        assert state.keys() == reference.state_dict().keys()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, msg=name)
    assert {n: p.shape for n, p in model.named_parameters()} == shard_shapes
    with torch.inference_mode(), summon_full_params(model):  # as Lightning's evaluation loops run on NCCL
        kept = model.state_dict()
    assert not any(t.is_inference() for t in kept.values()), "kept tensors work outside inference mode too"


@pytest.mark.parametrize(
    "strategy, offload_to_cpu", [("FULL_SHARD", False), ("NO_SHARD", False), ("FULL_SHARD", True)]
)
def test_inside_the_block_the_model_holds_ddps_full_weights_under_their_names(
    strategy: str, offload_to_cpu: bool
) -> None:
    run_on_ranks(full_weights_inside, 2, strategy, offload_to_cpu)


def logits_inside(rank: int, world_size: int) -> None:
    pair = Pair(rank)
    x = _tokens(7 + rank)[:, :-1]
    with torch.no_grad():
        expected = pair.reference(x)
        with summon_full_params(pair.model):
            if rank == 0:  # no collectives inside: one rank may run the model alone
                torch.testing.assert_close(pair.model(x), expected)
                wte, block = pair.model.wte, pair.model.blocks[1]  # parts of the model, called on their own
                torch.testing.assert_close(block(wte(x)), pair.reference.blocks[1](pair.reference.wte(x)))
        torch.testing.assert_close(pair.model(x), expected)  # sharded again: a collective forward on every rank


def test_a_forward_inside_the_block_gives_ddps_logits_and_communicates_nothing() -> None:
    run_on_ranks(logits_inside, 2, timeout=120)


def nothing_kept(rank: int, world_size: int) -> None:
    pair = Pair(rank)
    with summon_full_params(pair.model):
        held = [weakref.ref(p) for p in pair.model.parameters()]
    gc.collect()
    assert all(ref() is None for ref in held), "the full tensors are freed when the block ends"
    pair.train(2)  # and training goes on as if the block had not been there
    pair.assert_same_weights()


def test_on_exit_the_model_is_sharded_again_keeps_no_full_weights_and_trains_on() -> None:
    run_on_ranks(nothing_kept, 2)


# writeback #


def _edit(model: nn.Module, how: str) -> None:
    """The same change on every rank, made the way ``how`` says."""
    with torch.no_grad():
        match how:
            case "in_place":
                model.lm_head.weight.mul_(0.5)  # the tied weight, through its second name
                model.gain.add_(1.0)  # the parameter rank 1 holds no rows of
            case "load_state_dict":
                state = model.state_dict()
                state["blocks.1.fc.weight"] = state["blocks.1.fc.weight"] * -1.0
                state["ln_f.bias"] = torch.full_like(state["ln_f.bias"], 0.25)
                model.load_state_dict(state)
    if how == "optimizer_step":  # on the same batch on every rank, so every rank takes the same step
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        _step(model, optimizer, _tokens(999))


def writeback_edit(rank: int, world_size: int, how: str) -> None:
    pair = Pair(rank)
    _edit(pair.reference, how)
    with summon_full_params(pair.model, writeback=True):
        _edit(pair.model, how)
    pair.assert_same_weights()
    pair.ddp_optimizer.zero_grad()  # the optimizer step above left local gradients on the reference
    pair.train(2)
    pair.assert_same_weights()


@pytest.mark.parametrize("how", ["in_place", "load_state_dict", "optimizer_step"])
def test_writeback_puts_an_edit_into_the_shards_and_training_continues_from_it(how: str) -> None:
    run_on_ranks(writeback_edit, 2, how)


def edit_discarded(rank: int, world_size: int) -> None:
    pair = Pair(rank)
    x = _tokens(7)[:, :-1]
    with torch.no_grad(), summon_full_params(pair.model):
        before = pair.model(x)
        _edit(pair.model, "in_place")
        edited = pair.model(x)
    assert not torch.allclose(before, edited), "the edit is visible inside the block"
    pair.assert_same_weights()  # and gone after it
    pair.train(2)
    pair.assert_same_weights()


def test_without_writeback_an_edit_is_visible_inside_the_block_and_discarded_on_exit() -> None:
    run_on_ranks(edit_discarded, 2)


def write_back_what_cannot_be(rank: int, world_size: int, how: str) -> str:
    pair = Pair(rank, steps=1)
    before = full_params(pair.engine)
    try:
        with summon_full_params(pair.model, writeback=True):
            with torch.no_grad():
                pair.model.blocks[0].fc.weight.mul_(2.0)  # a valid edit, not written either when another is refused
            if how == "untied":
                pair.model.lm_head.weight = nn.Parameter(pair.model.lm_head.weight.detach().clone())
            else:
                pair.model.gain = nn.Parameter(torch.ones(2, VOCAB))
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError("writeback of an untied or reshaped parameter was not refused")
    after = full_params(pair.engine)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, msg=name)
    assert pair.model.blocks[0].fc.weight.shape[0] < 64, "the shards are back on the modules"
    return message


@pytest.mark.parametrize(
    "how, says", [("untied", "are one tied parameter but hold different tensors"), ("reshaped", "holds shape (2, 37)")]
)
def test_writeback_refuses_what_has_no_rows_to_write_and_writes_nothing(how: str, says: str) -> None:
    for message in run_on_ranks(write_back_what_cannot_be, 2, how):
        assert says in message, message


# rank0_only #


class GatheredBytes:
    """The bytes of the full tensors ``engine.gather_full`` returned that are alive (their storage not freed), and the
    most there ever were at once."""

    def __init__(self, engine: ShardedModule) -> None:
        self.live = self.peak = self.largest = 0
        gather = engine.gather_full

        def tracked(*args: Any) -> Tensor:
            full = gather(*args)
            nbytes = full.untyped_storage().nbytes()
            self.live += nbytes
            self.peak, self.largest = max(self.peak, self.live), max(self.largest, nbytes)
            weakref.finalize(full.untyped_storage(), self._freed, nbytes)
            return full

        engine.gather_full = tracked  # type: ignore[method-assign]

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


def rank0_only(rank: int, world_size: int) -> dict[str, Any]:
    pair = Pair(rank)
    model, reference = pair.model, pair.reference
    shards = {n: p for n, p in model.named_parameters()}
    gathered = GatheredBytes(pair.engine)
    seen: dict[str, Any] = {}
    with summon_full_params(model, rank0_only=True):
        params = dict(model.named_parameters())
        if rank == 0:
            for name, p in reference.named_parameters():
                torch.testing.assert_close(params[name], p.detach(), msg=name)
            with torch.no_grad():
                torch.testing.assert_close(model(_tokens(5)[:, :-1]), reference(_tokens(5)[:, :-1]))
        else:
            assert all(params[n] is shards[n] for n in shards), "the other ranks keep their shards"
            try:
                model(_tokens(5)[:, :-1])
            except RuntimeError as error:
                seen["refused"] = str(error)
        seen["held_inside"] = gathered.live
    del params
    for _ in range(100):  # the backend's thread may hold the last all-gather's output a moment longer
        gc.collect()
        if gathered.live == 0:
            break
        time.sleep(0.05)
    seen |= {"held_after": gathered.live, "peak": gathered.peak, "largest": gathered.largest}
    seen["model_bytes"] = sum(p.numel() * p.element_size() for p in reference.parameters())
    pair.train(1)  # every rank may call the model again after the block
    pair.assert_same_weights()
    return seen


def test_rank0_only_gathers_on_rank_0_and_the_other_ranks_keep_their_shards() -> None:
    rank_0, rank_1 = run_on_ranks(rank0_only, 2, timeout=120)
    assert rank_0["held_inside"] == rank_0["peak"] >= rank_0["model_bytes"]  # the whole model, on rank 0
    # Rank 1 takes part in every all-gather but drops each full tensor at once: one parameter at a time (the backend
    # may let go of the previous all-gather's output a moment after it returned, hence two).
    assert rank_1["peak"] <= 2 * rank_1["largest"] < rank_1["model_bytes"] / 2, rank_1
    assert rank_0["held_after"] == rank_1["held_after"] == 0, "nothing gathered is kept after the block"
    assert "Rank 1 called the model inside summon_full_params(rank0_only=True)" in rank_1["refused"]


def test_rank0_only_with_writeback_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank0_only=True, writeback=True\) is not supported"):
        with summon_full_params(nn.Linear(2, 2), rank0_only=True, writeback=True):
            pass


# Refusals #


def refused_mid_step(rank: int, world_size: int, where: str) -> str:
    pair = Pair(rank, steps=1)
    messages: list[str] = []
    with torch.no_grad(), summon_full_params(pair.model):  # a forward inside a block leaves no trace on the engine
        pair.model(_tokens(3)[:, :-1])

    def try_to_summon(*_: Any) -> None:
        try:
            with summon_full_params(pair.model):
                pass
        except RuntimeError as error:
            messages.append(str(error))

    tokens = _tokens(100 * rank + pair.batches)
    pair.batches += 1
    _step(pair.ddp, pair.ddp_optimizer, tokens)
    pair.optimizer.zero_grad()
    if where == "forward":
        handle = pair.model.blocks[0].register_forward_hook(try_to_summon)
        loss = _loss(pair.model, tokens)
        handle.remove()
    else:
        loss = _loss(pair.model, tokens)
        try_to_summon()
    loss.backward()
    pair.optimizer.step()
    pair.assert_same_weights()  # the refusal disturbed nothing
    with summon_full_params(pair.model):  # and after the backward the model can be summoned
        pass
    assert len(messages) == 1, messages
    return messages[0]


@pytest.mark.parametrize(
    "where, says",
    [("forward", "was called inside a forward"), ("between", "between a forward with gradients and its backward")],
)
def test_refused_inside_a_forward_and_before_its_backward_on_every_rank(where: str, says: str) -> None:
    for message in run_on_ranks(refused_mid_step, 2, where, timeout=120):
        assert says in message, message


class Wrapper(nn.Module):
    """Holds the model as ``_forward_module``, as Fabric's ``_FabricModule`` does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._forward_module = module


def refused_uses(rank: int, world_size: int) -> dict[str, str]:
    pair = Pair(rank, steps=0)
    with summon_full_params(Wrapper(pair.model)):  # a wrapper is looked through
        assert pair.model.gain.shape == (1, VOCAB)
    messages = {}
    with summon_full_params(pair.model):
        try:
            with summon_full_params(pair.model):
                pass
        except RuntimeError as error:
            messages["nested"] = str(error)
        assert pair.model.gain.shape == (1, VOCAB), "the refused inner block left the open one alone"
    try:
        with summon_full_params(pair.model.blocks[0]):
            pass
    except TypeError as error:
        messages["submodule"] = str(error)
    unsharded = GainGPT()
    before = dict(unsharded.named_parameters())
    with summon_full_params(unsharded, writeback=True):  # nothing of it is sharded: FSDP's no-op
        same = all(p is before[n] for n, p in unsharded.named_parameters())
    same = same and all(p is before[n] for n, p in unsharded.named_parameters())
    messages["unsharded"] = "same" if same else "changed"
    try:
        with summon_full_params(pair.model, writeback="yes"):  # type: ignore[arg-type]
            pass
    except TypeError as error:
        messages["flag"] = str(error)
    return messages


def test_wrappers_are_looked_through_an_unsharded_model_is_left_alone_nested_blocks_parts_and_flags_refused() -> None:
    for messages in run_on_ranks(refused_uses, 2):
        assert "already open on this model" in messages["nested"]
        assert "needs the sharded model, not a GPTBlock" in messages["submodule"]
        assert messages["unsharded"] == "same"
        assert "writeback=...) must be True or False, got 'yes'" in messages["flag"]


# Mixed precision #


def mixed_precision_block(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = MLPStack()
    model = copy.deepcopy(reference)
    mixed = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    shard_model(model, auto_wrap_policy={MLPBlock}, mixed_precision=mixed, device="cpu")
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        assert model(x).dtype == torch.bfloat16  # sharded: gathered, cast and computed in bf16
        with summon_full_params(model):
            params = dict(model.named_parameters())
            for name, p in reference.named_parameters():
                assert params[name].dtype == torch.float32, f"{name}: the fp32 master weights"
                torch.testing.assert_close(params[name], p, msg=name)
            logits = model(x)  # a plain fp32 model: its inputs are not cast either
        torch.testing.assert_close(logits, reference(x))


def test_under_mixed_precision_the_block_holds_and_computes_with_the_fp32_master_weights() -> None:
    run_on_ranks(mixed_precision_block, 2)


# Lightning front ends #


class SummoningModel(LitModel):
    """Records its full weights (and logits) at the start of a validation in the middle of ``fit`` and at its end:
    through ``summon_full_params`` when sharded, as they are under DDP."""

    def __init__(self) -> None:
        super().__init__("gpt")
        self.seen: dict[str, Any] = {}

    def _full(self) -> Any:
        return summon_full_params(self) if sharded_module_of(self) is not None else nullcontext()

    def _record(self, tag: str) -> None:
        with self._full():
            self.seen[tag] = {n: p.detach().clone() for n, p in self.named_parameters()}
            with torch.no_grad():
                self.seen[tag + "_logits"] = self(_tokens(3)[:, :-1])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self(batch[0])

    def on_validation_epoch_start(self) -> None:  # under no_grad (on gloo; inference mode on NCCL)
        self._record("validation")

    def on_train_end(self) -> None:
        self._record("end")


def fit_and_summon(rank: int, world_size: int, ddp: bool) -> dict[str, Any]:
    L.seed_everything(0)
    module = SummoningModel()
    strategy = DDPStrategy() if ddp else ShardStrategy(auto_wrap_policy={GPTBlock})
    trainer = trainer_for(strategy, world_size, 4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=loader("gpt"), val_dataloaders=loader("gpt"))
    return {"losses": module.losses, **module.seen}


def test_under_the_trainer_hooks_see_ddps_full_weights_and_training_is_undisturbed() -> None:
    sharded = run_on_ranks(fit_and_summon, 2, False)
    ddp = run_on_ranks(fit_and_summon, 2, True)
    for mine, theirs in zip(sharded, ddp):
        torch.testing.assert_close(mine["losses"], theirs["losses"])
        for tag in ("validation", "end"):
            assert mine[tag].keys() == theirs[tag].keys()
            for name, value in theirs[tag].items():
                torch.testing.assert_close(mine[tag][name], value, msg=f"{tag}: {name}")
            torch.testing.assert_close(mine[tag + "_logits"], theirs[tag + "_logits"])


def fabric_summon(rank: int, world_size: int, precision: str) -> None:
    fabric = L.Fabric(
        accelerator="cpu", devices=world_size, precision=precision,  # type: ignore[arg-type]
        strategy=FabricShardStrategy(auto_wrap_policy={GPTBlock}),
    )
    fabric.launch()
    torch.manual_seed(0)
    net = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-2))
    for i in range(2):
        optimizer.zero_grad()
        fabric.backward(_loss(net, _tokens(100 * rank + i)))
        optimizer.step()
    engine = sharded_module_of(net.module)
    assert engine is not None
    masters = full_params(engine)
    x = _tokens(3)[:, :-1]
    with torch.no_grad():
        sharded_logits = net(x)
    with summon_full_params(net):  # the module fabric.setup_module returned
        state = net.state_dict()
        assert state.keys() == TinyGPT().state_dict().keys()
        for name, value in masters.items():
            assert state[name].dtype == torch.float32, f"{name}: the fp32 master weights, not the compute dtype"
            torch.testing.assert_close(state[name], value, msg=name)
        with torch.no_grad():
            logits = net(x)
    if precision == "32-true":
        torch.testing.assert_close(logits, sharded_logits)
    shards = {id(p.sharded) for p in engine.sharded_params()}
    assert all(id(p) in shards for p in net.module.parameters()), "sharded again after the block"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_under_fabric_the_set_up_module_summons_its_fp32_weights(precision: str) -> None:
    run_on_ranks(fabric_summon, 2, precision)
