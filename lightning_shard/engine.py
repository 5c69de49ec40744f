"""Apply sharding to a module tree: pick the units, give every parameter to exactly one of them,
initialise the shards, and own the per-iteration state that spans units.

[Note: which unit owns a parameter]
A parameter belongs to the innermost unit whose subtree holds it. A parameter held in two
subtrees (tied weights: an embedding and the LM head; a module shared by two blocks) belongs to
the lowest unit that contains both: it is stored once, gathered whenever that unit is, and its
gradient from every use accumulates on one unsharded face before the single reduction. That
unit's forward encloses every use, so the weight is gathered wherever it is needed.

[Note: the root unit]
The root is the module given to ``shard_module`` (under the strategy, the LightningModule). It is
gathered before the step runs and, while training, stays gathered until the end of backward, as
backward starts with it. Its gradients are reduced in a callback queued on the autograd engine at
the first pre-backward hook, which also reduces any unit whose inputs needed no gradient (e.g. the
first block after a frozen embedding). Modules that hold root parameters also gather the root on
their own if they are called outside the root's forward.

[Note: prefetching and overlapped reductions]
The engine records the order in which units run their forward (re-recorded every step, so a
change of order is picked up at the next one). When a unit starts its forward it issues the next
unit's all-gather asynchronously, so the collective runs while this unit computes; when a unit
starts its backward it does the same for the unit whose backward comes next (the previous one in
forward order). At most two units are gathered or gathering at once. A unit's gradient reduction
is issued asynchronously when its backward ends and completed when the next one is issued (and
all of them at the end of backward), so it overlaps the next unit's backward. Every rank issues
the same collectives in the same order, since the recorded order is the same on every rank.

[Note: the last unit of forward stays gathered]
Under FULL_SHARD the unit that ran last in forward is the first one backward needs. Its reshard is
deferred until another unit starts its forward, so when forward ends it is still gathered and
backward uses it without a second all-gather. At most one unit beyond the running one is gathered.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_shard import collectives
from lightning_shard.mesh import ShardMesh
from lightning_shard.mixed_precision import MixedPrecision, parse_dtype
from lightning_shard.param_shard import ShardedParam
from lightning_shard.policies import ShardingStrategy, WrapPolicy, select_unit_modules
from lightning_shard.unit import BackwardState, ShardUnit, UnitState

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
        self.buffer_sync = BufferSync(root, mesh.world_size)  # see [Note: buffers follow DDP]
        for unit in units:
            unit.on_first_pre_backward = self._queue_end_of_backward
            unit.on_pre_forward = self._reshard_deferred
            unit.on_reshard_after_forward = self._defer_reshard
            unit.on_forward_started = self._prefetch_next_forward
            unit.on_pre_backward = self._prefetch_next_backward
            unit.on_reduce_started = self._overlap_reduction
        setattr(root, _ENGINE_ATTR, self)

    @property
    def root_unit(self) -> ShardUnit:
        return self.units[0]

    def sharded_params(self) -> Iterator[ShardedParam]:
        for unit in self.units:
            yield from unit.params

    # Runtime #

    def _defer_reshard(self, unit: ShardUnit) -> None:
        self._reshard_deferred(unit)
        self._deferred_reshard = unit

    def _reshard_deferred(self, starting: ShardUnit) -> None:
        deferred = self._deferred_reshard
        if deferred is not None and deferred is not starting:
            self._deferred_reshard = None
            deferred.reshard()

    def start_forward_pass(self) -> None:
        """Called when the root's forward starts: the order recorded last time becomes the prefetch order."""
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

    def _overlap_reduction(self, pending: collectives.Pending | None) -> None:
        self._finish_reduction()
        self._pending_reduction = pending

    def _finish_reduction(self) -> None:
        pending, self._pending_reduction = self._pending_reduction, None
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
        if (mesh.replicas, mesh.shard_size, mesh.rank) != (self.mesh.replicas, self.mesh.shard_size, self.mesh.rank):
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


