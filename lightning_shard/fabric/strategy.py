"""``ShardStrategy`` for Lightning Fabric: the Fabric front end of the sharding engine.

It translates Fabric's calls (``setup_module``, ``setup_optimizers``, ``backward``, ``no_backward_sync``,
``clip_gradients``, ``save``/``load``) into engine and checkpoint calls, exactly as the Trainer's
``lightning_shard.ShardStrategy`` translates the Trainer's hooks; both take the same arguments
(``lightning_shard.common.options``).
"""
# Annotations are evaluated (no ``from __future__ import annotations``): jsonargparse, and so LightningCLI, reads
# the arguments' types as objects from ``inspect.signature(ShardStrategy)``.

import atexit
import os
import sys
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NoReturn

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.optim.lr_scheduler import _LRScheduler
from typing_extensions import override

from lightning_shard.checkpoint.io.storage import location
from lightning_shard.checkpoint.save.background import BackgroundSaver, refuse_full_layout_in_background
from lightning_shard.checkpoint.state_dicts import model_state_dict, optimizer_state_dict
from lightning_shard.common.options import declare_shard_arguments
from lightning_shard.common.precision import translate_precision
from lightning_shard.common.preemption import PreemptionWatcher, preemption_signals
from lightning_shard.common.registry import register_shard_strategies
from lightning_shard.common.setup import accumulating, setup_sharded_module
from lightning_shard.common.strategy_base import ShardStrategyMixin, refuse_local_storage_options, refuse_unpickling
from lightning_shard.engine.clipping import clip_grads_with_norm_, global_grad_norm
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.sharded_module import ShardedModule, sharded_module_of
from lightning_shard.engine.whole_tensor_step import prepare_optimizer
from lightning_shard.engine.wrapping import wrap_marks_units
from lightning_shard.fabric.checkpoint import (
    fabric_model_selection,
    load_fabric_state,
    load_raw_into,
    optimizer_alone_error,
    save_fabric_state,
)
from lightning_shard.fabric.precision import ShardPrecision


