"""Lightning-level worker functions: loops, metrics, optimizers and configure_model under ShardStrategy; and what
sharding must cost in bytes, in closed form from the parameters' shapes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

from lightning_shard import ShardPrecision, ShardStrategy
from tests.fits import full_params_shard, trainer_for
from tests.models import GPTBlock, LitModel, MLPBlock, MLPStack, TinyGPT, block_class, lit_model, loader


class Classifier(LitModel):
    """MLP classifier with validation/test/predict steps and a torchmetrics accuracy synced across ranks."""

    def __init__(self) -> None:
        super().__init__("mlp")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=5, average="micro")
        self.val_losses: list[float] = []

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_losses.append(F.cross_entropy(logits, y).item())
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, on_epoch=True, sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)


def loops_and_metrics(rank: int, world_size: int, use_ddp: bool) -> dict[str, Any]:
    L.seed_everything(0)
    module = Classifier()
    strategy = DDPStrategy() if use_ddp else ShardStrategy(auto_wrap_policy={MLPBlock})
    trainer = trainer_for(strategy, world_size, steps=12, max_epochs=3, limit_val_batches=3)
    val = loader("mlp")
    trainer.fit(module, train_dataloaders=loader("mlp"), val_dataloaders=val)
    val_acc = trainer.callback_metrics["val_acc"].item()
    tested = trainer.test(module, dataloaders=val, verbose=False)[0]["test_loss"]
    predictions = torch.cat(trainer.predict(module, dataloaders=val))
    return {"losses": module.losses, "val_losses": module.val_losses, "val_acc": val_acc, "test_loss": tested,
            "predictions": predictions}


class TwoOptimizers(L.LightningModule):
    """Manual optimization with one optimizer per half of the network (GAN-style alternation)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = MLPStack()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_body, opt_head = self.optimizers()
        x, y = batch
        for opt in (opt_body, opt_head):
            loss = F.cross_entropy(self.model(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.losses.append(loss.item())

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        head = list(self.model.head.parameters())
        body = [p for n, p in self.model.named_parameters() if not n.startswith("head.")]
        return [torch.optim.AdamW(body, lr=1e-2), torch.optim.SGD(head, lr=0.1, momentum=0.9)]


def two_optimizers(rank: int, world_size: int, use_ddp: bool) -> list[float]:
    L.seed_everything(0)
    module = TwoOptimizers()
    strategy = DDPStrategy() if use_ddp else ShardStrategy(auto_wrap_policy={MLPBlock})
    trainer_for(strategy, world_size, steps=8).fit(module, train_dataloaders=loader("mlp"))
    return module.losses


class MetaGPT(LitModel):
    """Builds the GPT on the meta device in configure_model: no rank ever holds the full model."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.kind, self.lr, self.losses = "gpt", 1e-2, []
        self.model: nn.Module | None = None
        self.built_on_meta = False

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = TinyGPT()
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())

    def on_train_start(self) -> None:
        engine = self.trainer.strategy.engine
        self.initial = {fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params() for fqn in p.fqns}


def meta_configure_model(rank: int, world_size: int) -> dict[str, Any]:
    L.seed_everything(0)
    module = MetaGPT()
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock})
    trainer_for(strategy, world_size, steps=10).fit(module, train_dataloaders=loader("gpt"))
    engine = strategy.engine
    tied = module.model.lm_head.weight is module.model.wte.weight
    full = {p.fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params()}
    return {"built_on_meta": module.built_on_meta, "losses": module.losses, "tied": tied, "full": full,
            "initial": module.initial,
            "largest_unit_bytes": max(u.flat_unsharded.nbytes for u in engine.units),
            "model_bytes": sum(p.numel * p.dtype.itemsize for p in engine.sharded_params())}


def ddp_from_weights(rank: int, world_size: int, weights: dict[str, Tensor]) -> dict[str, Any]:
    L.seed_everything(0)
    module = LitModel("gpt")
    module.load_state_dict(weights)
    trainer_for(DDPStrategy(), world_size, steps=10).fit(module, train_dataloaders=loader("gpt"))
    return {"losses": module.losses, "full": {n: p.detach().clone() for n, p in module.named_parameters()}}


def memory_after_step(rank: int, world_size: int) -> dict[str, Any]:
    L.seed_everything(0)
    module = LitModel("gpt")
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock})
    trainer = trainer_for(strategy, world_size, steps=3)
    trainer.fit(module, train_dataloaders=loader("gpt"))
    report = strategy.memory_report()
    engine = strategy.engine
    # What dim-0 sharding must pad, from the global shapes alone (not from the engine's own buffer sizes): each
    # rank holds ceil(rows / N) rows of every parameter and, for a trainable one, of its gradient, plus one
    # "was used" flag per trainable parameter.
    elsize, padding = 4, 0.0
    for p in engine.sharded_params():
        rows = p.global_shape[0] if len(p.global_shape) else 1
        row_numel = math.prod(p.global_shape[1:])
        extra = math.ceil(rows / world_size) * row_numel - rows * row_numel / world_size
        padding += (extra * (2 if p.requires_grad else 1) + (1 if p.requires_grad else 0)) * elsize
    unsharded_alive = sum(u.flat_unsharded.untyped_storage().nbytes() for u in engine.units)
    return {"report": report, "padding": padding, "unsharded_alive": unsharded_alive}


def raising_wrap_policy(rank: int, world_size: int) -> str:
    module = LitModel("mlp")
    trainer = trainer_for(ShardStrategy(auto_wrap_policy={"NoSuchBlock", GPTBlock}), world_size, steps=1)
    try:
        trainer.fit(module, train_dataloaders=loader("mlp"))
    except ValueError as err:
        return str(err)
    return ""


def raising_mesh(rank: int, world_size: int) -> str:
    trainer = trainer_for(ShardStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(3, 2)), world_size, steps=1)
    try:
        trainer.fit(LitModel("mlp"), train_dataloaders=loader("mlp"))
    except ValueError as err:
        return str(err)
    return ""


class ScaleRecorder(L.Callback):
    """Records the loss scale at the start of every training step (empty without a loss scaler)."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scales.append(scaler.get_scale())


def fit_shard_in_precision(
    rank: int,
    world_size: int,
    kind: str,
    precision: str,
    sharding: str = "FULL_SHARD",
    device_mesh: tuple[int, int] | None = None,
    steps: int = 10,
) -> dict[str, Any]:
    """``fit_shard`` in ``precision`` and a sharding strategy; also the loss scale of every step. The precision goes
    in as a ``ShardPrecision`` plugin: ``Trainer(precision="16-mixed")`` on CPU would run bf16-mixed instead."""
    L.seed_everything(0)
    module = lit_model(kind)
    strategy = ShardStrategy(auto_wrap_policy={block_class(kind)}, sharding_strategy=sharding, device_mesh=device_mesh)
    recorder = ScaleRecorder()
    plugin = ShardPrecision(precision)  # type: ignore[arg-type]
    trainer = trainer_for(strategy, world_size, steps, plugins=[plugin], callbacks=[recorder])
    trainer.fit(module, train_dataloaders=loader(kind))
    return {"losses": module.losses, "params": full_params_shard(strategy), "scales": recorder.scales}


# Closed forms: what dim-0 sharding must cost, from the parameters' shapes alone (never the engine's buffers) #

Params = list[tuple[str, nn.Parameter]]


def units_of(model: nn.Module, block: type[nn.Module]) -> dict[str, Params]:
    """Each sharding unit's parameters when every ``block`` is a unit and the root (``""``) holds the rest, blocks in
    module order. A parameter is listed once, under its first name; one whose names span units (a tied weight) is the
    root's."""
    blocks = [name for name, m in model.named_modules() if isinstance(m, block)]
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    units: dict[str, Params] = {"": [], **{b: [] for b in blocks}}
    for pid, fqns in names.items():
        owners = {next((b for b in blocks if fqn.startswith(b + ".")), "") for fqn in fqns}
        units[owners.pop() if len(owners) == 1 else ""].append((fqns[0], params[pid]))
    return units


def chunk_numel(shape: torch.Size, n: int) -> int:
    """Elements of one rank's chunk of a parameter of ``shape`` over ``n`` ranks: ``ceil(rows / n)`` rows, the last
    chunks padded (a 0-dim parameter is one row)."""
    rows = shape[0] if len(shape) else 1
    return math.ceil(rows / n) * math.prod(shape[1:])


def gather_bytes(params: Params, n: int, itemsize: Callable[[str], int]) -> int:
    """Bytes one all-gather of ``params`` over ``n`` ranks fills: every rank's padded chunk of each parameter, in its
    compute dtype (``itemsize(name)`` bytes an element)."""
    return sum(n * chunk_numel(p.shape, n) * itemsize(name) for name, p in params)


def reduce_bytes(params: Params, n: int, itemsize: int = 4) -> int:
    """Bytes of one gradient reduction of ``params`` over ``n`` ranks, as a reduce-scatter's input: every rank's
    padded chunk of each trainable parameter's gradient plus one "was used" flag per trainable parameter, in the
    reduce dtype; nothing for a unit with no trainable parameter."""
    trainable = [p for _, p in params if p.requires_grad]
    return n * (sum(chunk_numel(p.shape, n) for p in trainable) + len(trainable)) * itemsize if trainable else 0


def step_gathers(units: dict[str, Params], n: int, itemsize: Callable[[str], int]) -> list[int]:
    """Bytes of each all-gather of one training step under ``FULL_SHARD``, in order: every unit in forward (root
    first), then in backward every block but the last, which stays gathered from forward; the root stays gathered
    through backward (see [Note: the root unit] and [Note: the last unit of forward stays gathered])."""
    per_unit = [gather_bytes(params, n, itemsize) for params in units.values()]
    return per_unit + per_unit[1:-1][::-1]
