"""``ShardStrategy(pipeline_parallel_size=P)`` under the Trainer and Fabric, on pooled gloo ranks: the losses
``training_step`` returns and the trained weights equal DDP's on the same global batch (P=2 on 2 ranks, 2 stages x
2 data-parallel ranks on 4, for every schedule), checkpoints resume across pipeline sizes, and what cannot be split
is refused. In fresh processes under Lightning's launcher: tests/test_pipeline_parallel_launch.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from lightning_shard import ShardStrategy
from lightning_shard.checkpoint.load.inspect import inspect
from lightning_shard.engine import summon_full_params
from lightning_shard.engine.parallel.apply import repeated_blocks
from lightning_shard.engine.parallel.pipeline import PipelineError, StageSplit, prune_to_stage, split_microbatches
from lightning_shard.engine.policies import ModuleClassWrapPolicy
from lightning_shard.engine.sharded_module import sharded_module_of
from lightning_shard.testing import RankFailure, run_on_ranks
from tests.context_parallel_models import (
    DIM,
    Block,
    CausalLM,
    LitCausalLM,
    lm_loss,
    token_batches,
    token_loader,
)
from tests.fits import full_params, trainer_for
from tests.test_parity import assert_same_training

STEPS = 10


def _whole_parts(module: L.LightningModule) -> dict[str, Tensor]:
    """This stage's parameters in full, tensor-parallel parts joined, under every name (as ``full_params``)."""
    from torch.distributed.tensor import DTensor

    with summon_full_params(module):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in module.named_parameters(remove_duplicate=False)}  # fmt: skip


