"""Apply sharding to a module tree and own the per-iteration state that spans units.

[Note: parameters nothing initialises]
A model built on the meta device is materialised one unit at a time and initialised by each owning
module's ``reset_parameters()``. A module without one (transformers' ``Conv1D``, many custom layers)
cannot initialise its parameters, which is fine when pretrained weights are about to be loaded: its
shards are materialised uninitialised and recorded in ``ShardedModule.uninitialized``, and set-up warns
once (global rank 0), naming those modules and the ways out; a model built to be trained from scratch
learns of a missing ``reset_parameters()`` then rather than at its first forward. Loading
(``load_safetensors_into``, a checkpoint, ``fabric.load_raw``) removes what it fills; any forward of
a unit while something is left raises on every rank, naming each such parameter, so uninitialised
memory is never trained on. With ``param_init=ParamInit.EMPTY`` no ``reset_parameters()`` runs at all:
every meta-device parameter is recorded, and no unit is materialised in full, so importing pretrained
weights costs each rank its shards and one tensor's rows at a time. That setting says a load will fill
every parameter, so it gets no warning: the forward before the load still raises.

``shard_module`` takes the units ``planning`` chose (see [Note: which unit owns a parameter] there),
initialises their shards, syncs the buffers (``buffers``) and registers the hooks; ``ShardedModule``
is the engine of one model from then on.

[Note: the root unit]
The root is the module given to ``shard_module`` (under the strategy, the LightningModule). It is
gathered before the step runs and, while training, stays gathered until the end of backward, as
backward starts with it. Its gradients are reduced in a callback queued on the autograd engine at
the first pre-backward hook, which also reduces any unit whose inputs needed no gradient (e.g. the
first block after a frozen embedding). Modules that hold root parameters also gather the root on
their own if they are called outside the root's forward.

[Note: a module inside a unit called on its own]
A unit's weights are gathered by the unit module's forward. A module inside it that holds some of its
parameters (``model.blocks[0].mlp``, a ``Linear`` a user's method calls) may also be called on its own,
outside that forward; it would then compute with this rank's rows. Its hooks make such a call a
forward of the unit: when the unit is not gathered, the outermost such module runs the unit's own
pre- and post-forward around its call (gather, the backward hooks under grad, the reshard), as if the
unit module itself had been called. Inside the unit's forward (or a recompute in backward) the unit
is gathered and the hooks do nothing. In compiled code they do nothing either
(``torch.compiler.is_compiling()``), so a compiled block has no graph breaks at its submodules: a
compiled block's submodules are only ever called inside its forward.

[Note: Hugging Face's generate() in step]
A forward of a sharded module is a collective: every rank must run as many as the others. transformers' ``generate``
keeps the ranks in step by itself (``synced_gpus``: a rank that reached its end token goes on running forwards
until every rank has) for the modules it knows to be sharded, FSDP's and DeepSpeed ZeRO-3's, which it tells by the
attribute ``_is_fsdp_managed_module`` (FSDP2 sets it, as does transformers' own ``apply_fsdp2``). The engine sets it
on the modules it shards that have a ``generate`` method (transformers' models), so a user's own
``self.model.generate(...)`` in a ``validation_step`` works unchanged when ranks stop at different lengths, as under
DDP. Only on those: ``torch.compile`` reads the same attribute and traces such a module as FSDP's (which needs FSDP's
``use_orig_params``), so on a block compiled on its own it would stop compilation. A call on one rank alone (inside
``summon_full_params(rank0_only=True)``) must pass ``synced_gpus=False``, as it must under FSDP.

[Note: prefetching and overlapped reductions]
The engine records the order in which units run their forward (re-recorded every step, so a
change of order is picked up at the next one). When a unit starts its forward it issues the next
unit's all-gather asynchronously, so the collective runs while this unit computes; when a unit
starts its backward it does the same for the unit whose backward comes next (the previous one in
forward order). At most two units are gathered or gathering at once. A unit's gradient reduction
is issued asynchronously when its backward ends and completed as soon as the next unit's first
gradient is computed (and all of them at the end of backward), so it overlaps the start of the next
unit's backward while at most one unit's gradients pile up beside the one in flight: waiting only
when the next reduction is issued held two units' unsharded gradients at once, the peak of a large
model's step on CPU, where they are sent straight from autograd's tensors. Every rank issues
the same collectives in the same order, since the recorded order is the same on every rank.

[Note: the last unit of forward stays gathered]
Under FULL_SHARD the unit that ran last in forward is the first one backward needs. Its reshard is
deferred until another unit starts its forward, so when forward ends it is still gathered and
backward uses it without a second all-gather. At most one unit beyond the running one is gathered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from lightning_shard.engine import collectives, torch_norms
from lightning_shard.engine.buffer_pool import BufferPool
from lightning_shard.engine.buffers import (
    BufferSync,
    check_meta_buffers,
    initialize_parameterless_buffers,
    materialize_and_sync_buffers,
)
from lightning_shard.engine.compile import adopt_compiled_wrappers, outside_compiled_code
from lightning_shard.engine.cpu_allocator import apply_cpu_allocator
from lightning_shard.engine.diagnostics import warn_nothing_initialises
from lightning_shard.engine.mesh import ShardMesh
from lightning_shard.engine.mixed_precision import (
    MixedPrecision,
    cast_floating,
    cast_floating_outputs,
    cast_normalization_inputs,
    parse_dtype,
)
from lightning_shard.engine.optimizer_rule import guard_optimizer_steps
from lightning_shard.engine.option_choices import CpuAllocator, ParamInit, ShardingStrategy
from lightning_shard.engine.parallel.tensor import local_tensor, note_tensor_parallel_parts, tensor_parallel_layout
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.planning import plan_units, without_reset_parameters
from lightning_shard.engine.policies import WrapPolicy
from lightning_shard.engine.unit import BackwardState, ShardUnit, UnitState
from lightning_shard.engine.wrapping import refuse_foreign_sharding

if TYPE_CHECKING:
    from lightning_shard.engine.parallel.pipeline import PipelineStage

_ENGINE_ATTR = "_lightning_shard_engine"


class ShardedModule:
    """The sharding engine of one module tree: its units, root-level hooks and end-of-backward callback."""

    def __init__(self, root: nn.Module, units: list[ShardUnit], mesh: ShardMesh, strategy: ShardingStrategy) -> None:
        self.root = root
        self.units = units  # module order: root first
        units[0].is_root = True
        self.device = units[0].device  # where the model computes and communicates
        self.mesh = mesh
        self.sharding_strategy = strategy
        self._callback_queued = False
        self._deferred_reshard: ShardUnit | None = None  # see [Note: the last unit of forward stays gathered]
        # See [Note: prefetching and overlapped reductions].
        self._forward_order: list[ShardUnit] = []  # as recorded in the last complete forward
        self._recording: list[ShardUnit] = []
        self._position: dict[int, int] = {}
        self._pending_reduction: collectives.Pending | None = None
        self._pending_reduction_unit: ShardUnit | None = None
        self.buffer_sync = BufferSync(root, mesh.world_size, mesh.buffer_group)  # see [Note: buffers follow DDP]
        self.pool = BufferPool()  # every unit's step buffers: see [Note: the buffer pool]
        self.uninitialized: dict[str, str] = {}  # meta parameters without reset_parameters(), unloaded: fqn -> where
        self.param_init = ParamInit.RESET_PARAMETERS  # how meta-device parameters were materialised
        self.pipeline_stage: PipelineStage | None = None  # this rank's stage of the root (parallel/apply.py)
        # Checks of loaded state that wait for the next forward (e.g. weights a partial checkpoint left out).
        self._checks_before_forward: dict[str, Callable[[], None]] = {}
        for unit in units:
            unit.pool = self.pool
            unit.on_first_pre_backward = self._queue_end_of_backward
            unit.on_pre_forward = self._before_unit_forward
            unit.on_reshard_after_forward = self._defer_reshard
            unit.on_forward_started = self._prefetch_next_forward
            unit.on_pre_backward = self._prefetch_next_backward
            unit.on_resharded_in_backward = self._release_idle_block
            unit.on_reduce_started = functools.partial(self._overlap_reduction, unit)
            unit.on_gradient_computed = self._finish_other_reduction
        setattr(root, _ENGINE_ATTR, self)
        torch_norms.watch(self)  # see [Note: torch's gradient norms on sharded parameters]
        guard_optimizer_steps()  # see [Note: what an optimizer may see of a sharded parameter]
        for module in root.modules():  # see [Note: Hugging Face's generate() in step]
            if callable(getattr(module, "generate", None)):
                module._is_fsdp_managed_module = True  # type: ignore[assignment]

    @property
    def root_unit(self) -> ShardUnit:
        return self.units[0]

    def sharded_params(self) -> Iterator[ShardedParam]:
        for unit in self.units:
            yield from unit.params

    # Runtime #

    def _before_unit_forward(self, unit: ShardUnit) -> None:
        self.check_initialized()
        self._reshard_deferred(unit)

    def check_initialized(self) -> None:
        """Refuse to run a model with parameters that nothing initialised (see [Note: parameters nothing
        initialises]), the same on every rank, before any collective; then run the checks waiting for this forward
        (``check_before_next_forward``)."""
        if self.uninitialized:
            if self.param_init is ParamInit.EMPTY:
                why = "with param_init='empty' (nothing is initialised; a load is expected to fill them)"
                fix = "or use param_init='reset_parameters'"
            else:
                why = "by modules without reset_parameters()"
                fix = "or define reset_parameters() on those modules"
            raise RuntimeError(
                f"These parameters were built on the meta device {why} and have not been loaded, so they hold"
                " uninitialised memory: " + ", ".join(self.uninitialized.values()) + "."
                " Load them before the first forward (load_safetensors_into(), e.g. from on_fit_start, or"
                f" fabric.load_raw() after setup_module), {fix}."
            )
        while self._checks_before_forward:
            self._checks_before_forward.pop(next(iter(self._checks_before_forward)))()

    def check_before_next_forward(self, name: str, check: Callable[[], None] | None) -> None:
        """Run ``check`` once, on every rank, before the next forward of any unit, after the check for
        uninitialised parameters; it replaces a pending check of the same ``name`` (``None`` removes it). It may use
        collectives: every rank reaches it at the same point. Used when a checkpoint left some weights out, which
        may be restored after the load (e.g. in ``on_fit_start``)."""
        self._checks_before_forward.pop(name, None)
        if check is not None:
            self._checks_before_forward[name] = check

    def mark_initialized(self, fqns: Iterable[str]) -> None:
        """The parameters named ``fqns`` (any of a tied parameter's names) now hold loaded values."""
        loaded = set(fqns)
        for p in self.sharded_params():
            if p.fqn in self.uninitialized and loaded.intersection(p.fqns):
                del self.uninitialized[p.fqn]

    def _defer_reshard(self, unit: ShardUnit) -> None:
        self._reshard_deferred(unit)
        self._deferred_reshard = unit

    def _reshard_deferred(self, starting: ShardUnit) -> None:
        deferred = self._deferred_reshard
        if deferred is not None and deferred is not starting:
            self._deferred_reshard = None
            deferred.reshard()

    def start_forward_pass(self) -> None:
        """Called when the root's forward starts: ``requires_grad`` changes are taken over (see [Note: requires_grad
        changed after sharding]), and the order recorded last time becomes the prefetch order."""
        for unit in self.units:
            unit.follow_requires_grad()
        if self._recording:
            self._forward_order, self._recording = self._recording, []
            self._position = {id(u): i for i, u in enumerate(self._forward_order)}

    def _prefetch_next_forward(self, unit: ShardUnit) -> None:
        if len(self._recording) < 4 * len(self.units):  # bounded: forwards outside the root never end a recording
            self._recording.append(unit)
        if self.root_unit._forward_depth == 0:  # a unit called on its own: no root forward will free a prefetch
            return
        i = self._position.get(id(unit))
        if i is not None and i + 1 < len(self._forward_order) and self._forward_order[i + 1] is not unit:
            self._forward_order[i + 1].start_unshard()

    def end_forward_pass(self) -> None:
        """Called when the root's forward ends: free the prefetch of a unit that did not run (the order changed)."""
        for unit in self.units:
            if unit.state is UnitState.GATHERING:
                unit.reshard()

    def _prefetch_next_backward(self, unit: ShardUnit) -> None:
        i = self._position.get(id(unit))
        if i is not None and i > 0 and self._forward_order[i - 1] is not unit:
            previous = self._forward_order[i - 1]
            if previous.backward_state is not BackwardState.IDLE:  # it ran with grad: its backward is coming
                previous.start_unshard()

    def _release_idle_block(self, unit: ShardUnit) -> None:
        """Give the block ``unit`` just returned to the pool back to the allocator when nothing in this backward
        will take it but another unit of its size still holds one (see [Note: the buffer pool])."""
        i = self._position.get(id(unit))
        if i is None or not unit.materializes:
            return
        size = unit.flat_unsharded.numel()
        same_size = [u for u in self._forward_order[:i] if u.materializes and u.flat_unsharded.numel() == size]
        if any(u.is_sharded and u.backward_state is not BackwardState.IDLE for u in same_size):
            return  # a unit still to gather in this backward takes it
        if any(not u.is_sharded for u in same_size):
            self.pool.release_free(size, unit.device)

    def _overlap_reduction(self, unit: ShardUnit, pending: collectives.Pending | None) -> None:
        self._finish_reduction()
        self._pending_reduction, self._pending_reduction_unit = pending, unit

    def _finish_other_reduction(self, unit: ShardUnit) -> None:
        """``unit`` computed a gradient: finish the reduction in flight if it is another unit's, so that its
        gradients are freed before this unit's pile up (see [Note: prefetching and overlapped reductions])."""
        if self._pending_reduction is not None and self._pending_reduction_unit is not unit:
            self._finish_reduction()

    def _finish_reduction(self) -> None:
        pending, self._pending_reduction = self._pending_reduction, None
        self._pending_reduction_unit = None
        if pending is not None:
            pending.wait()

    def _queue_end_of_backward(self) -> None:
        if self._callback_queued:
            return
        self._callback_queued = True
        Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Reduce what no post-backward node reduced (root, units with grad-free inputs), deepest units first."""
        self._callback_queued = False
        self._deferred_reshard = None
        for unit in reversed(self.units):
            unit.post_backward()
        self._finish_reduction()

    def discard_pending(self) -> None:
        """Drop gradients of a forward that never got a backward (called before the next step starts)."""
        self._deferred_reshard = None
        for unit in self.units:
            if unit.backward_state is BackwardState.PENDING:
                for p in unit.trainable:
                    p.unsharded.grad = None
                unit.backward_state = BackwardState.IDLE
            unit.reshard()

    def rebind_mesh(self, mesh: ShardMesh) -> None:
        """Use ``mesh``'s process groups from now on (the shards stay); the layout must be the same."""
        if (mesh.replicas, mesh.shard_size, mesh.rank, mesh.tensor_parallel_size) != (
            self.mesh.replicas, self.mesh.shard_size, self.mesh.rank, self.mesh.tensor_parallel_size
        ):
            raise ValueError(
                f"This model was sharded as mesh (replicas, shard_size) ="
                f" ({self.mesh.replicas}, {self.mesh.shard_size}) on rank {self.mesh.rank};"
                f" it cannot be reused as ({mesh.replicas}, {mesh.shard_size}) on rank"
                f" {mesh.rank}. Save a checkpoint and load it into a fresh model instead."
            )
        self.mesh.shard_group, self.mesh.replicate_group = mesh.shard_group, mesh.replicate_group
        self.mesh.shard_backend = mesh.shard_backend
        self.mesh.owned_groups = mesh.owned_groups

    def hold_gradients(self, hold: bool) -> None:
        """While held, backward leaves gradients unreduced on the unsharded faces (``grad_sync="step"``)."""
        for unit in self.units:
            unit.hold_grads = hold

    def reshard_all(self) -> None:
        for unit in self.units:
            unit.reshard()

    # Full tensors #

    def gather_full(self, p: ShardedParam, local: Tensor) -> Tensor:
        """Assemble the full tensor from every rank's rows of ``local`` (shaped like ``p.sharded``), on ``local``'s
        device. Collective (communicated on the model's device)."""
        if self.mesh.shard_group is None and self.mesh.shard_size == 1:
            return local.detach().reshape(p.global_shape).clone()
        padded = torch.zeros(p.rows_per_rank, *p.row_shape, dtype=local.dtype, device=self.device)
        padded[: p.local_rows].copy_(local.detach().reshape(p.local_rows, *p.row_shape))
        out = torch.empty(self.mesh.shard_size * p.rows_per_rank, *p.row_shape, dtype=local.dtype, device=self.device)
        collectives.all_gather_flat(out.view(-1), padded.view(-1), self.mesh.shard_group)
        return out[: p.rows].reshape(p.global_shape).to(local.device)

    def gather_whole(self, p: ShardedParam, local: Tensor) -> Tensor:
        """``gather_full``, then for a tensor-parallel part the whole tensor from every rank's part. Collective."""
        full = self.gather_full(p, local)
        if p.tensor_parallel is not None and p.tensor_parallel.shard_dim is not None:
            full = p.tensor_parallel.face(full).full_tensor()
        return full


def sharded_module_of(module: nn.Module) -> ShardedModule | None:
    """The engine that sharded ``module`` (as the root), or of the module a wrapper holds as ``_forward_module``
    (Fabric's set-up module); ``None`` if it was not sharded."""
    engine = getattr(module, _ENGINE_ATTR, None)
    if engine is None and isinstance(getattr(module, "_forward_module", None), nn.Module):
        engine = getattr(module._forward_module, _ENGINE_ATTR, None)
    return engine


def shard_module(
    root: nn.Module,
    mesh: ShardMesh,
    strategy: ShardingStrategy,
    policy: WrapPolicy | None,
    device: torch.device,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: bool = False,
    param_init: ParamInit = ParamInit.RESET_PARAMETERS,
    cpu_allocator: CpuAllocator = CpuAllocator.REUSE,
) -> ShardedModule:
    """Shard ``root`` in place: afterwards its parameters are this rank's shards and forward gathers them.

    With ``cpu_offload`` the shards (and so gradients and optimizer state) live in CPU memory while the model
    computes on ``device`` (see [Note: CPU offload] in ``unit.py``). ``param_init`` says how parameters built on
    the meta device get their values (see [Note: parameters nothing initialises]). ``cpu_allocator`` says what
    sharding on CPU (or offloading to it) does to the process's C allocator (see [Note: the CPU allocator]).
    """
    if device.type == "cpu" or cpu_offload:
        apply_cpu_allocator(cpu_allocator)
    existing = getattr(root, _ENGINE_ATTR, None)
    if existing is not None:  # sharded before (an earlier stage or Trainer): keep the shards, use the new groups
        existing.rebind_mesh(mesh)
        return existing
    refuse_foreign_sharding(root)
    adopt_compiled_wrappers(root)  # see [Note: compiled blocks and the sharding hooks] in compile.py
    plan = plan_units(root, policy)  # auto_wrap_policy and manual units: see [Note: manual units] in wrapping.py
    parameterless = check_meta_buffers(root, param_init)  # see [Note: meta-device buffers] in buffers.py
    unit_modules = [(name, module) for name, module, _ in plan]
    assignment: dict[int, list[ShardedParam]] = {id(m): [] for _, m in unit_modules}
    meta_modules: dict[int, list[nn.Module]] = {id(m): [] for _, m in unit_modules}
    full: dict[int, Tensor] = {}
    for unit_id, use, param in ((id(module), use, param) for _, module, owned in plan for use, param in owned):
        # See [Note: DTensor parameters in the engine].
        tensor_parallel = tensor_parallel_layout(use.fqns[0], param, mesh.tensor_parallel_size)
        local = local_tensor(param)
        sp = ShardedParam(
            fqns=use.fqns,
            owners=use.owners,
            global_shape=local.shape,
            dtype=local.dtype,
            requires_grad=param.requires_grad,
            shard_size=mesh.shard_size,
            shard_rank=mesh.shard_rank,
            tensor_parallel=tensor_parallel,
        )
        if mixed_precision is not None:
            compute = mixed_precision.compute_dtype(m for m, _ in use.owners)
            sp.compute_dtype = compute if compute != param.dtype else None
        assignment[unit_id].append(sp)
        full[id(sp)] = local
    uninitialized: dict[str, str] = {}  # see [Note: parameters nothing initialises]
    nothing_initialises: dict[int, nn.Module] = {}  # id(module) -> module, under RESET_PARAMETERS
    names = {id(m): n or "<root>" for n, m in root.named_modules()}
    for unit_id, sps in assignment.items():
        for sp in sps:
            if not full[id(sp)].is_meta:
                continue
            if param_init is ParamInit.EMPTY or all(without_reset_parameters(m) for m, _ in sp.owners):
                owner = sp.owners[0][0]
                uninitialized[sp.fqn] = f"{sp.fqn} ({names.get(id(owner), '?')}: {type(owner).__name__})"
                if param_init is ParamInit.RESET_PARAMETERS:
                    nothing_initialises[id(owner)] = owner
            for m, _ in sp.owners:
                if not without_reset_parameters(m) and all(m is not x for x in meta_modules[unit_id]):
                    meta_modules[unit_id].append(m)
    if nothing_initialises:
        warn_nothing_initialises({names.get(i, "?"): type(m).__name__ for i, m in nothing_initialises.items()})
    initialize_parameterless_buffers(parameterless, device)

    reshard = strategy.reshards_after_forward
    units: list[ShardUnit] = []
    for name, module in unit_modules:
        sps = assignment[id(module)]
        reduce_dtype = parse_dtype(mixed_precision.reduce_dtype) if mixed_precision is not None else None
        reshard_here = reshard and module is not root
        unit = ShardUnit(
            name, module, sps, mesh, device, reshard_after_forward=reshard_here, reduce_dtype=reduce_dtype,
            shard_device=torch.device("cpu") if cpu_offload else None,
        )
        if param_init is ParamInit.EMPTY or not meta_modules[id(module)]:  # nothing here to run reset_parameters()
            unit.init_meta_empty(full)
        elif any(full[id(sp)].is_meta for sp in sps):
            unit.init_from_reset_parameters(meta_modules[id(module)], full, device)
        else:
            unit.init_from_full(full)
        units.append(unit)
    full.clear()
    if device.type == "cpu":  # see [Note: normalization inputs on CPU] in mixed_precision.py
        cast_normalization_inputs(m for sps in assignment.values() for sp in sps if sp.compute_dtype is not None
                                  for m, _ in sp.owners)
    materialize_and_sync_buffers(root, device, parse_dtype(mixed_precision.buffer_dtype) if mixed_precision else None,
                                 mesh.buffer_group)  # fmt: skip
    engine = ShardedModule(root, units, mesh, strategy)
    note_tensor_parallel_parts(mesh, [(sp.tensor_parallel, sp.sharded) for sp in engine.sharded_params()])
    engine.uninitialized = uninitialized
    engine.param_init = param_init
    _register_hooks(engine, mixed_precision)
    root.register_load_state_dict_pre_hook(_rows_of_full_tensors(engine))
    return engine


def _rows_of_full_tensors(engine: ShardedModule):  # noqa: ANN202
    """A ``load_state_dict`` pre-hook of the sharded root: a state dict of full tensors (a plain model's, a
    consolidated checkpoint's) loads as it would into the unsharded model, each rank taking its rows of every sharded
    parameter. Tensors of this rank's shard shapes (the sharded model's own ``state_dict()``) load as they are.

    [Note: load_state_dict with full tensors]
    A sharded model's parameters are this rank's rows, so torch's own ``load_state_dict`` would refuse full tensors
    with a size mismatch; users coming from DDP or FSDP1's full state dict load them this way. Before torch copies,
    each full tensor (global shape, different from the shard's) is replaced by the view of this rank's rows, and the
    units are resharded first, so that the modules hold the sharded faces that the rows are copied into. A unit
    waiting for its backward cannot be resharded: loading between a forward and its backward is refused.
    Parameters loaded this way count as initialised (see [Note: parameters nothing initialises])."""

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if engine.root_unit.state is UnitState.SUMMONED:  # the modules hold full tensors: torch loads into them
            return
        if any(unit.backward_state is BackwardState.PENDING for unit in engine.units):
            raise RuntimeError(
                "load_state_dict() was called between a forward and its backward: the weights that backward needs"
                " would change under it. Load before the forward, or after the backward and the optimizer step."
            )
        engine.reshard_all()
        loaded = []
        for p in engine.sharded_params():
            for fqn in p.fqns:
                value = state_dict.get(prefix + fqn)
                if isinstance(value, Tensor) and value.shape == p.global_shape != p.sharded.shape:
                    first, count = p.rows_held_by(p.shard_rank)
                    state_dict[prefix + fqn] = value.reshape(p.rows, *p.row_shape)[first : first + count]
                if isinstance(value, Tensor):
                    loaded.append(fqn)
        engine.mark_initialized(loaded)

    return hook


def _register_hooks(engine: ShardedModule, mixed_precision: MixedPrecision | None) -> None:
    """Every hook runs eagerly, also when the module is compiled: see [Note: compiled blocks and the sharding hooks]
    in compile.py."""
    root_unit = engine.root_unit
    for unit in engine.units:
        if unit is root_unit:
            unit.module.register_forward_pre_hook(
                outside_compiled_code(_root_pre_forward(engine, mixed_precision)), with_kwargs=True, prepend=True
            )
        else:
            unit.module.register_forward_pre_hook(outside_compiled_code(unit.pre_forward), with_kwargs=True)
        unit.module.register_forward_hook(outside_compiled_code(unit.post_forward), with_kwargs=True)
    root_unit.module.register_forward_hook(outside_compiled_code(_root_post_forward(engine)))
    output_dtype = parse_dtype(mixed_precision.output_dtype) if mixed_precision is not None else None
    if output_dtype is not None:
        root_unit.module.register_forward_hook(outside_compiled_code(cast_floating_outputs(output_dtype)))
    owners = {id(m): m for p in root_unit.params for m, _ in p.owners if m is not root_unit.module}
    gather_root, free_root = _gather_root_if_needed(engine)
    for module in owners.values():
        module.register_forward_pre_hook(outside_compiled_code(gather_root))
        module.register_forward_hook(outside_compiled_code(free_root))
    unit_modules = {id(unit.module) for unit in engine.units}
    for unit in engine.units[1:]:
        inner = {id(m): m for p in unit.params for m, _ in p.owners if id(m) not in unit_modules}
        if not inner:
            continue
        enter, leave = _unit_forward_for_inner_calls(unit)
        for module in inner.values():
            module.register_forward_pre_hook(enter, with_kwargs=True)
            module.register_forward_hook(leave, with_kwargs=True)


def _root_pre_forward(engine: ShardedModule, mixed_precision: MixedPrecision | None):  # noqa: ANN202
    root_unit = engine.root_unit
    casts_inputs = mixed_precision is not None and mixed_precision.cast_forward_inputs
    input_dtype = parse_dtype(mixed_precision.param_dtype) if mixed_precision and casts_inputs else None

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if root_unit.state is UnitState.SUMMONED:  # a plain model: see [Note: summon_full_params] in full_params.py
            return args, kwargs
        if root_unit._forward_depth == 0 and not engine._callback_queued:
            engine.discard_pending()
            engine.start_forward_pass()
        if root_unit._forward_depth == 0:
            engine.buffer_sync.before_root_forward()
        if input_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), input_dtype)
        return root_unit.pre_forward(module, args, kwargs)

    return hook