def shard_module(
    root: nn.Module,
    mesh: ShardMesh,
    strategy: ShardingStrategy,
    policy: WrapPolicy | None,
    device: torch.device,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: bool = False,
) -> ShardedModule:
    """Shard ``root`` in place: afterwards its parameters are this rank's shards and forward gathers them.

    With ``cpu_offload`` the shards (and so gradients and optimizer state) live in CPU memory while the model
    computes on ``device`` (see [Note: CPU offload] in ``unit.py``).
    """
    existing = getattr(root, _ENGINE_ATTR, None)
    if existing is not None:  # sharded before (an earlier stage or Trainer): keep the shards, use the new groups
        existing.rebind_mesh(mesh)
        return existing
    plan = plan_units(root, policy)
    unit_modules = [(name, module) for name, module, _ in plan]
    assignment: dict[int, list[ShardedParam]] = {id(m): [] for _, m in unit_modules}
    meta_modules: dict[int, list[nn.Module]] = {id(m): [] for _, m in unit_modules}
    full: dict[int, Tensor] = {}
    for unit_id, use, param in ((id(module), use, param) for _, module, owned in plan for use, param in owned):
        sp = ShardedParam(
            fqns=use.fqns,
            owners=use.owners,
            global_shape=param.shape,
            dtype=param.dtype,
            requires_grad=param.requires_grad,
            shard_size=mesh.shard_size,
            shard_rank=mesh.shard_rank,
        )
        if mixed_precision is not None:
            compute = mixed_precision.compute_dtype(m for m, _ in use.owners)
            sp.compute_dtype = compute if compute != param.dtype else None
        assignment[unit_id].append(sp)
        full[id(sp)] = param
    for unit_id, sps in assignment.items():
        for sp in sps:
            for m, _ in sp.owners:
                if full[id(sp)].is_meta and all(m is not x for x in meta_modules[unit_id]):
                    meta_modules[unit_id].append(m)
    _check_meta_modules_resettable(root, meta_modules)

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
        if any(full[id(sp)].is_meta for sp in sps):
            unit.init_from_reset_parameters(meta_modules[id(module)], full, device)
        else:
            unit.init_from_full(full)
        units.append(unit)
    full.clear()
    _materialize_and_sync_buffers(root, device, parse_dtype(mixed_precision.buffer_dtype) if mixed_precision else None)
    engine = ShardedModule(root, units, mesh, strategy)
    _register_hooks(engine, mixed_precision)
    return engine


def plan_units(
    root: nn.Module, policy: WrapPolicy | None
) -> list[tuple[str, nn.Module, list[tuple[_ParamUse, nn.Parameter]]]]:
    """The units in module order (root first), each with the parameters it owns.

    See [Note: which unit owns a parameter].
    """
    unit_modules = [("", root), *select_unit_modules(root, policy)]
    unit_ids = {id(m) for _, m in unit_modules}
    uses, params_by_id = _collect_parameters(root, unit_ids)
    parent_unit = _unit_parents(root, unit_ids)
    owned: dict[int, list[tuple[_ParamUse, nn.Parameter]]] = {id(m): [] for _, m in unit_modules}
    for pid, use in uses.items():
        owned[_lowest_common_unit(sorted(use.unit_ids), parent_unit)].append((use, params_by_id[pid]))
    return [(name, module, owned[id(module)]) for name, module in unit_modules]


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _collect_parameters(root: nn.Module, unit_ids: set[int]) -> tuple[dict[int, _ParamUse], dict[int, nn.Parameter]]:
    """For every parameter: the units whose subtrees hold it and each (module, attribute, name) holding it.

    Walks without de-duplication, so a module or parameter reachable by two paths is seen in both
    units' subtrees (see [Note: which unit owns a parameter]).
    """
    uses: dict[int, _ParamUse] = {}
    params: dict[int, nn.Parameter] = {}
    # An explicit stack, not a recursive closure: a closure that refers to itself is a reference cycle, which
    # would keep ``params`` (every original full-size parameter) alive until Python's cycle collector runs.
    stack: list[tuple[nn.Module, str, int, tuple[int, ...]]] = [(root, "", id(root), (id(root),))]
    while stack:
        module, prefix, unit_id, path = stack.pop()
        if id(module) in unit_ids:
            unit_id = id(module)
        for name, p in module._parameters.items():
            if p is None:
                continue
            params[id(p)] = p
            use = uses.setdefault(id(p), _ParamUse())
            use.unit_ids.add(unit_id)
            if prefix + name not in use.fqns:
                use.fqns.append(prefix + name)
            if not any(m is module and n == name for m, n in use.owners):
                use.owners.append((module, name))
        children = [(n, c) for n, c in module._modules.items() if c is not None and id(c) not in path]
        for child_name, child in reversed(children):  # popped in registration order, as a recursive walk would
            stack.append((child, f"{prefix}{child_name}.", unit_id, (*path, id(child))))
    return uses, params