def fit(rank: int, world_size: int, engine: str, steps: int = STEPS, save: str | None = None,
        resume: str | None = None, samples: int = 48, trainer_kwargs: dict | None = None, tied: bool = False,
        module_class: type[LitCausalLM] = LitCausalLM, keep_module: bool = False,
        **strategy_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """Train the causal LM (``tied``: its embedding is its head's weight) on 4 sequences per data-parallel rank;
    return this rank's losses, and the whole model's weights (every stage's, gathered)."""
    L.seed_everything(0)
    module = module_class(tied=tied)
    module.tensor_parallel = strategy_kwargs.get("tensor_parallel_size", 1) > 1
    strategy = DDPStrategy() if engine == "ddp" else ShardStrategy(**({"auto_wrap_policy": {Block}} | strategy_kwargs))
    trainer = trainer_for(strategy, world_size, steps, **(trainer_kwargs or {}))
    validates = type(module).validation_step is not L.LightningModule.validation_step
    validation = token_loader(batch=4, samples=8) if validates else None
    trainer.fit(module, train_dataloaders=token_loader(batch=4, samples=samples), val_dataloaders=validation,
                ckpt_path=resume)  # fmt: skip
    if save is not None:
        trainer.save_checkpoint(save)
    kept = {"module": module, "trainer": trainer} if keep_module else {}
    if engine == "ddp":
        named = module.named_parameters(remove_duplicate=False)  # a tied weight under each name, as full_params
        return {"losses": module.losses, "params": {n: p.detach().clone() for n, p in named}, **kept}
    stage = _whole_parts(module) if module.tensor_parallel else full_params(strategy.engine)
    everything: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(everything, stage)
    params = {name: value for part in everything for name, value in part.items()}
    return {"losses": module.losses, "params": params, "stage": stage, "mesh": strategy.device_mesh.mesh_dim_names,
            **kept}


@pytest.mark.parametrize("schedule", ["gpipe", "1F1B"])
@pytest.mark.parametrize("world_size", [2, 4], ids=["pipeline2", "pipeline2-data2"])
def test_trainer_trains_as_ddp_on_the_global_batch(world_size: int, schedule: str) -> None:
    """Every rank's ``training_step`` returns its data-parallel rank's loss, DDP's on the same batch, and the
    weights are DDP's after the steps."""
    data = world_size // 2
    ours = run_on_ranks(fit, world_size, "shard", pipeline_parallel_size=2, pipeline_schedule=schedule,
                        microbatches=2)  # fmt: skip
    reference = run_on_ranks(fit, data, "ddp")
    assert ours[0]["mesh"] == ("pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel")
    assert_same_training(ours, [reference[rank % data] for rank in range(world_size)])


class LitCausalLMAdamW(LitCausalLM):
    """Two parameter groups (no decay for norms and biases) and state with a scalar (AdamW's ``step``)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        named = list(self.named_parameters())
        plain = [p for n, p in named if "norm" in n or n.endswith(".bias")]
        decayed = [p for n, p in named if not ("norm" in n or n.endswith(".bias"))]
        return torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                                 lr=3e-3, eps=1e-3)  # eps: rounding-level gradients take rounding-level steps


class GainBlock(Block):
    """A block with buffers: a persistent gain it scales its output by, and a non-persistent step count."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.register_buffer("gain", torch.linspace(0.5, 1.5, DIM) / (depth + 1))  # each block its own
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return super().forward(x) * self.gain


class LitCausalLMBuffers(LitCausalLM):
    def configure_model(self) -> None:
        super().configure_model()
        self.model.blocks = torch.nn.Sequential(*(GainBlock(depth) for depth in range(len(self.model.blocks))))
        if self.global_rank % 2:  # a data-parallel rank but the first: its buffers must become the first's
            for block in self.model.blocks:
                block.gain.add_(1.0)


def test_blocks_with_buffers_train_and_resume_as_ddp(tmp_path: Path) -> None:
    """Each stage holds its blocks' buffers (each block's differ), agreed with its first data-parallel rank's (the
    second rank of each starts from other values, as under DDP); a save at P=2 x D=2 holds every stage's persistent
    buffers, and resumes at P=1 with DDP's losses and weights."""
    path = str(tmp_path / "ckpt")
    common = {"samples": 8, "module_class": LitCausalLMBuffers, "auto_wrap_policy": {GainBlock}}
    run_on_ranks(fit, 4, "shard", steps=5, save=path, pipeline_parallel_size=2, microbatches=2, **common)
    assert {"model/model.blocks.0.gain", "model/model.blocks.1.gain"} <= set(inspect(path).tensors)
    ours = run_on_ranks(fit, 2, "shard", resume=path, **common)
    whole = run_on_ranks(fit, 2, "ddp", **common)
    for rank, result in enumerate(ours):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(whole[rank]["losses"][5:]))
        for name, value in whole[rank]["params"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")


class LitCausalLMLoops(LitCausalLM):
    """Validation and prediction steps, and SGD with a step LR schedule, recording what each computes."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__(tied=tied)
        self.val_losses: list[float] = []
        self.lrs: list[float] = []

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        x, y, position_ids = batch
        loss = lm_loss(self.model, x, y, position_ids)
        self.log("val_loss", loss)
        self.val_losses.append(loss.item())

    def predict_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _, position_ids = batch
        return self.model(x, position_ids).argmax(-1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loops(rank: int, world_size: int, engine: str, **strategy_kwargs: Any) -> dict[str, Any]:
    """Fit with gradient accumulation over 2 batches, an LR schedule stepped each step and validation every 4
    batches (after the sanity check's 2), then predict; what each loop computed on this rank."""
    kwargs = {"accumulate_grad_batches": 2, "val_check_interval": 4, "limit_val_batches": 2}
    result = fit(rank, world_size, engine, steps=6, module_class=LitCausalLMLoops, trainer_kwargs=kwargs,
                 keep_module=True, **strategy_kwargs)  # fmt: skip
    module, trainer = result.pop("module"), result.pop("trainer")
    predictions = trainer.predict(module, token_loader(batch=4, samples=8))
    return {**result, "val_losses": module.val_losses, "lrs": module.lrs, "predictions": torch.cat(predictions)}


def test_accumulation_schedules_validation_and_prediction_run_as_under_ddp() -> None:
    """``accumulate_grad_batches``, an LR scheduler, the validation loop and ``trainer.predict`` under two stages:
    each loop's values (the validation loss of the whole model, the learning rates, the predicted tokens) and the
    trained weights are DDP's."""
    ours = run_on_ranks(loops, 2, "shard", pipeline_parallel_size=2, microbatches=2)
    reference = run_on_ranks(loops, 1, "ddp")[0]
    assert reference["lrs"] == [0.5] * 4 + [0.25] * 4 + [0.125] * 4 and len(reference["val_losses"]) == 2 + 3 * 2
    for rank, result in enumerate(ours):
        assert result["lrs"] == reference["lrs"]
        for what in ("losses", "val_losses"):
            torch.testing.assert_close(torch.tensor(result[what]), torch.tensor(reference[what]),
                                       msg=f"{what}, rank {rank}")  # fmt: skip
        assert torch.equal(result["predictions"], reference["predictions"])
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")


RESUMES = [(1, 1, 2, 2, 1), (2, 2, 1, 1, 1), (4, 2, 2, 1, 1), (4, 2, 2, 1, 2)]


@pytest.mark.parametrize(("saved_on", "saved_stages", "resumed_on", "resumed_stages", "tensor"), RESUMES,
                         ids=["P1->P2", "P2->P1", "P2D2->P1D2", "P2T2->T2"])  # fmt: skip
def test_a_checkpoint_resumes_at_another_pipeline_size(
    tmp_path: Path, saved_on: int, saved_stages: int, resumed_on: int, resumed_stages: int, tensor: int
) -> None:
    """A save after 5 steps resumes at another pipeline size (each stage reading its own parameters' rows and
    optimizer state; the tied embedding written once) and continues with the losses and weights of the uninterrupted
    DDP run on the same data-parallel ranks (one batch per epoch, so that the resumed fit sees what the uninterrupted
    one saw)."""
    path, data = str(tmp_path / "ckpt"), saved_on // (saved_stages * tensor)
    common = {"samples": 4 * data, "tied": True, "module_class": LitCausalLMAdamW, "tensor_parallel_size": tensor}
    run_on_ranks(fit, saved_on, "shard", steps=5, save=path, pipeline_parallel_size=saved_stages, **common)
    summary = inspect(path)  # every stage's files verified, and the split recorded
    assert not summary.problems and (summary.pipeline or {}).get("bounds") == ([0, 1, 2] if saved_stages > 1 else None)
    assert "model/model.blocks.1.up.weight" in summary.tensors and "model/model.wte.weight" in summary.tensors
    ours = run_on_ranks(fit, resumed_on, "shard", resume=path, pipeline_parallel_size=resumed_stages, **common)
    whole = run_on_ranks(fit, data, "ddp", **(common | {"tensor_parallel_size": 1}))
    for rank, result in enumerate(ours):
        reference = whole[rank % data]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"][5:]),
                                   msg=f"rank {rank}")  # fmt: skip
        assert result["params"].keys() == reference["params"].keys()
        for name, value in reference["params"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")


def fabric_steps(rank: int, world_size: int, schedule: str) -> dict[str, Any]:
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    strategy = FabricShardStrategy(auto_wrap_policy={Block}, pipeline_parallel_size=2, pipeline_schedule=schedule,
                                   microbatches=2)  # fmt: skip
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    reference, model = CausalLM(), CausalLM()
    model.load_state_dict(reference.state_dict())
    module = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    losses, ref_losses = [], []
    for x, y, pos in token_batches(3, 4):
        loss = lm_loss(module, x, y, pos)
        fabric.backward(loss)
        fabric.clip_gradients(module, optimizer, max_norm=0.5)
        ref_loss = lm_loss(reference, x, y, pos)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    engine = sharded_module_of(model)
    assert engine is not None
    everything: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(everything, full_params(engine))
    return {"losses": losses, "ref_losses": ref_losses,
            "params": {name: value for part in everything for name, value in part.items()},
            "reference": {n: p.detach() for n, p in reference.named_parameters()}}  # fmt: skip


def fabric_save_then_load(rank: int, world_size: int, path: str, stages: int) -> dict[str, Any]:
    """With ``stages`` = 2: 3 steps of the tied model under Fabric, then ``fabric.save``; with 1: ``fabric.load`` of
    that save. This rank's weights in full, and the loss of one more step."""
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    extra = {"pipeline_parallel_size": 2, "microbatches": 2} if stages > 1 else {}
    fabric = L.Fabric(accelerator="cpu", devices=world_size,
                      strategy=FabricShardStrategy(auto_wrap_policy={Block}, **extra))  # fmt: skip
    fabric.launch()
    torch.manual_seed(0)
    model = CausalLM(tied=True)
    module = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=3e-3, eps=1e-3))
    batches = token_batches(4, 4)
    if stages > 1:
        for x, y, pos in batches[:3]:
            fabric.backward(lm_loss(module, x, y, pos))
            optimizer.step()
            optimizer.zero_grad()
        fabric.save(path, {"model": module, "optimizer": optimizer, "step": 3})
    else:
        assert fabric.load(path, {"model": module, "optimizer": optimizer}) == {"step": 3}
    x, y, pos = batches[3]
    loss = lm_loss(module, x, y, pos)
    fabric.backward(loss)
    optimizer.step()
    engine = sharded_module_of(model)
    assert engine is not None
    everything: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(everything, full_params(engine))
    return {"loss": loss.item(), "params": {name: value for part in everything for name, value in part.items()}}