def _root_post_forward(engine: ShardedModule):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        if engine.root_unit._forward_depth == 0:  # the outermost root forward has ended
            engine.end_forward_pass()

    return hook


def _unit_forward_for_inner_calls(unit: ShardUnit):  # noqa: ANN202
    """The hooks of a module inside ``unit`` that holds some of its parameters: see [Note: a module inside a unit
    called on its own]. Traced by dynamo, they return at once in compiled code."""
    entered_by: nn.Module | None = None  # the module whose call is running as the unit's forward

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        nonlocal entered_by
        if torch.compiler.is_compiling() or unit.state is UnitState.UNSHARDED:
            return None  # inside the unit's forward (or its recompute in backward): the weights are there
        entered_by = module
        return unit.pre_forward(module, args, kwargs)

    def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        nonlocal entered_by
        if torch.compiler.is_compiling() or entered_by is not module:
            return None
        entered_by = None
        return unit.post_forward(module, args, kwargs, output)

    return enter, leave


def _gather_root_if_needed(engine: ShardedModule):  # noqa: ANN202
    """The hooks of a module that holds root-unit parameters, called outside the root's forward (a submodule or a
    method such as ``generate`` that skips ``forward``): gather the root unit before it runs. With gradients, the
    root stays gathered for the backward, which reduces and frees it. Without, it is freed again when the module
    that gathered it returns, as a unit's weights are after a forward without gradients: a later call, after an
    optimizer step or a checkpoint load, gathers the current weights instead of reusing old ones."""
    root_unit = engine.root_unit
    gathered_by: nn.Module | None = None  # the module whose call gathered the root without gradients

    def gather(module: nn.Module, args: tuple) -> None:
        nonlocal gathered_by
        if root_unit.is_sharded:
            engine.check_initialized()
            root_unit.unshard()
            if torch.is_grad_enabled():
                root_unit.expect_backward()
            else:
                gathered_by = module

    def free(module: nn.Module, args: tuple, output: Any) -> None:
        nonlocal gathered_by
        if gathered_by is module:
            gathered_by = None
            if root_unit.backward_state is BackwardState.IDLE and root_unit._forward_depth == 0:
                root_unit.reshard()

    return gather, free
