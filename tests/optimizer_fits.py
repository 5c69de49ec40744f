"""Worker functions for the optimizer tests: one Fabric loop, as plain PyTorch code writes it (the user's own
``torch.nn.utils.clip_grad_norm_``, several optimizers), run under ``ShardStrategy`` on N ranks and in one process
without any strategy on the same global batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shard.fabric import ShardStrategy
from tests.checkpoint_fits import module_full_state
from tests.models import GPTBlock, TinyGPT, make_dataset

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


@dataclass
class OptimizerRun:
    """Which optimizers, which clipping, how many steps; optional save and resume."""

    optimizers: str = "muon"  # "muon" (Muon on the blocks' matrices, AdamW on the rest), "adafactor", or a class name
    steps: int = 4
    first_step: int = 0
    clip: float | None = None  # the user's own torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    strategy_kwargs: dict[str, Any] | None = None
    save_to: str | None = None
    resume_from: str | None = None


def newton_schulz_in_grad_dtype() -> None:
    """Run Muon's orthogonalisation in the gradient's dtype (float32 here) instead of bfloat16, so that two exact
    computations differ by float32 rounding only (bfloat16 would turn reduction-order rounding into 1e-3)."""
    import torch.optim._muon as muon

    def orthogonalise(grad: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
        a, b, c = coefficients
        x = grad.T if grad.size(0) > grad.size(1) else grad
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x

    muon._zeropower_via_newtonschulz = orthogonalise


def make_optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "muon":  # as torch's documentation advises: Muon on the hidden matrices, AdamW on the rest
        matrices = [p for n, p in trainable if p.dim() == 2 and "blocks" in n]
        rest = [p for n, p in trainable if not (p.dim() == 2 and "blocks" in n)]
        return [torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.1), torch.optim.AdamW(rest, lr=1e-2)]
    if kind == "adafactor":
        return [torch.optim.Adafactor([p for _, p in trainable], lr=1e-2, weight_decay=0.1)]
    if kind in ("NormalizedSGD", "AdamWithWarmup"):
        return [globals()[kind]([p for _, p in trainable])]
    cls = getattr(torch.optim, kind)
    kwargs: dict[str, Any] = {"lr": 1e-2} if kind not in ("Adadelta",) else {"lr": 1.0}
    return [cls([p for _, p in trainable], **kwargs)]


def _batch(step: int, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    data = make_dataset("gpt", n=16 * GLOBAL_BATCH)
    local = GLOBAL_BATCH // world_size
    start = step * GLOBAL_BATCH + rank * local
    return data[start : start + local]


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], run: OptimizerRun, rank: int, world: int,
           backward: Any) -> list[float]:
    norms = []
    for step in range(run.first_step, run.first_step + run.steps):
        x, y = _batch(step, rank, world)
        backward(_loss(model, x, y))
        if run.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip)))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return norms


def one_process(run: OptimizerRun) -> dict[str, Any]:
    """The oracle: the plain model and optimizers in this process, on the whole global batch."""
    newton_schulz_in_grad_dtype()
    torch.manual_seed(0)
    model = TinyGPT()
    optimizers = make_optimizers(model, run.optimizers)
    norms = _train(model, optimizers, run, 0, 1, lambda loss: loss.backward())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"params": params, "norms": norms}


def sharded(rank: int, world_size: int, run: OptimizerRun) -> dict[str, Any]:
    """The same loop under Fabric and ShardStrategy on ``world_size`` ranks."""
    newton_schulz_in_grad_dtype()
    if run.optimizers == "NormalizedSGD":
        from lightning_shard import declare_optimizer_update

        declare_optimizer_update(NormalizedSGD, "per_tensor")
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, **(run.strategy_kwargs or {}))
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    module = TinyGPT()
    model = fabric.setup_module(module)
    built = make_optimizers(model, run.optimizers)
    set_up = fabric.setup_optimizers(*built)
    optimizers = list(set_up) if len(built) > 1 else [set_up]
    state = {"model": model} | {f"optimizer{i}": opt for i, opt in enumerate(optimizers)}
    if run.resume_from is not None:
        fabric.load(run.resume_from, state)
    norms = _train(model, optimizers, run, rank, world_size, fabric.backward)
    if run.save_to is not None:
        fabric.save(run.save_to, state)
    full = module_full_state(module, [])["params"]
    return {"params": full, "norms": norms}


class NormalizedSGD(torch.optim.Optimizer):
    """A user's own matrix-wise optimizer: each step moves a tensor by ``lr`` along its gradient's direction, which
    reads the whole gradient's norm."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["steps"] = state.get("steps", 0) + 1  # a Python value in the state
                    p.add_(p.grad / p.grad.norm().clamp(min=1e-12), alpha=-group["lr"])
        return None