@dataclass
class _ParamUse:
    fqns: list[str] = field(default_factory=list)
    unit_ids: set[int] = field(default_factory=set)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


def _unit_parents(root: nn.Module, unit_ids: set[int]) -> dict[int, int | None]:
    """Parent unit of each unit (by module id); the root's is None."""
    parents: dict[int, int | None] = {id(root): None}

    def visit(module: nn.Module, enclosing: int) -> None:
        for child in module.children():
            if id(child) in unit_ids and id(child) not in parents:
                parents[id(child)] = enclosing
                visit(child, id(child))
            else:
                visit(child, enclosing)

    visit(root, id(root))
    return parents


def _lowest_common_unit(unit_ids: list[int], parents: dict[int, int | None]) -> int:
    def chain(u: int) -> list[int]:
        out = [u]
        while (p := parents.get(out[-1])) is not None:
            out.append(p)
        return out

    common = chain(unit_ids[0])
    for u in unit_ids[1:]:
        ancestors = set(chain(u))
        common = [c for c in common if c in ancestors]
    return common[0]


def _check_meta_modules_resettable(root: nn.Module, meta_modules: dict[int, list[nn.Module]]) -> None:
    names = {id(m): n or "<root>" for n, m in root.named_modules()}
    missing = [
        f"{names.get(id(m), '?')} ({type(m).__name__})"
        for mods in meta_modules.values()
        for m in mods
        if not callable(getattr(m, "reset_parameters", None))
    ]
    if missing:
        raise TypeError(
            "These modules have parameters on the meta device but no reset_parameters() method: "
            + ", ".join(missing)
            + ". ShardStrategy materialises a meta-device model one unit at a time and initialises it by calling"
            " reset_parameters() on each module that owns parameters: define it on these modules."
        )


