"""``ShardStrategy``: the Lightning side. It sets up processes and the mesh, hands the model to the
engine, and routes Lightning's hooks to it; the sharding itself lives in ``engine``/``unit``."""
# Annotations are evaluated (no ``from __future__ import annotations``): jsonargparse, and so LightningCLI, reads
# the arguments' types as objects from ``inspect.signature(ShardStrategy)``.

import logging
import os
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.checkpoint.io.selection import MODEL_SELECTION_KEY, ModelSelection
from lightning_shard.checkpoint.io.storage import location
from lightning_shard.checkpoint.save.background import refuse_full_layout_in_background
from lightning_shard.checkpoint.save.directory import save_checkpoint_dir
from lightning_shard.checkpoint.state_dicts import model_state_dict, optimizer_state_dict, state_dicts_available
from lightning_shard.common.options import declare_shard_arguments
from lightning_shard.common.registry import register_shard_strategies
from lightning_shard.common.setup import accumulating, setup_sharded_module
from lightning_shard.common.strategy_base import ShardStrategyMixin, refuse_local_storage_options, refuse_unpickling
from lightning_shard.engine.clipping import clip_grad_norm_
from lightning_shard.engine.compile import refuse_compiled_root
from lightning_shard.engine.memory import MemoryReport, memory_report
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.option_choices import StateDictType
from lightning_shard.engine.progress import note_step
from lightning_shard.engine.sharded_module import ShardedModule
from lightning_shard.engine.torch_norms import warn_if_lightning_grad_norm
from lightning_shard.engine.whole_tensor_step import prepare_optimizer
from lightning_shard.engine.wrapping import wrap_marks_units
from lightning_shard.trainer.checkpoints import (
    load_model_state,
    load_optimizer_states,
    read_trainer_checkpoint,
    remove_checkpoint_dir,
    saves_in_background,
)
from lightning_shard.trainer.last_checkpoint import newest_last_checkpoint
from lightning_shard.trainer.precision import ShardPrecision, as_shard_precision
from lightning_shard.trainer.preemption import attach_preemption, detach_preemption
from lightning_shard.trainer.save_scope import SaveScope, TrainerSaves
from lightning_shard.trainer.summary import use_full_counts
from lightning_shard.trainer.weight_averaging import adopt_weight_averaging, build_averaged_models

log = logging.getLogger(__name__)