@declare_shard_arguments
class ShardStrategy(ShardStrategyMixin, ParallelStrategy, _Sharded):
    """Fully sharded data parallel training (ZeRO-3) for Lightning Fabric: gloo on CPU, NCCL on GPU.

    Takes the sharding arguments of the Trainer's ``lightning_shard.ShardStrategy`` (below, after two of its own),
    with the same defaults and the same forms (PyTorch FSDP's ``ShardingStrategy``, ``CPUOffload``,
    ``MixedPrecision`` and wrap policies included).

    ``context_parallel_size > 1``: each call of the set-up module splits its arguments' sequences and is one step
    (see docs/context_parallel.md); a loss computed from its output outside the call is this rank's part of the
    sequence's. ``pipeline_parallel_size > 1``: each call of the set-up module runs the schedule and returns the
    whole output on every rank; ``fabric.backward`` of a loss computed from it runs the stages' backward (see
    docs/pipeline_parallel.md).

    Set up the model with ``fabric.setup_module(model)`` and create the optimizer from the returned model's
    parameters (this rank's shards) before ``fabric.setup_optimizers(optimizer)``; ``fabric.setup(model,
    optimizer)`` also works while the optimizer has no state yet (its parameters are swapped for the shards).

    Args:
        async_save: ``True`` writes ``fabric.save`` checkpoints in the background (Fabric's counterpart of the
            Trainer's ``AsyncCheckpointIO`` plugin): ``fabric.save`` returns once each rank has copied its rows
            aside (at most this rank's shard of the model and optimizer state, in CPU memory), the directory
            appears atomically once every rank has written its file, and at most one save is in flight. The next
            ``fabric.save`` or ``fabric.load``, ``strategy.wait_for_save()``, teardown and the end of the process
            wait for it; a failure of the background write is raised there on every rank (at the end of the
            process: printed, exit status 1). Default ``False``.
        parallelize_fn: ``parallelize_fn(module, device_mesh)`` (the function Fabric's ``ModelParallelStrategy``
            takes, without its ``fully_shard`` calls) applies the tensor-parallel plan in ``setup_module`` on
            ``strategy.device_mesh``, the ``("data_parallel", "tensor_parallel")`` mesh, before the strategy shards
            the model (see docs/tensor_parallel.md). Default ``None``: no plan.
    """

    def __init__(  # Lightning's arguments, annotated as Lightning's ParallelStrategy annotates them
        self, accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
        precision=None, *, async_save: bool = False,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None, **arguments: Any,
    ) -> None:
        if checkpoint_io is not None:
            _refuse_checkpoint_io(checkpoint_io)
        super().__init__(accelerator, parallel_devices, cluster_environment, precision=precision)
        self._take_arguments(arguments)
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}.")
        if async_save:
            refuse_full_layout_in_background(self.options.state_dict_type, "async_save=True", "async_save=False")
        self._parallelize_fn = parallelize_fn
        self._async_save = async_save
        self._num_nodes = 1
        self._backward_sync_control = _ShardBackwardSyncControl(self)
        self._engines: list[ShardedModule] = []  # one per module set up, in order
        self._preemption: PreemptionWatcher | None = None  # watching from the first preemption_requested() on

    # Properties #

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property  # type: ignore[override]
    @override
    def precision(self) -> ShardPrecision:
        plugin = self._precision
        if not isinstance(plugin, ShardPrecision):
            plugin = self._precision = ShardPrecision("32-true")
        return plugin

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        self._precision = _as_shard_precision(precision)

    @property  # type: ignore[override]
    @override
    def checkpoint_io(self) -> NoReturn:
        raise NotImplementedError(  # FSDPStrategy's words first, for code and log searches written for it
            "The `ShardStrategy` does not use the `CheckpointIO` plugin interface: it writes checkpoints itself"
            " (safetensors and JSON from every rank; fabric.save)."
        )

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        _refuse_checkpoint_io(io)

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        """The dtypes in effect: ``mixed_precision`` if given, else what the precision plugin implies."""
        return self.options.mixed_precision or self.precision.mixed_precision_config

    # Environment #

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._check_parallel_sizes()
        self.set_world_ranks()
        self._start_mesh()
        if self._async_save:
            _wait_at_exit(self._saver)

    # Model and optimizers #

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True``: build on the meta device; ``setup_module`` materialises and initialises the model one
        unit at a time (``reset_parameters()``), so no rank ever holds it in full. Inside, PyTorch's ``wrap(module)``
        marks ``module`` as a unit, as in ``module_sharded_context``."""
        return _init_context(empty_init, self.precision.module_init_context(), self.module_sharded_context())

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        """Inside, PyTorch's ``wrap(module)`` marks ``module`` as a unit (it stays the same object; see [Note: manual
        units]). Nothing is sharded here: ``setup_module`` shards, one unit at a time."""
        return wrap_marks_units()

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: _LRScheduler | None = None
    ) -> tuple[nn.Module, list[Optimizer], _LRScheduler | None]:
        """Shard ``module`` and point each optimizer at the shards of the parameters it was built with. Refused for
        an optimizer that already has state (it was stepped on the full parameters)."""
        stepped = [i for i, opt in enumerate(optimizers) if opt.state]
        if stepped:
            raise ValueError(
                f"The optimizer(s) at position {stepped} already hold state for the unsharded parameters, which"
                " ShardStrategy cannot split. Set up in this order: fabric.setup_module(model), then create the"
                " optimizer from the returned model's parameters, then fabric.setup_optimizers(optimizer)."
            )
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        shards = {fqn: p.sharded for p in _engine_of(module).sharded_params() for fqn in p.fqns}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                unknown = [i for i, p in enumerate(group["params"]) if id(p) not in names]
                if unknown:
                    raise ValueError(
                        "An optimizer passed to fabric.setup() holds tensors that are not parameters of the model"
                        f" (positions {unknown} of a parameter group); build it from model.parameters()."
                    )
                group["params"] = [shards[names[id(p)]] for p in group["params"]]
        if scheduler is not None:
            rank_zero_warn("The learning-rate scheduler keeps references to the optimizer only; nothing to convert.")
        return module, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place (it stays the same object): its parameters become this rank's shards. With a
        ``parallelize_fn``, its tensor-parallel plan is applied first."""
        self.precision.set_device(self.root_device.type)
        if self._parallelize_fn is not None and sharded_module_of(module) is None:
            module = self._parallelize_fn(module, self.device_mesh)
        engine = setup_sharded_module(module, self.options, self.mesh, self.root_device, self.mixed_precision_config)
        if all(engine is not e for e in self._engines):
            self._engines.append(engine)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that ``optimizer`` holds shards of a set-up module (it was created after ``setup_module``) and that
        it can update them exactly: an optimizer whose update reads whole tensors (Muon, Adafactor) runs each tensor
        whole on one rank; one that cannot run exactly, or that nobody declared, is refused here."""
        shards = {id(p.sharded) for engine in self._engines for p in engine.sharded_params()}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in shards)
        if foreign:
            raise ValueError(
                f"The optimizer holds {foreign} tensor(s) that are not shards of a model set up with ShardStrategy."
                " Create the optimizer after fabric.setup_module(model), from the returned model's parameters."
            )
        prepare_optimizer(optimizer, self._engines)  # see [Note: what an optimizer may see of a sharded parameter]
        return optimizer

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Deliberately nothing: the engine places each shard on the device as it creates it."""

    # Backward, clipping #

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip the optimizer's gradients by their global norm over all shards; return that norm (the same on every
        rank). With ``error_if_nonfinite`` a non-finite norm raises on every rank before any gradient changes. A module
        not set up with ``fabric.setup_module`` under this strategy is refused with ``TypeError``."""
        if not isinstance(module, nn.Module) or sharded_module_of(module) is None:  # the norm is over its shards
            raise TypeError(
                "Clipping gradients by norm is only possible if the module passed to"
                " `ShardStrategy.clip_gradients_norm` is set up with fabric.setup_module() under ShardStrategy, as"
                f" under FSDPStrategy it is wrapped in `FullyShardedDataParallel`. Got: {type(module).__name__}."
            )
        self.precision.unscale_gradients(optimizer)
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        norm = global_grad_norm(shards, self.mesh, self.root_device, float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):  # the same norm on every rank: all of them raise
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} of the gradients is non-finite ({norm.item()}), so it"
                " cannot be clipped. Pass error_if_nonfinite=False to fabric.clip_gradients to clip anyway."
            )
        clip_grads_with_norm_(shards, float(max_norm), norm)
        return norm

    # State dicts (see [Note: state dicts of a sharded model]) #

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The state dict of a module set up with ``fabric.setup_module`` (or the module it returned), under the
        unsharded module's names, as ``state_dict_type`` says: ``"full"``: on global rank 0 every tensor in full on
        the CPU (gathered one at a time), ``{}`` on the other ranks; ``"sharded"``: this rank's rows of every
        parameter as ``DTensor`` views (no copy), buffers as plain tensors. Collective: every rank must call it.
        ``fabric.save`` does not use it: it writes the checkpoint directory from the shards."""
        from lightning.fabric.wrappers import _unwrap_objects

        return model_state_dict(_unwrap_objects(module), self.options.state_dict_type)

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The state of an optimizer built on a set-up module's shards, keyed by parameter name (``{"state": {name:
        {...}}, "param_groups": [{..., "params": [name, ...]}]}``), in the layout ``get_module_state_dict`` gives.
        Collective."""
        from lightning.fabric.wrappers import _unwrap_objects

        optimizer = _unwrap_objects(optimizer)
        first = next((q for group in optimizer.param_groups for q in group["params"]), None)
        holders = [e for e in self._engines if any(p.sharded is first for p in e.sharded_params())]
        if not holders:
            raise ValueError(
                "get_optimizer_state() needs an optimizer built on the shards of a module set up with"
                " fabric.setup_module() under ShardStrategy; this one holds none."
            )
        return optimizer_state_dict(holders[0].root, optimizer, self.options.state_dict_type)

    # Checkpoints: directories of safetensors and JSON (see [Note: Fabric state in a checkpoint directory]) #

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Write ``state`` as a checkpoint directory at ``path`` (every rank writes its rows). Collective.

        ``filter`` maps state keys to a predicate ``(key, value) -> bool``, as Fabric's: for the module, which of
        its state-dict entries are saved (values are this rank's views; decide from the key), the optimizer state
        following the parameters kept; for a dict value, which of its items. With ``save_trainable_only=True`` the
        module's frozen parameters are left out as well. A checkpoint that leaves weights out records their
        fingerprints and is checked on load (see [Note: weights a checkpoint leaves out])."""
        refuse_local_storage_options(path, storage_options)
        selection = fabric_model_selection(state, filter, self.options.saved_parameters)
        url = self.broadcast(os.fspath(path))
        target = location(url, storage_options or self._url_options(url))
        if self._async_save:
            # see [Note: background saves]
            save_fabric_state(target, state, self.options.state_dict_type, self._saver, selection, filter)
        else:
            self._saver.wait()
            save_fabric_state(target, state, self.options.state_dict_type, None, selection, filter)

    def wait_for_save(self) -> None:
        """Block until the background save in flight (``async_save=True``) has finished writing its directory; raise
        its failure on every rank. Returns at once when none is in flight."""
        self._saver.wait()

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Fill ``state`` in place from a checkpoint directory (any world size, Fabric or Trainer written), a
        Lightning ``.ckpt`` or a DCP directory of another strategy; a module alone (``fabric.load_raw``) also takes a
        plain ``.safetensors`` file. Returns what ``state`` did not ask for. Collective. Never runs a pickle
        (``weights_only=False`` is refused)."""
        refuse_unpickling(weights_only)
        self._saver.wait()  # a background save of this very path must have finished
        url = self.broadcast(os.fspath(path))
        directory = location(url, self._url_options(url))
        if isinstance(state, nn.Module):
            load_raw_into(directory, state, strict)
            return {}
        if isinstance(state, Optimizer):
            raise optimizer_alone_error()
        if not state:
            raise ValueError(
                f"Got ShardStrategy.load_checkpoint(..., state={state!r}) but a state with at least a model instance to"
                " reload is required. ShardStrategy loads a checkpoint into live objects: pass the state with the"
                " set-up model, e.g. fabric.load(path, {'model': model, 'optimizer': optimizer})."
            )
        return load_fabric_state(directory, state, strict)

    # Preemption (see [Note: preemption at a step boundary]) #

    def preemption_requested(self) -> bool:
        """Whether any rank received a preemption signal (SIGTERM; with ``SLURMEnvironment(auto_requeue=True)`` also
        its requeue signal): the same answer on every rank. Collective: call it on every rank at the same step
        boundary, e.g. after ``optimizer.step()``; when it says ``True``, save with ``fabric.save`` and call
        ``exit_for_preemption()``. From the first call on, those signals are recorded instead of ending the process.
        """
        if self._preemption is None:
            self._preemption = PreemptionWatcher(*preemption_signals(self.cluster_environment))
            self._preemption.install()
        return self._preemption.agree(self.root_device)

    def exit_for_preemption(self) -> NoReturn:
        """End the process after a preemption the ranks agreed on, with ``128 + signal number`` (143 for SIGTERM);
        after SLURM's requeue signal with ``SLURMEnvironment(auto_requeue=True)``, global rank 0 first requeues the
        job. Call it on every rank once ``fabric.save`` wrote the checkpoint."""
        if self._preemption is None or self._preemption.agreed_signal is None:
            raise RuntimeError("No preemption was agreed on: exit_for_preemption() follows preemption_requested().")
        self._preemption.requeue_if_asked(self.global_rank)
        raise SystemExit(self._preemption.exit_code)

    # Teardown #

    @override
    def teardown(self) -> None:
        self._saver.close()
        if self._preemption is not None:
            self._preemption.restore()
        for engine in self._engines:
            engine.reshard_all()
        if self._mesh is not None:
            self._mesh.destroy()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision.teardown()
        self.accelerator.teardown()  # no CheckpointIO plugin to tear down: the strategy has none

    # Registry #

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_shard_strategies(strategy_registry, cls)


class _ShardBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: with ``grad_sync="step"`` the micro-batch's gradients stay unreduced on
    the unsharded weights until a backward outside the context; with ``"microbatch"`` they are reduced at once."""

    def __init__(self, strategy: ShardStrategy) -> None:
        self._strategy = strategy

    @override
    @contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Generator[None, None, None]:
        engine = sharded_module_of(module) if isinstance(module, nn.Module) else None
        if engine is None:
            raise TypeError(
                "Blocking backward sync is only possible if the module passed to `ShardStrategy.no_backward_sync` is"
                " set up with fabric.setup_module() under ShardStrategy, as under FSDPStrategy it is wrapped in"
                f" `FullyShardedDataParallel`. Got: {type(module).__name__}, which is not sharded."
            )
        if not enabled:
            yield
            return
        with accumulating(engine, self._strategy.options.grad_sync):
            yield