class AdamWithWarmup(torch.optim.AdamW):
    """A subclass of a known optimizer that keeps its update (only its defaults differ)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=1e-2, weight_decay=0.0)


def setup_refusal(rank: int, world_size: int, kind: str, declare: str | None = None) -> str | None:
    """Set up an optimizer of ``kind`` under ShardStrategy; the error it raised on this rank, if any."""
    from lightning_shard import declare_optimizer_update
    from lightning_shard.engine.optimizer_rule import _DECLARED

    _DECLARED.pop(NormalizedSGD, None)  # this worker process may have run a test that declared it
    if declare is not None:
        declare_optimizer_update(NormalizedSGD, declare)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ShardStrategy(auto_wrap_policy={GPTBlock}))
    fabric.launch()
    model = fabric.setup_module(TinyGPT())
    params = [p for p in model.parameters() if p.requires_grad]
    builders = {"LBFGS": torch.optim.LBFGS, "SparseAdam": torch.optim.SparseAdam, "NormalizedSGD": NormalizedSGD,
                "AdamWithWarmup": AdamWithWarmup}
    optimizer = builders[kind](params)
    try:
        fabric.setup_optimizers(optimizer)
    except ValueError as error:
        return str(error)
    return None


class AdafactorLit(L.LightningModule):
    """Automatic optimization as a Trainer user writes it: Adafactor with a learning-rate scheduler."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyGPT()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = _loss(self.net, *batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adafactor([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}


def trainer_fit(rank: int, world_size: int, engine: str) -> dict[str, Any]:
    """``AdafactorLit`` for 5 steps with Lightning's own clipping, under ``engine`` ("shard" or "ddp")."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_shard import ShardStrategy as TrainerShardStrategy
    from tests.fits import full_params_shard, trainer_for
    from tests.models import loader

    strategy = TrainerShardStrategy(auto_wrap_policy={GPTBlock}) if engine == "shard" else DDPStrategy()
    module = AdafactorLit()
    trainer = trainer_for(strategy, world_size, 5, gradient_clip_val=0.5)
    trainer.fit(module, train_dataloaders=loader("gpt"))
    if engine == "shard":
        params = full_params_shard(strategy)
        params = {name.removeprefix("net."): value for name, value in params.items()}
    else:
        params = {n: p.detach().clone() for n, p in module.net.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "params": params}


def lightning_grad_norms(rank: int, world_size: int) -> dict[str, Tensor]:
    """``lightning_shard.grad_norm`` after one backward of the sharded model (``world_size == 1``: Lightning's own
    ``grad_norm`` on the plain model, in this process)."""
    from lightning.pytorch.utilities import grad_norm as lightnings

    from lightning_shard import grad_norm

    torch.manual_seed(0)
    module = TinyGPT()
    if world_size == 1:
        _loss(module, *_batch(0, 0, 1)).backward()
        return {k: v.clone() for k, v in lightnings(module, 2).items()}
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ShardStrategy(auto_wrap_policy={GPTBlock}))
    fabric.launch()
    model = fabric.setup_module(module)
    fabric.backward(_loss(model, *_batch(0, rank, world_size)))
    return grad_norm(module, 2)


def engine_alone(rank: int, world_size: int, prepare: bool) -> dict[str, Any] | str:
    """Muon and AdamW on a model sharded by the engine alone (no Lightning), as a plain PyTorch script writes it,
    with or without ``lightning_shard.engine.prepare_optimizer``; the error of the first step if it raised."""
    from lightning_shard.engine import prepare_optimizer, shard_model

    newton_schulz_in_grad_dtype()
    torch.manual_seed(0)
    model = TinyGPT()
    shard_model(model, auto_wrap_policy={GPTBlock})
    optimizers = make_optimizers(model, "muon")
    if prepare:
        optimizers = [prepare_optimizer(optimizer, model) for optimizer in optimizers]
    try:
        _train(model, optimizers, OptimizerRun(), rank, world_size, lambda loss: loss.backward())
    except ValueError as error:
        return str(error)
    return {"params": module_full_state(model, [])["params"]}


def adafactor_small_head(rank: int, world_size: int, path: str, resume: bool) -> dict[str, Tensor]:
    """Adafactor on ``UnevenMLP`` (a 2-row head: at 2 ranks each holds one row, so its (1, 10) column statistics
    have a rank's row shape) with the engine alone: 2 steps then a save, or a load then 2 more steps
    (``world_size == 1``, in this process without a process group: the 4 steps)."""
    from lightning_shard.checkpoint import load_checkpoint, save_checkpoint
    from lightning_shard.engine import prepare_optimizer, shard_model
    from tests.models import UnevenMLP

    torch.manual_seed(0)
    model = UnevenMLP()
    data = make_dataset("uneven", n=48)
    if world_size > 1:
        shard_model(model, auto_wrap_policy={"MLPBlock"})
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    if world_size > 1:
        prepare_optimizer(optimizer, model)
    if resume:
        load_checkpoint(path, model, [optimizer])
    steps = range(2, 4) if resume else range(4 if world_size == 1 else 2)
    for step in steps:
        local = 12 // world_size
        x, y = data[step * 12 + rank * local : step * 12 + (rank + 1) * local]
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    if world_size > 1 and not resume:
        save_checkpoint(path, model, [optimizer], {})
    if world_size == 1:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    return module_full_state(model, [])["params"]
