"""Worker functions for the torch.compile tests: the GPT test model with its blocks compiled in place (Trainer) or
replaced by ``torch.compile(block)`` (Fabric), and the same runs eager, counting the graphs dynamo compiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_shard import ShardStrategy
from tests.fabric_fits import FabricRun, loss_of, make_fabric, optimizer_for
from tests.fits import full_params_shard, trainer_for
from tests.models import GPTBlock, LitModel, TinyGPT, loader, make_dataset


@dataclass(frozen=True)
class CompileRun:
    """What is compiled, how, and for how long."""

    compiled: str = "blocks"  # "none" (eager), "blocks" (each GPTBlock), "stack" (TinyGPT), "root" (LightningModule)
    backend: str = "aot_eager"  # dynamo's graphs through AOTAutograd, run eagerly; "inductor" generates kernels
    precision: str = "32-true"
    steps: int = 4
    first_step: int = 0  # a resumed Fabric run starts at this step of the data
    checkpointing: bool = False  # activation checkpointing of every block (Trainer runs)


def _counter(backend: str) -> Any:
    """A dynamo backend that counts the graphs it compiles, then compiles them with ``backend``. Dynamo's caches
    are per process and the rank workers outlive a test, so they are reset first."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    return CompileCounterWithBackend(backend)


class CompiledGPT(LitModel):
    """The Trainer tests' GPT, compiled in ``configure_model`` as ``run.compiled`` says (``nn.Module.compile``)."""

    def __init__(self, run: CompileRun, counter: Any) -> None:
        super().__init__("gpt")
        self.run, self.counter = run, counter

    def configure_model(self) -> None:
        if self.run.compiled == "blocks":
            for block in self.model.blocks:
                block.compile(backend=self.counter)
        elif self.run.compiled == "stack":
            self.model.compile(backend=self.counter)
        elif self.run.compiled == "root":
            self.compile(backend=self.counter)


class GraphsPerStep(L.Callback):
    """The number of graphs compiled so far, after each training step."""

    def __init__(self, counter: Any) -> None:
        self.counter, self.graphs = counter, []

    def on_train_batch_end(self, *args: Any) -> None:
        self.graphs.append(int(self.counter.frame_count))


def trainer_compiled_fit(rank: int, world_size: int, run: CompileRun) -> dict[str, Any]:
    """Train the GPT under the Trainer; its losses, graphs compiled after each step and final full parameters."""
    counter = _counter(run.backend)
    L.seed_everything(0)
    module = CompiledGPT(run, counter)
    checkpointed = {GPTBlock} if run.checkpointing else None
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, activation_checkpointing_policy=checkpointed)
    graphs = GraphsPerStep(counter)
    trainer = trainer_for(strategy, world_size, run.steps, precision=run.precision, callbacks=[graphs])
    try:
        trainer.fit(module, train_dataloaders=loader("gpt"))
    except ValueError as error:
        return {"error": str(error)}
    return {"losses": module.losses, "graphs": graphs.graphs, "params": full_params_shard(strategy)}


def fabric_compiled_fit(
    rank: int, world_size: int, run: CompileRun, save_to: str | None = None, load_from: str | None = None
) -> dict[str, Any]:
    """Train the GPT in Fabric, built under ``fabric.init_module()`` with each block replaced by
    ``torch.compile(block)`` (unless ``run.compiled == "none"``); optionally load a checkpoint first and save one
    at the end. Returns the losses, graphs compiled after each step and the model's parameter names."""
    counter = _counter(run.backend)
    fabric = make_fabric(FabricRun(precision=run.precision), world_size)
    fabric.seed_everything(0)
    with fabric.init_module():
        model: nn.Module = TinyGPT()
        if run.compiled == "blocks":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, backend=counter)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(optimizer_for(model))
    if load_from is not None:
        fabric.load(load_from, {"model": model, "optimizer": optimizer})  # strict: every name must match
    data = make_dataset("gpt", n=8 * (run.first_step + run.steps))
    losses, graphs = [], []
    for step in range(run.first_step, run.first_step + run.steps):
        x, y = data[step * 8 + rank * 4 : step * 8 + rank * 4 + 4]
        loss = loss_of("gpt", model, x, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
        graphs.append(int(counter.frame_count))
    if save_to is not None:
        fabric.save(save_to, {"model": model, "optimizer": optimizer})
    return {"losses": losses, "graphs": graphs, "names": [n for n, _ in model.named_parameters()]}


def shard_model_of_compiled_model(rank: int, world_size: int) -> str:
    """``shard_model(torch.compile(model))``: the error message."""
    from lightning_shard.engine import shard_model

    try:
        shard_model(torch.compile(TinyGPT(), backend=_counter("aot_eager")), auto_wrap_policy={GPTBlock})
    except ValueError as error:
        return str(error)
    return "no error"
