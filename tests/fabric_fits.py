"""Worker functions for the Fabric tests: the same training loop (accumulation through ``no_backward_sync``,
clipping through ``fabric.clip_gradients``) under Fabric's DDPStrategy and under ``ShardStrategy``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import DDPStrategy
from torch import Tensor, nn

from lightning_shard.engine import sharded_module_of
from lightning_shard.fabric import ShardStrategy
from tests.checkpoint_fits import module_full_state
from tests.fits import full_params
from tests.models import GPTBlock, TinyGPT, make_dataset

DATA_STEPS = 12  # optimizer steps of data every run draws from


@dataclass
class FabricRun:
    """One Fabric training run: which model, strategy and schedule; optional save and resume."""

    kind: str = "gpt"  # "gpt" (tests.models.TinyGPT) or "hf_gpt2" (transformers' GPT2LMHeadModel)
    strategy: str = "shard"  # "shard" (an instance), "ddp", or "name:<registered name>" such as "name:shard"
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    precision: str = "32-true"
    steps: int = 6
    first_step: int = 0  # resumed runs start here
    accumulate: int = 2
    global_batch: int = 12
    max_norm: float | None = 1.0
    save_to: str | None = None  # save {"model", "optimizer", "step"} here after the last step
    resume_from: str | None = None


def make_fabric_model(kind: str) -> nn.Module:
    if kind == "gpt":
        return TinyGPT()
    import transformers

    from tests.test_hf_gpt2 import gpt2_config

    return transformers.GPT2LMHeadModel(gpt2_config())


def block_of(kind: str) -> set[Any]:
    return {GPTBlock} if kind == "gpt" else {"GPT2Block"}


def loss_of(kind: str, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    if kind == "gpt":
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return model(input_ids=x, labels=x).loss


def make_fabric(run: FabricRun, world_size: int) -> L.Fabric:
    strategy: Any
    if run.strategy == "ddp":
        strategy = DDPStrategy()
    elif run.strategy == "shard":
        strategy = ShardStrategy(auto_wrap_policy=block_of(run.kind), **run.strategy_kwargs)
    else:
        strategy = run.strategy.removeprefix("name:")
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=run.precision)
    fabric.launch()
    return fabric


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (the same groups in every run)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2)


def fabric_fit(rank: int, world_size: int, run: FabricRun) -> dict[str, Any]:
    """Train ``run.steps`` optimizer steps; return the global loss and gradient norm of each step."""
    fabric = make_fabric(run, world_size)
    fabric.seed_everything(0)
    model = fabric.setup_module(make_fabric_model(run.kind))
    optimizer = fabric.setup_optimizers(optimizer_for(model))
    step = run.first_step
    if run.resume_from is not None:
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(run.resume_from, state)
        assert state["step"] == run.first_step, state["step"]
    data = make_dataset("gpt", n=DATA_STEPS * run.accumulate * run.global_batch)  # the same rows in every run
    local = run.global_batch // world_size
    losses, norms, local_losses = [], [], []
    for step in range(run.first_step, run.first_step + run.steps):
        micro_losses = []
        for micro in range(run.accumulate):
            start = (step * run.accumulate + micro) * run.global_batch + rank * local
            x, y = data[start : start + local]
            with fabric.no_backward_sync(model, enabled=micro < run.accumulate - 1):
                loss = loss_of(run.kind, model, x, y)
                fabric.backward(loss / run.accumulate)
            micro_losses.append(loss.detach())
        if run.max_norm is not None:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=run.max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        local_losses.append(float(torch.stack(micro_losses).mean()))
        losses.append(float(fabric.all_reduce(torch.stack(micro_losses).mean(), reduce_op="mean")))
    if run.save_to is not None:
        fabric.save(run.save_to, {"model": model, "optimizer": optimizer, "step": step + 1})
        if isinstance(fabric.strategy, ShardStrategy):
            fabric.strategy.wait_for_save()  # async_save=True: the directory is complete from here on
    precision = repr(fabric.strategy.precision)
    return {"losses": losses, "norms": norms, "local_losses": local_losses, "precision": precision}


def fabric_lit_module(rank: int, world_size: int, load_from: str | None, steps: int, save_to: str | None) -> dict:
    """The Trainer tests' LightningModule set up in Fabric: optionally load a checkpoint (Trainer- or Fabric-written),
    train ``steps`` steps, optionally save; the full state after loading and at the end."""
    from tests.models import LitModel, loader

    fabric = make_fabric(FabricRun(), world_size)
    fabric.seed_everything(0)
    module = LitModel("gpt")
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    remainder: dict[str, Any] = {}
    if load_from is not None:
        remainder = fabric.load(load_from, {"model": module, "optimizer": optimizer})
    loaded = module_full_state(module, [optimizer.optimizer])
    batches = iter(fabric.setup_dataloaders(loader("gpt", batch_size=12 // world_size)))
    for _ in range(steps):
        x, y = next(batches)
        logits = model(x)
        fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    if save_to is not None:
        fabric.save(save_to, {"model": module, "optimizer": optimizer, "step": steps})
    return {"loaded": loaded, "end": module_full_state(module, [optimizer.optimizer]), "remainder": sorted(remainder)}


class SamplingGPT(TinyGPT):
    """A model whose ``logits_by_hand`` calls its blocks directly, as a ``generate()`` does, not via ``forward``."""

    def logits_by_hand(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def fabric_surface(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Meta-device init, joint setup, the collectives, a method other than forward, load_raw of a plain file."""
    from lightning_shard import consolidate

    fabric = make_fabric(FabricRun(), world_size)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):
        module = SamplingGPT()
    on_meta = all(p.is_meta for p in module.parameters())
    model_bytes = sum(p.numel() * 4 for p in module.parameters())
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)  # built before setup: fabric.setup converts it
    model, optimizer = fabric.setup(module, optimizer)
    from lightning_shard.engine import sharded_module_of

    engine = sharded_module_of(module)
    shards = {id(p.sharded) for p in engine.sharded_params()}
    optimizer_holds_shards = all(id(q) in shards for g in optimizer.param_groups for q in g["params"])
    largest_unit = max(u.flat_unsharded.numel() for u in engine.units)
    x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = model(x).logsumexp(-1).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        by_forward = model(x)
        by_hand = model.logits_by_hand(x)
    gathered = fabric.all_gather(torch.tensor([float(rank)]))
    reduced = fabric.all_reduce(torch.tensor([float(rank)]), reduce_op="sum")
    broadcast = fabric.broadcast(f"from rank {rank}", src=1)
    fabric.barrier()
    fabric.save(f"{tmp}/ckpt", {"model": module, "optimizer": optimizer})
    plain = f"{tmp}/model.safetensors"
    if fabric.global_rank == 0:
        consolidate(f"{tmp}/ckpt", plain)
    fabric.barrier()
    trained = module_full_state(module, [])["params"]
    fabric.seed_everything(1)
    other = fabric.setup_module(SamplingGPT())  # different initial weights
    fabric.load_raw(plain, other)
    reloaded = module_full_state(other, [])["params"]
    return {
        "on_meta": on_meta, "optimizer_holds_shards": optimizer_holds_shards,
        "largest_unit_bytes": largest_unit, "model_bytes": model_bytes,
        "by_forward": by_forward, "by_hand": by_hand,
        "gathered": gathered.flatten().tolist(), "reduced": reduced.item(), "broadcast": broadcast,
        "trained": trained, "reloaded": reloaded,
    }