def test_fabric_saves_two_stages_and_loads_them_without_pipeline_parallelism(tmp_path: Path) -> None:
    """``fabric.save`` under two stages (AdamW state, the tied weight) and ``fabric.load`` into the unsplit model on
    the same 2 ranks: the next step's loss and weights are the pipelined run's."""
    path = str(tmp_path / "fabric-ckpt")
    pipelined = run_on_ranks(fabric_save_then_load, 2, path, 2)
    loaded = run_on_ranks(fabric_save_then_load, 2, path, 1)
    for rank in range(2):
        torch.testing.assert_close(loaded[rank]["loss"], pipelined[rank]["loss"], msg=f"rank {rank}")
        for name, value in pipelined[rank]["params"].items():
            torch.testing.assert_close(loaded[rank]["params"][name], value, msg=f"{name}, rank {rank}")


@pytest.mark.parametrize("schedule", ["gpipe", "1F1B"])
def test_fabric_trains_as_the_whole_model_with_clipping_across_stages(schedule: str) -> None:
    """The loss computed from the set-up module's output is the whole model's on every rank, and clipping by the
    global norm (over both stages' parameters) leaves the weights of the unsplit model clipped alike."""
    for rank, result in enumerate(run_on_ranks(fabric_steps, 2, schedule)):
        torch.testing.assert_close(result["losses"], result["ref_losses"], msg=f"losses, rank {rank}")
        assert result["params"].keys() == result["reference"].keys()
        for name, value in result["reference"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")


# Refusals: before any process group or collective, the same on every rank #


def test_more_stages_than_blocks_are_refused_naming_the_blocks() -> None:
    with pytest.raises(PipelineError, match=r"needs at least 3 blocks, one per stage, but CausalLM has 2"):
        StageSplit.of(CausalLM(), ModuleClassWrapPolicy(frozenset({Block})), 3)


def test_a_model_without_blocks_by_the_rule_is_refused_naming_it() -> None:
    with pytest.raises(PipelineError, match=r"no module of CausalLM is a block by auto_wrap_policy"):
        StageSplit.of(CausalLM(), ModuleClassWrapPolicy(frozenset({"GPT2Block"})), 2)


def test_microbatches_that_do_not_divide_the_batch_are_refused() -> None:
    x = torch.zeros(6, 4)
    with pytest.raises(PipelineError, match=r"microbatches=4 does not divide the batch size 6"):
        list(split_microbatches((x,), {}, 4))
    assert [a[0].shape[0] for a, _ in split_microbatches((x,), {}, 3)] == [2, 2, 2]


def test_two_stages_of_two_context_parallel_ranks_train_as_ddp() -> None:
    """P=2 x C=2 on 4 ranks, both schedules: each stage's ranks split the sequences, the pipeline carries each rank's
    part, and 1F1B's repeated forwards attend over the whole sequence as the first did."""
    reference = run_on_ranks(fit, 1, "ddp")
    for schedule in ("gpipe", "1F1B"):
        ours = run_on_ranks(fit, 4, "shard", pipeline_parallel_size=2, context_parallel_size=2, microbatches=2,
                            pipeline_schedule=schedule)  # fmt: skip
        assert_same_training(ours, reference * 4)


def test_two_stages_of_two_tensor_parallel_ranks_train_as_ddp() -> None:
    """P=2 x T=2 on 4 ranks, each stage's blocks split by the tensor-parallel plan, clipped by the norm over both
    stages and both tensor-parallel parts: DDP's losses and weights on one rank."""
    clip = {"gradient_clip_val": 0.5}
    ours = run_on_ranks(fit, 4, "shard", trainer_kwargs=clip, pipeline_parallel_size=2, tensor_parallel_size=2,
                        microbatches=2)  # fmt: skip
    reference = run_on_ranks(fit, 1, "ddp", trainer_kwargs=clip)
    assert_same_training(ours, reference * 4)


@pytest.mark.parametrize("world_size", [2, 4], ids=["pipeline2", "pipeline2-data2"])
def test_an_embedding_tied_to_the_head_trains_as_ddp_with_clipping(world_size: int) -> None:
    """The embedding on the first stage and the head on the last share one weight: both stages keep it, sum its
    gradient, count it once in the clipped norm, and take DDP's steps."""
    data = world_size // 2
    clip = {"gradient_clip_val": 0.5}
    blocks = None if world_size == 2 else {Block}  # on 2 ranks, the blocks the model repeats
    ours = run_on_ranks(fit, world_size, "shard", tied=True, trainer_kwargs=clip, pipeline_parallel_size=2,
                        microbatches=2, auto_wrap_policy=blocks)  # fmt: skip
    reference = run_on_ranks(fit, data, "ddp", tied=True, trainer_kwargs=clip)
    assert_same_training(ours, [reference[rank % data] for rank in range(world_size)])
    for rank, result in enumerate(ours):  # each stage's own copy, not only the one the gathered dict kept
        name = "model.wte.weight" if rank < data else "model.head.weight"
        torch.testing.assert_close(result["stage"][name], reference[0]["params"][name], msg=f"rank {rank}")


def test_without_auto_wrap_policy_the_blocks_are_the_longest_list_of_repeated_modules() -> None:
    assert repeated_blocks(CausalLM(layers=3)) == ModuleClassWrapPolicy(frozenset({Block}))
    mixed = torch.nn.Sequential(torch.nn.ModuleList([Block(), torch.nn.Linear(2, 2)]), torch.nn.Linear(2, 2))
    with pytest.raises(PipelineError, match=r"has no nn.ModuleList or nn.Sequential of repeated blocks"):
        repeated_blocks(mixed)


class LitCausalLMThreeBlocks(LitCausalLM):
    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = CausalLM(layers=3, tied=True)


def test_a_weight_tied_between_the_first_and_last_of_three_stages_trains_as_ddp() -> None:
    """P=3 on 3 ranks: the embedding on stage 0 and the head on stage 2 share their weight, which stage 1 does not
    hold; the two holders sum its gradient over a group of their own."""
    clip = {"gradient_clip_val": 0.5}
    ours = run_on_ranks(fit, 3, "shard", module_class=LitCausalLMThreeBlocks, trainer_kwargs=clip,
                        pipeline_parallel_size=3, microbatches=2)  # fmt: skip
    reference = run_on_ranks(fit, 1, "ddp", module_class=LitCausalLMThreeBlocks, trainer_kwargs=clip)
    assert_same_training(ours, reference * 3)
    assert "model.wte.weight" not in ours[1]["stage"]


class LitCausalLMWithTemperature(LitCausalLM):
    def configure_model(self) -> None:
        super().configure_model()
        self.temperature = torch.nn.Parameter(torch.ones(()))


def test_parameters_outside_the_pipelined_module_are_refused_on_every_rank() -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(fit, 2, "shard", module_class=LitCausalLMWithTemperature, pipeline_parallel_size=2)
    assert failure.value.failed_ranks == [0, 1] and str(failure.value).count("holds temperature outside model") >= 2


def test_a_full_layout_save_under_pipeline_parallelism_is_refused_on_every_rank(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(fit, 2, "shard", steps=1, save=str(tmp_path / "ckpt"), pipeline_parallel_size=2,
                     state_dict_type="full")  # fmt: skip
    assert failure.value.failed_ranks == [0, 1]
    assert str(failure.value).count("state_dict_type='full' under pipeline_parallel_size=2") >= 2
    assert not (tmp_path / "ckpt").exists()


def test_each_stage_keeps_the_weights_it_shares_under_every_name() -> None:
    for stage in (0, 1):
        model = CausalLM(tied=True)
        split = StageSplit.of(model, ModuleClassWrapPolicy(frozenset({Block})), 2)
        kept = prune_to_stage(model, split, stage)
        assert [(t.names, t.stages) for t in kept.ties] == [(("wte.weight", "head.weight"), (0, 1))]
        assert model.wte.weight is model.head.weight
        assert "wte.weight" in model.state_dict() and "head.weight" in model.state_dict()
        assert ("head.bias" in model.state_dict()) == (stage == 1)


def test_a_stage_keeps_only_its_blocks_and_ends() -> None:
    model = CausalLM(layers=4)
    split = StageSplit.of(model, ModuleClassWrapPolicy(frozenset({Block})), 2, split_points=["blocks.3"])
    assert split.stage_blocks(0) == ("blocks.0", "blocks.1", "blocks.2")
    prune_to_stage(model, split, 1)
    assert {name.split(".")[0] for name, _ in model.named_parameters()} == {"blocks", "norm", "head"}
    assert {name.split(".")[1] for name, _ in model.named_parameters() if name.startswith("blocks")} == {"3"}


def test_bad_pipeline_arguments_are_refused_when_the_strategy_is_built() -> None:
    with pytest.raises(ValueError, match=r"pipeline_schedule must be one of 'gpipe', '1F1B'"):
        ShardStrategy(auto_wrap_policy={Block}, pipeline_parallel_size=2, pipeline_schedule="zigzag")
    with pytest.raises(ValueError, match=r"'Interleaved1F1B' runs several stages on each rank"):
        ShardStrategy(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B")
    with pytest.raises(ValueError, match=r"splits the model into stages of whole blocks"):
        ShardStrategy(pipeline_parallel_size=2, auto_wrap_policy=True)
    with pytest.raises(ValueError, match=r"with sharding_strategy='HYBRID_SHARD' is not supported yet"):
        ShardStrategy(auto_wrap_policy={Block}, pipeline_parallel_size=2, sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match=r"microbatches must be a positive int"):
        ShardStrategy(auto_wrap_policy={Block}, pipeline_parallel_size=2, microbatches=0)