def _materialize_and_sync_buffers(root: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Move buffers to ``device`` (floating ones to ``dtype``), and make every rank hold rank 0's values.

    A buffer registered in several modules (the same tensor) stays one tensor: it is moved once and every module
    gets the moved tensor.
    """
    moved: dict[int, Tensor] = {}  # id of the original buffer -> the tensor every module holding it gets
    for module in root.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if id(buf) in moved:
                module._buffers[name] = moved[id(buf)]
                continue
            if buf.is_meta:
                raise TypeError(
                    f"Buffer {name!r} of {type(module).__name__} is still on the meta device after"
                    f" reset_parameters(); initialise it there, or create it on a real device."
                )
            target = dtype if dtype is not None and buf.is_floating_point() else buf.dtype
            new = buf.to(device=device, dtype=target) if buf.device != device or buf.dtype != target else buf
            moved[id(buf)] = module._buffers[name] = new
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        _broadcast_from_rank0_coalesced(_unique_buffers(root.modules()))


class BufferSync:
    """When the model's buffers are overwritten with global rank 0's during training, as DDP does.

    [Note: buffers follow DDP]
    Buffers are not sharded: every rank holds all of them. DDP (``broadcast_buffers``, since torch
    2.13 ``forward_sync_buffers``, on by default) broadcasts rank 0's buffers at the start of its first
    forward and of every forward that follows one run with gradients enabled outside ``no_sync()``,
    whether or not the new one has gradients. So during training each rank's BatchNorm statistics are
    rank 0's from the step before, updated with this rank's own batch; the first validation forward
    after a training step broadcasts, so every rank validates with rank 0's statistics; the forward
    after an evaluation forward, or after a micro-batch whose gradients are not synchronised,
    broadcasts nothing. Checkpoints hold rank 0's buffers, which every rank loads. The engine makes
    the same decision at every outermost forward of the root: one broadcast per device of all buffers'
    bytes packed together (float statistics and the int64 ``num_batches_tracked`` alike, a buffer held
    by several modules once), and nothing when the model has no buffers or runs on one rank.
    ``accumulating`` stands for ``no_sync()``: the front end sets it for micro-batches that do not end
    an accumulation window, whether or not it holds their gradients back. Set-up broadcasts too, as
    DDP's does (``shard_module``, or the strategy when it is given a model sharded before).
    """

    def __init__(self, root: nn.Module, world_size: int) -> None:
        self.enabled = True  # ShardStrategy(broadcast_buffers=...)
        self.accumulating = False  # inside a micro-batch that does not end an accumulation window
        self._due = True  # whether the next outermost root forward starts with a broadcast
        self._world_size = world_size
        self._owners = [m for m in root.modules() if any(b is not None for b in m._buffers.values())]

    def before_root_forward(self) -> None:
        """Called as the outermost root forward starts: broadcast if due; decide whether the next one is due."""
        due, self._due = self._due, torch.is_grad_enabled() and not self.accumulating
        if due and self.enabled:
            self.broadcast()

    def broadcast(self) -> None:
        """Overwrite every buffer with global rank 0's (collective; nothing with one rank or no buffers)."""
        if self._owners and self._world_size > 1:
            _broadcast_from_rank0_coalesced(_unique_buffers(self._owners))


def _unique_buffers(modules: Iterable[nn.Module]) -> list[Tensor]:
    """The buffers of ``modules`` (their own, not their children's), each tensor once."""
    seen: dict[int, Tensor] = {}
    for module in modules:
        for buf in module._buffers.values():
            if buf is not None:
                seen.setdefault(id(buf), buf)
    return list(seen.values())


def _broadcast_from_rank0_coalesced(buffers: list[Tensor]) -> None:
    """Overwrite ``buffers`` on every rank with global rank 0's values: one broadcast per device, of every buffer's
    bytes packed into one flat ``uint8`` tensor, whatever their dtypes."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for buf in buffers:
        by_device.setdefault(buf.device, []).append(buf)
    is_source = torch.distributed.get_rank() == 0
    with torch.no_grad():
        for device, bufs in by_device.items():
            if is_source:
                flat = torch.cat([buf.reshape(-1).view(torch.uint8) for buf in bufs])
            else:
                flat = torch.empty(sum(buf.nbytes for buf in bufs), dtype=torch.uint8, device=device)
            collectives.broadcast_from_rank0(flat)
            if is_source:
                continue
            # As DDP does: a graph that saved a buffer for backward (BatchNorm in eval mode) before the
            # broadcast does not fail its version check in backward.
            with torch.autograd._unsafe_preserve_version_counter(tuple(bufs)):
                for buf, piece in zip(bufs, flat.split([buf.nbytes for buf in bufs])):
                    if buf.is_contiguous():
                        buf.view(-1).view(torch.uint8).copy_(piece)
                    else:  # a strided view: reinterpret an aligned copy of its bytes
                        buf.copy_(piece.clone().view(buf.dtype).view(buf.shape))


def _register_hooks(engine: ShardedModule, mixed_precision: MixedPrecision | None) -> None:
    root_unit = engine.root_unit
    for unit in engine.units:
        if unit is root_unit:
            unit.module.register_forward_pre_hook(
                _root_pre_forward(engine, mixed_precision), with_kwargs=True, prepend=True
            )
        else:
            unit.module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
        unit.module.register_forward_hook(unit.post_forward, with_kwargs=True)
    root_unit.module.register_forward_hook(_root_post_forward(engine))
    output_dtype = parse_dtype(mixed_precision.output_dtype) if mixed_precision is not None else None
    if output_dtype is not None:
        root_unit.module.register_forward_hook(_cast_floating(output_dtype))
    owners = {id(m): m for p in root_unit.params for m, _ in p.owners if m is not root_unit.module}
    for module in owners.values():
        module.register_forward_pre_hook(_gather_root_if_needed(root_unit))


def _root_pre_forward(engine: ShardedModule, mixed_precision: MixedPrecision | None):  # noqa: ANN202
    root_unit = engine.root_unit
    casts_inputs = mixed_precision is not None and mixed_precision.cast_forward_inputs
    input_dtype = parse_dtype(mixed_precision.param_dtype) if mixed_precision and casts_inputs else None

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if root_unit._forward_depth == 0 and not engine._callback_queued:
            engine.discard_pending()
            engine.start_forward_pass()
        if root_unit._forward_depth == 0:
            engine.buffer_sync.before_root_forward()
        if input_dtype is not None:
            args, kwargs = _cast_tree((args, kwargs), input_dtype)
        return root_unit.pre_forward(module, args, kwargs)

    return hook


def _root_post_forward(engine: ShardedModule):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        if engine.root_unit._forward_depth == 0:  # the outermost root forward has ended
            engine.end_forward_pass()

    return hook


def _cast_tree(tree: Any, dtype: torch.dtype) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in flat], spec)


def _cast_floating(dtype: torch.dtype):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_tree(output, dtype)

    return hook


def _gather_root_if_needed(root_unit: ShardUnit):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple) -> None:
        if root_unit.is_sharded:
            root_unit.unshard()
            if torch.is_grad_enabled():
                root_unit.expect_backward()

    return hook