def _refuse_checkpoint_io(io: CheckpointIO) -> NoReturn:
    raise NotImplementedError(  # FSDPStrategy's words first, for code and log searches written for it
        f"The `ShardStrategy` does not support setting a `CheckpointIO` plugin: it writes checkpoints itself"
        f" (safetensors and JSON from every rank), so the plugin {type(io).__name__} would not be used. Remove it"
        " from Fabric's plugins (and from the strategy's arguments)."
    )


def _init_context(
    empty_init: bool | None, precision_context: AbstractContextManager, sharded_context: AbstractContextManager
) -> AbstractContextManager:
    @contextmanager
    def context() -> Generator[None, None, None]:
        with torch.device("meta") if empty_init else nullcontext(), precision_context, sharded_context:
            yield

    return context()


def _wait_at_exit(saver: BackgroundSaver) -> None:
    """Finish ``saver``'s last background save when the process ends. Registered once the process group exists,
    after the group's own exit handler, so it runs before the group is destroyed (exit handlers run in reverse)."""

    def finish() -> None:
        try:
            saver.wait()
        except BaseException as err:  # noqa: BLE001 - nowhere left to raise it: report it and fail the process
            print(f"lightning_shard: the last background checkpoint save failed: {err}", file=sys.stderr, flush=True)
            os._exit(1)
        saver.close()

    atexit.register(finish)


def _engine_of(module: nn.Module) -> ShardedModule:
    engine = sharded_module_of(module)
    if engine is None:
        raise TypeError(f"{type(module).__name__} was not set up with fabric.setup_module() under ShardStrategy.")
    return engine


def _as_shard_precision(plugin: Precision | None) -> ShardPrecision | None:
    """Accept a ShardPrecision, or translate the plugin Fabric picked from ``Fabric(precision=...)``."""
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision

    choices = "Pass one of the Fabric precisions '32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true'."
    return translate_precision(plugin, ShardPrecision, MixedPrecision, HalfPrecision, Precision, choices)