@declare_shard_arguments
class ShardStrategy(ShardStrategyMixin, ParallelStrategy):
    """Fully sharded data parallel training (ZeRO-3) on ``torch.distributed``: gloo on CPU, NCCL on GPU.

    Each rank holds ``1/N`` of every parameter, gradient and optimizer state. The optimizer sees this
    rank's rows of each parameter as ordinary ``nn.Parameter``s under their original names, so any
    ``torch.optim`` optimizer and parameter groups built by name work unchanged.

    Besides Lightning's own arguments, which the Trainer fills in, it takes the sharding arguments below, by keyword;
    Fabric's ``lightning_shard.fabric.ShardStrategy`` takes the same.
    """

    strategy_name = "shard"
    _registered_strategies: list[str] = []

    def __init__(  # Lightning's arguments, annotated as Lightning's ParallelStrategy annotates them
        self, accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
        precision_plugin=None, **arguments: Any
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.num_nodes = 1
        self._take_arguments(arguments)  # the saver serves plugins=[AsyncCheckpointIO()]
        self._engine: ShardedModule | None = None
        self._saves = TrainerSaves()  # see [Note: a Trainer save gathers nothing it does not write]

    # Properties #

    @property
    def is_distributed(self) -> bool:
        """Tells the Trainer to give dataloaders a ``DistributedSampler``."""
        return True

    @property
    @override
    def precision_plugin(self) -> ShardPrecision:
        if not isinstance(self._precision_plugin, ShardPrecision):
            self._precision_plugin = ShardPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = as_shard_precision(plugin)

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        """The dtypes in effect: ``mixed_precision`` if given, else what the precision plugin implies."""
        return self.options.mixed_precision or self.precision_plugin.mixed_precision_config

    @property
    def engine(self) -> ShardedModule:
        """The sharding engine of the model; available once the Trainer has set the model up."""
        if self._engine is None:
            raise RuntimeError("The model is sharded when the Trainer sets it up (in fit/validate/test/predict).")
        return self._engine

    # Environment #

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def find_last_checkpoint(self, trainer: pl.Trainer) -> str | None:
        """Where ``fit(ckpt_path="last")`` resumes from when a ``ModelCheckpoint`` saves to a URL (``None``: leave it
        to Lightning); see [Note: "last" on object storage]."""
        return newest_last_checkpoint(trainer, self.options.storage_options)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._check_parallel_sizes()
        self.set_world_ranks()
        self._start_mesh()
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self._tensor_parallel_mesh  # configure_model's self.device_mesh
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            trainer = self.lightning_module.trainer  # see [Note: weight averaging on shards]
            adopt_weight_averaging(getattr(trainer, "callbacks", []))

    # Model #

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        refuse_unsupported_callbacks(getattr(trainer, "callbacks", []))
        if self.lightning_module is not None:  # see torch_norms.grad_norm
            warn_if_lightning_grad_norm(self.lightning_module, rank_zero_warn)
        self._saves.watch(trainer)
        if saves_in_background(self._checkpoint_io):
            layout = self.options.state_dict_type
            refuse_full_layout_in_background(layout, "AsyncCheckpointIO", "remove AsyncCheckpointIO")
        self.accelerator.setup(trainer)
        self.precision_plugin.set_device(self.root_device.type)
        self.precision_plugin.clip_norm_fn = self._clip_optimizer_grad_norm
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:  # Trainer(sync_batchnorm=True)
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self._setup_model(self.model)
        use_full_counts(getattr(trainer, "callbacks", []))  # the model summary counts parameters in full
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:  # optimizer state lives with the shards
            _optimizers_to_device(self.optimizers, torch.device("cpu") if self.offloads else self.root_device)
            attach_preemption(trainer, finish_saves=self._saver.wait)  # see [Note: preemption at a step boundary]
            build_averaged_models(getattr(trainer, "callbacks", []), self.model)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The LightningModule's optimizers, each checked and prepared for the shards before its first step (see
        [Note: what an optimizer may see of a sharded parameter])."""
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            prepare_optimizer(optimizer, [self.engine])

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` in place (the LightningModule is the root unit); it stays the same object."""
        refuse_compiled_root(model)  # see [Note: compiled blocks and the sharding hooks]
        self._engine = setup_sharded_module(
            model, self.options, self.mesh, self.root_device, self.mixed_precision_config
        )
        return model

    @override
    def model_to_device(self) -> None:
        """Deliberately nothing: the engine moves each shard to the device as it creates it."""

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        empty_init_context = torch.device("meta") if empty_init else nullcontext()
        with empty_init_context, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """What ``configure_model`` runs in: PyTorch's ``wrap(module)`` marks ``module`` as a unit (it stays the same
        object; see [Note: manual units]). Nothing is sharded here: modules created on the meta device are
        materialised and initialised (``reset_parameters()``) one unit at a time when the engine shards them."""
        with wrap_marks_units():
            yield

    # Steps: always go through the root's forward hooks (see [Note: the root unit]) #

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.lightning_module is not None:  # name the step in a StalledRanksError
            note_step(self.lightning_module.trainer.global_step)
        with self.precision_plugin.train_step_context():
            return self._run_step("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run_step("predict_step", args, kwargs)

    def _run_step(self, method: str, args: tuple, kwargs: dict) -> Any:
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        assert self.lightning_module is not None
        return self._forward_redirection(self.lightning_module, self.lightning_module, method, *args, **kwargs)

    # Gradient accumulation and clipping #

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for micro-batches that do not end an accumulation window. With
        ``grad_sync="step"`` their gradients stay unreduced on the unsharded weights; with ``"microbatch"``
        they are reduced right away, as always. Either way the forward after such a micro-batch broadcasts no
        buffers, as after DDP's ``no_sync()`` (see [Note: buffers follow DDP] in ``engine.py``)."""
        if self._engine is None:
            yield
            return
        with accumulating(self._engine, self.options.grad_sync):
            yield

    def clip_grad_norm_(
        self, parameters: Iterable[Tensor] | None = None, max_norm: float = float("inf"), norm_type: float = 2.0
    ) -> Tensor:
        """Clip gradients by their global norm over all shards and return that norm (identical on every rank).

        ``parameters`` are the sharded parameters to clip (default: all of the model's). The default
        ``max_norm`` of infinity only computes the norm, e.g. to log it. Every rank must call it.
        """
        shards = list(parameters) if parameters is not None else [p.sharded for p in self.engine.sharded_params()]
        return clip_grad_norm_(shards, self.engine.mesh, self.root_device, max_norm, norm_type)

    def _clip_optimizer_grad_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm_(params, max_norm)

    # Collectives #

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """The Trainer's name for ``all_reduce``."""
        return self.all_reduce(tensor, group, reduce_op)

    # Checkpoints: directories of safetensors and JSON (see docs/checkpoint_format.md) #

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Load checkpoints after the model is sharded: each rank reads only its rows."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict under its usual names, as ``state_dict_type`` says: ``"full"``: on global
        rank 0 every tensor in full on the CPU (gathered one at a time), ``{}`` on the other ranks; ``"sharded"``:
        this rank's rows of every parameter as ``DTensor`` views (no copy), buffers as plain tensors. Inside
        ``trainer.save_checkpoint`` (its ``on_save_checkpoint`` hooks included) always the sharded views: see
        [Note: a Trainer save gathers nothing it does not write]. Collective: every rank must call it."""
        assert self.lightning_module is not None
        if self._saves.scope is SaveScope.TRAINER_SAVE and not state_dicts_available(self.engine):
            return {}  # HYBRID_SHARD with tensor parallelism has none; the save writes from the shards
        return model_state_dict(self.lightning_module, self._state_dict_layout())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer``'s state keyed by parameter name (``{"state": {name: {...}}, "param_groups": [{...,
        "params": [name, ...]}]}``), in the layout ``lightning_module_state_dict`` gives. Collective."""
        assert self.lightning_module is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer: the optimizer it wraps
        if self._saves.scope is SaveScope.TRAINER_SAVE and not state_dicts_available(self.engine):
            return {}
        return optimizer_state_dict(self.lightning_module, optimizer, self._state_dict_layout())

    def _state_dict_layout(self) -> StateDictType:
        if self._saves.scope is SaveScope.TRAINER_SAVE:
            return StateDictType.SHARDED  # the save writes from the shards: nothing to gather for it
        return self.options.state_dict_type

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write a checkpoint directory at ``filepath``: sharded safetensors (``state_dict_type="sharded"``) or
        one ``model.safetensors`` (``"full"``), plus JSON, atomically. ``filepath`` may be a URL (``s3://...``, any
        fsspec protocol), ``storage_options`` a dict for its file system. Collective: every rank must call it."""
        refuse_local_storage_options(filepath, storage_options)
        assert self.lightning_module is not None
        path = location(self.broadcast(os.fspath(filepath)), storage_options or self._url_options(filepath))
        layout = self.options.state_dict_type
        checkpoint = {**checkpoint, MODEL_SELECTION_KEY: ModelSelection(self.options.saved_parameters)}
        args = (self.engine, self.lightning_module, self.optimizers, checkpoint, path, layout)
        if saves_in_background(self._checkpoint_io) and self._fitting():
            self._saver.save(*args)  # see [Note: background saves]
        else:
            self._saver.wait()
            save_checkpoint_dir(*args)

    def _fitting(self) -> bool:
        """Whether a fit is running (saves after it ended are synchronous: nothing would wait for them)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return False
        return trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING

    @override
    def on_train_end(self) -> None:
        """The end of fit waits for a background save in flight; its failure is raised here, on every rank."""
        self._saver.wait()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the trainer state of a checkpoint directory, a Lightning ``.ckpt`` or a DCP directory (model and
        optimizer tensors are read into the shards later, by ``load_model_state_dict`` and
        ``load_optimizer_state_dict``). Never runs a pickle: see [Note: no pickle runs]; ``weights_only=False`` is
        refused."""
        refuse_unpickling(weights_only)
        path = self.broadcast(os.fspath(checkpoint_path))
        return read_trainer_checkpoint(location(path, self._url_options(path)))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """The model's rows; in a fit, the optimizers' too, in the same read (``load_model_state``)."""
        assert self.lightning_module is not None
        restores = self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.lightning_restore_optimizer
        optimizers = self.optimizers if restores else []
        load_model_state(self.engine, self.lightning_module, checkpoint, strict, optimizers)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        load_optimizer_states(self.engine, self.optimizers, checkpoint, self.lightning_module.strict_loading)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove a checkpoint directory (ModelCheckpoint's ``save_top_k``)."""
        self._saver.wait()  # never remove a directory a background save is finishing
        if self.is_global_zero:
            remove_checkpoint_dir(location(os.fspath(filepath), self._url_options(filepath)))

    # Reporting #

    def memory_report(self) -> MemoryReport:
        """This rank's bytes of sharded parameters, gradients and optimizer state, and what full replication takes."""
        return memory_report(self.engine, self.optimizers, self.global_rank)

    # Teardown #

    @override
    def teardown(self) -> None:
        log.debug(f"{type(self).__name__}: tearing down")
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self._saver.close()
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            detach_preemption(self.lightning_module._trainer)
        if self._engine is not None:
            self._engine.reshard_all()
        if self._mesh is not None:
            self._mesh.destroy()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # Registry #

    @classmethod
    def get_registered_strategies(cls) -> list[str]:
        return cls._registered_strategies

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._registered_strategies.extend(register_shard_strategies(strategy_registry, cls))


def refuse_unsupported_callbacks(callbacks: Iterable[Any]) -> None:
    """Refuse, on every rank and before anything is sharded, the callbacks that need the model's parameters in full:
    ``StochasticWeightAveraging`` keeps a replicated averaged copy built from the parameters it finds, which under
    ShardStrategy are this rank's shards (Lightning refuses it for its own sharded strategies too). Lightning's
    ``WeightAveraging`` callbacks work: see [Note: weight averaging on shards]."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    if any(isinstance(callback, StochasticWeightAveraging) for callback in callbacks):
        raise ValueError(
            "StochasticWeightAveraging does not work with ShardStrategy: it averages a copy of the model's"
            " parameters, which are this rank's shards. Use lightning.pytorch.callbacks.WeightAveraging instead"
            " (by default the equal-weight average SWA takes; EMAWeightAveraging for an exponential moving"
            " average): it averages each rank's shards (docs/finetuning.md)."
        )
