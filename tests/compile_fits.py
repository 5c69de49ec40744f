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

    compiled: str = "blocks"  # "none" (eager), "blocks" (each GPTBlock), "stack" (TinyGPT), "root" (LightningModule),
    # "model" (the whole model, Fabric)
    backend: str = "aot_eager"  # dynamo's graphs through AOTAutograd, run eagerly; "inductor" generates kernels
    precision: str = "32-true"
    steps: int = 4
    first_step: int = 0  # a resumed Fabric run starts at this step of the data
    checkpointing: bool = False  # activation checkpointing of every block (Trainer runs)


def _fresh_dynamo() -> None:
    """Dynamo's caches and counters are per process and the rank workers outlive a test: start from none."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process since ``_fresh_dynamo()`` (a recompilation is one more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    """Graph breaks dynamo has made in this process since ``_fresh_dynamo()``."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


class CompiledGPT(LitModel):
    """The Trainer tests' GPT, compiled in ``configure_model`` as ``run.compiled`` says (``nn.Module.compile``)."""

    def __init__(self, run: CompileRun) -> None:
        super().__init__("gpt")
        self.run = run

    def configure_model(self) -> None:
        if self.run.compiled == "blocks":
            for block in self.model.blocks:
                block.compile(backend=self.run.backend)
        elif self.run.compiled == "stack":
            self.model.compile(backend=self.run.backend)
        elif self.run.compiled == "root":
            self.compile(backend=self.run.backend)


class GraphsPerStep(L.Callback):
    """The number of graphs compiled so far, after each training step."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.graphs.append(graphs_compiled())


def trainer_compiled_fit(rank: int, world_size: int, run: CompileRun) -> dict[str, Any]:
    """Train the GPT under the Trainer; its losses, graphs compiled after each step and final full parameters."""
    _fresh_dynamo()
    L.seed_everything(0)
    module = CompiledGPT(run)
    checkpointed = {GPTBlock} if run.checkpointing else None
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, activation_checkpointing_policy=checkpointed)
    graphs = GraphsPerStep()
    trainer = trainer_for(strategy, world_size, run.steps, precision=run.precision, callbacks=[graphs])
    try:
        trainer.fit(module, train_dataloaders=loader("gpt"))
    except ValueError as error:
        return {"error": str(error)}
    blocks = [m for m in module.modules() if isinstance(m, GPTBlock)]
    checkpointed = sum(getattr(m, "_lightning_shard_checkpointed", False) for m in blocks)
    return {
        "losses": module.losses, "graphs": graphs.graphs, "params": full_params_shard(strategy),
        "blocks": len(blocks), "checkpointed": checkpointed, "graph_breaks": graph_breaks(),
    }


def fabric_compiled_fit(
    rank: int, world_size: int, run: CompileRun, save_to: str | None = None, load_from: str | None = None
) -> dict[str, Any]:
    """Train the GPT in Fabric, built under ``fabric.init_module()`` with each block replaced by
    ``torch.compile(block)`` (unless ``run.compiled == "none"``); optionally load a checkpoint first and save one
    at the end; ``run.compiled == "model"`` compiles the whole model (``torch.compile(model)``, which Fabric applies
    again around its wrapper). Returns the losses, graphs compiled after each step and the parameter names."""
    _fresh_dynamo()
    fabric = make_fabric(FabricRun(precision=run.precision), world_size)
    fabric.seed_everything(0)
    with fabric.init_module():
        model: nn.Module = TinyGPT()
        if run.compiled == "blocks":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, backend=run.backend)
        elif run.compiled == "model":
            model = torch.compile(model, backend=run.backend)
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
        graphs.append(graphs_compiled())
    if save_to is not None:
        fabric.save(save_to, {"model": model, "optimizer": optimizer})
    return {"losses": losses, "graphs": graphs, "names": [n for n, _ in model.named_parameters()]}


def shard_model_of_compiled_model(rank: int, world_size: int) -> str:
    """``shard_model(torch.compile(model))``: the error message."""
    from lightning_shard.engine import shard_model

    try:
        shard_model(torch.compile(TinyGPT(), backend="aot_eager"), auto_wrap_policy={GPTBlock})
    except ValueError as error:
        return str(error)
    return "no error"