def fabric_refusals(rank: int, world_size: int) -> dict[str, str]:
    """The message of each misuse, as this rank saw it."""
    fabric = make_fabric(FabricRun(), world_size)
    messages: dict[str, str] = {}

    def record(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - the message is what the test checks
            messages[name] = f"{type(err).__name__}: {err}"

    stepped_model = TinyGPT()
    stepped = torch.optim.SGD(stepped_model.parameters(), lr=0.1, momentum=0.9)
    stepped_model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    stepped.step()
    record("stepped optimizer", lambda: fabric.setup(stepped_model, stepped))
    model = fabric.setup_module(TinyGPT())
    record("foreign optimizer", lambda: fabric.setup_optimizers(torch.optim.SGD(TinyGPT().parameters(), lr=0.1)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.zeros(2, 8, dtype=torch.long)).sum())
    first = next(p for p in model.parameters() if p.grad is not None and p.grad.numel() > 0)
    if rank == 0:
        first.grad[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    grads_before = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    record("nonfinite norm", lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0))
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    grads_kept = all(
        (g is None and p.grad is None) or (g is not None and torch.equal(g, p.grad, ))
        for g, p in zip(grads_before, model.parameters())
    )
    messages["unchanged"] = str(unchanged and grads_kept)
    record("load without state", lambda: fabric.load("anywhere"))
    record("two modules", lambda: fabric.save("anywhere", {"a": model, "b": fabric.setup_module(TinyGPT())}))
    return messages


def fabric_load_raw_of_torch_save_files(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """``fabric.load_raw`` of ``torch.save`` state dicts (zip and legacy) into a set-up module and into a module never
    set up, of a pickle that calls a function, and into an optimizer: whether each module then holds the saved
    weights exactly, and each error's message and the built-in exception types it is an instance of."""
    fabric = make_fabric(FabricRun(), world_size)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(5)
    state = {k: v.detach().clone() for k, v in TinyGPT().state_dict().items()}  # other weights than the model's
    if rank == 0:
        torch.save(state, f"{tmp}/model.pt")
        torch.save(state, f"{tmp}/legacy.pt", _use_new_zipfile_serialization=False)
        torch.save({"weight": torch.ones(1), "hook": print}, f"{tmp}/calls.pt")
    fabric.barrier()
    results: dict[str, Any] = {}
    engine = sharded_module_of(model)
    assert engine is not None
    for name in ("model.pt",):
        fabric.load_raw(f"{tmp}/{name}", model)
        full = full_params(engine)
        results[name] = all(torch.equal(full[k], state[k]) for k in full)
        plain = TinyGPT()
        fabric.load_raw(f"{tmp}/{name}", plain)  # never set up: loads the whole state, as under FSDPStrategy
        results[f"plain {name}"] = all(torch.equal(v, state[k]) for k, v in plain.state_dict().items())
    for name, target, path in [("calls", model, "calls.pt"), ("legacy", model, "legacy.pt"),
                               ("optimizer", optimizer, "model.pt")]:
        try:
            fabric.load_raw(f"{tmp}/{path}", target)
        except Exception as err:  # noqa: BLE001 - the message and type are what the test checks
            kinds = [k.__name__ for k in (ValueError, NotImplementedError, RuntimeError) if isinstance(err, k)]
            results[name] = {"message": str(err), "is": kinds}
    return results


class _TwinModule(L.LightningModule):
    """The Fabric loop of ``fabric_fit`` (one micro-batch a step, no clipping) as a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.model(x).float()  # as Fabric hands the module's output to the loop: in fp32
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self)


def trainer_twin(rank: int, world_size: int, precision: str, steps: int, global_batch: int = 12) -> list[float]:
    """``fabric_fit(FabricRun(accumulate=1, max_norm=None))`` under the Trainer's ShardStrategy: this rank's losses."""
    from torch.utils.data import DataLoader, Subset

    from lightning_shard import ShardStrategy as TrainerShardStrategy

    L.seed_everything(0)
    module = _TwinModule()
    data = make_dataset("gpt", n=DATA_STEPS * global_batch)
    local = global_batch // world_size
    rows = [s * global_batch + rank * local + i for s in range(steps) for i in range(local)]  # fabric_fit's rows
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=TrainerShardStrategy(auto_wrap_policy={GPTBlock}),
        precision=precision, max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader(Subset(data, rows), batch_size=local, shuffle=False))
    return module.losses


def fabric_with_another_checkpoint_io(rank: int, world_size: int) -> str:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class Elsewhere(TorchCheckpointIO):
        """A CheckpointIO plugin ShardStrategy would ignore."""

    try:
        L.Fabric(accelerator="cpu", devices=world_size, strategy=ShardStrategy(), plugins=[Elsewhere()])
    except NotImplementedError as err:
        return str(err)
    return ""
