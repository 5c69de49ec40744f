"""A sharding unit: the parameters of one wrapped module, communicated together.

A unit owns two flat buffers:

- ``flat_sharded: Tensor  # 1D (S,), parameter dtype``: this rank's chunk of every parameter,
  padded, concatenated. The sharded ``nn.Parameter`` faces are views of it (the fp32 master
  weights under mixed precision).
- ``flat_unsharded: Tensor  # 1D (shard_size * B,), uint8``: every parameter in full, param-major,
  padded, each in its compute dtype (``B`` bytes per rank). Its storage is empty while the unit is
  sharded: ``unshard()`` fills it with a block of the engine's ``BufferPool`` and ``reshard()``
  gives the block back (see [Note: the buffer pool]).
- ``sharded_grads: Tensor  # 1D (G + k,), parameter dtype, on the shard device``: the memory of the
  shards' ``.grad`` (views of it), allocated at the first reduction and kept, so that a gradient
  reduction after ``zero_grad()`` lands in memory the process already has.

When nothing needs gathering or casting (one-rank shard group, compute dtype = parameter dtype,
as under ``NO_SHARD`` in fp32) the unsharded buffer is a byte view of the sharded one.

[Note: CPU offload]
With ``shard_device`` set (``cpu_offload=True`` on a GPU), ``flat_sharded`` lives in pinned CPU
memory: the sharded faces, their gradients and the optimizer state are CPU tensors and the optimizer
steps on the CPU. Only ``flat_unsharded`` lives on the GPU. Each gather first uploads this rank's
chunk (one non-blocking copy per compute-dtype run into a GPU send buffer), and each reduction
downloads this rank's reduced rows into the CPU gradients. Collectives only ever see GPU tensors.

[Note: unit states and autograd]
A unit is ``SHARDED`` or ``UNSHARDED`` (its full weights exist), and its modules hold the
matching faces. Forward runs unsharded: the pre-forward hook all-gathers (one collective, in the
compute dtype) and puts the unsharded faces on the modules; the post-forward hook frees them
again under ``FULL_SHARD``/``HYBRID_SHARD`` and puts the sharded faces back. Autograd has saved
references to the unsharded faces; the pre-backward hook (a hook on the forward's output tensors)
gathers into the same storage, so those references see the weights again, and so does an
activation-checkpointed region that recomputes its forward in backward. The copy into the storage
preserves the version counter: it restores the values autograd saved, it does not change them.
Gradients accumulate on the unsharded faces; the post-backward (a node on the forward's inputs,
or the engine's end-of-backward callback for units whose inputs need no gradient) reduce-scatters
them in one collective (in the reduce dtype) and adds this rank's rows to the sharded faces'
``.grad``, in the parameters' dtype.

[Note: requires_grad changed after sharding]
Users freeze and unfreeze parameters during training (Lightning's ``BaseFinetuning`` callbacks,
``requires_grad_()`` in a hook), on the parameters they see: the sharded faces. The unsharded faces
that forward computes with, the gradient hooks, and the reduction's layout (which parameters it
carries, at which offsets) follow the sharded faces' flags at the start of every root forward
(``follow_requires_grad``), before anything is gathered, as DDP's reducer rebuilds its buckets: a
unit whose flags changed recomputes its trainable list and gradient offsets and lets go of its
gradient memory, whose layout no longer fits (gradients still referencing it stay valid, and are
added to by the next reduction as before). Changing flags while a unit holds gradients not yet
reduced (inside a ``grad_sync="step"`` accumulation window) is refused: those gradients are laid
out for the old flags. Every rank must change the same flags, as with DDP.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten

from lightning_shard.engine import collectives
from lightning_shard.engine.autograd_nodes import ReachedByBackward, RegisterPostBackward
from lightning_shard.engine.buffer_pool import BufferPool
from lightning_shard.engine.buffers import run_initializer
from lightning_shard.engine.initial_values import values_of_rank0
from lightning_shard.engine.mesh import ShardMesh
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.progress import about_unit
from lightning_shard.engine.reduction import start_reduction


class UnitState(enum.Enum):
    """Whether a unit's full weights exist (see [Note: unit states and autograd])."""

    SHARDED = enum.auto()  # only this rank's chunk exists; modules hold the sharded faces
    GATHERING = enum.auto()  # a prefetch all-gather is in flight; modules still hold the sharded faces
    UNSHARDED = enum.auto()  # full weights gathered; modules hold the unsharded faces
    SUMMONED = enum.auto()  # inside summon_full_params: modules hold full copies in the parameters' own dtype and
    # run as plain modules (the hooks leave the unit alone); see [Note: summon_full_params] in full_params.py


class BackwardState(enum.Enum):
    """Where the gradients computed since the last reduction are."""

    IDLE = enum.auto()  # nothing to reduce
    PENDING = enum.auto()  # a forward with grad ran (or a gradient arrived): reduce when its backward ends
    HELD = enum.auto()  # kept unreduced on the unsharded faces (grad_sync="step" between optimizer steps); stays
    # HELD through later forwards, so a forward that never gets a backward cannot discard these gradients


class ShardUnit:
    """The parameters of one wrapped module: gathered together, reduced together."""

    # Initialization #

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[ShardedParam],
        mesh: ShardMesh,
        device: torch.device,
        reshard_after_forward: bool,
        reduce_dtype: torch.dtype | None = None,
        shard_device: torch.device | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        self.name = name
        self.pool = pool or BufferPool()  # the engine's, shared by its units: see [Note: the buffer pool]
        self.device = device  # where the unit computes and communicates
        self.shard_device = shard_device or device  # where its shards live: see [Note: CPU offload]
        self.module = module
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"Sharding unit {name or '<root>'!r} ({type(module).__name__}) mixes parameter dtypes"
                f" {sorted(str(d) for d in dtypes)}. A unit keeps its shards in one flat buffer of one dtype:"
                f" make the differently-typed submodules units of their own with auto_wrap_policy."
            )
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.reduce_dtype = reduce_dtype or self.dtype
        # Wider compute dtypes first, so every parameter's bytes start aligned for its dtype.
        self.params = sorted(params, key=lambda p: -p.gather_dtype.itemsize)
        self.trainable = [p for p in self.params if p.requires_grad]
        self._layout()
        pin = self.offloaded and device.type == "cuda"
        self.flat_sharded = torch.zeros(self.sharded_numel, dtype=self.dtype, device=self.shard_device, pin_memory=pin)
        if self.materializes:
            self.flat_unsharded = torch.empty(self.gather_bytes * mesh.shard_size, dtype=torch.uint8, device=device)
        else:
            self.flat_unsharded = self.flat_sharded.view(torch.uint8)
        self._hooked: set[int] = set()  # ids of the parameters whose unsharded face has the gradient hook
        for p in self.params:
            p.bind_sharded(self.flat_sharded)
            p.bind_unsharded(self.flat_unsharded)
            if p.requires_grad:
                self._hook_gradient(p)
        # Each parameter's full bytes in the unsharded buffer (views stay valid while its storage is freed).
        self._regions = [p.unsharded_region(self.flat_unsharded) for p in self.params]
        # The point-to-point gather's pieces (params with bytes to gather): where they land, and what this rank
        # sends when that is the sharded buffer itself (views stay valid: the buffers keep their storages).
        self._gathered = [p for p in self.params if p.padded_gather_bytes > 0]
        sharded_bytes = self.flat_sharded.view(torch.uint8)
        self._gather_pieces = (
            [r for r, p in zip(self._regions, self.params) if p.padded_gather_bytes > 0],
            [sharded_bytes[p.gather_offset : p.gather_offset + p.padded_gather_bytes] for p in self._gathered],
        )
        if self.materializes:  # empty until unshard() fills it from the pool
            self.flat_unsharded.untyped_storage().resize_(0)
        self.state = UnitState.UNSHARDED
        self._pending_gather: collectives.Pending | None = None
        self._gather_blocks: list[Tensor] = []  # pool blocks the gather in flight uses, given back when it lands
        self.sharded_grads: Tensor | None = None  # see the module docstring
        self._grad_views: list[Tensor] = []  # views of sharded_grads, one per trainable parameter
        self.landing_in_flight = False  # a reduction is receiving straight into sharded_grads
        self._restore_version: AbstractContextManager = nullcontext()
        self.backward_state = BackwardState.IDLE
        self.hold_grads = False  # set by the engine while gradients accumulate unreduced (grad_sync="step")
        self.is_root = False  # set by the engine: the root stays gathered from its forward to the end of backward
        self._forward_depth = 0
        self.on_first_pre_backward: Callable[[], None] = lambda: None  # set by the engine
        self.on_pre_forward: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        self.on_forward_started: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        self.on_pre_backward: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        self.on_resharded_in_backward: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        # The engine overlaps reductions with the rest of backward; alone, a unit finishes its own at once.
        self.on_reduce_started: Callable[[collectives.Pending | None], None] = _wait_now
        self.on_gradient_computed: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        self.on_reshard_after_forward: Callable[[ShardUnit], None] = ShardUnit.reshard  # the engine may defer it

    def _layout(self) -> None:
        sharded = gather = grad = 0
        for p in self.params:
            p.sharded_offset, p.gather_offset = sharded, gather
            sharded += p.padded_shard_numel
            gather += p.padded_gather_bytes
        for p in self.trainable:
            p.grad_offset = grad
            grad += p.padded_shard_numel
        self.sharded_numel = sharded  # S: this rank's padded elements
        self.gather_bytes = gather  # B: this rank's bytes in the all-gather
        self.grad_sharded_numel = grad  # this rank's padded elements in the gradient reduction
        self.casts = any(p.gather_dtype != self.dtype for p in self.params)
        # Runs of parameters sharing a compute dtype: one cast-copy each into the all-gather input.
        self._cast_runs: list[tuple[torch.dtype, int, int, int]] = []  # (dtype, sharded start, end, byte start)
        for p in self.params:
            run = self._cast_runs[-1] if self._cast_runs else None
            if run is not None and run[0] == p.gather_dtype:
                self._cast_runs[-1] = (run[0], run[1], p.sharded_offset + p.padded_shard_numel, run[3])
            else:
                end = p.sharded_offset + p.padded_shard_numel
                self._cast_runs.append((p.gather_dtype, p.sharded_offset, end, p.gather_offset))

    def _hook_gradient(self, p: ShardedParam) -> None:
        if id(p) not in self._hooked:
            p.unsharded.register_post_accumulate_grad_hook(self._on_grad_accumulated)
            self._hooked.add(id(p))

    def follow_requires_grad(self) -> None:
        """Take over ``requires_grad`` changes made on the sharded faces since the last forward (see [Note:
        requires_grad changed after sharding])."""
        changed = [p for p in self.params if p.sharded.requires_grad != p.requires_grad]
        if not changed:
            return
        if self.backward_state is not BackwardState.IDLE:
            names = ", ".join(p.fqn for p in changed)
            raise RuntimeError(
                f"requires_grad of {names} changed while unit {self.name or '<root>'!r} holds gradients that are not"
                " reduced yet (inside a grad_sync='step' accumulation window). Change requires_grad after the"
                " optimizer step that ends the window."
            )
        for p in changed:
            p.requires_grad = p.sharded.requires_grad
            p.unsharded.requires_grad_(p.requires_grad)
            if p.requires_grad:
                self._hook_gradient(p)
        self.trainable = [p for p in self.params if p.requires_grad]
        self._layout()
        self.sharded_grads, self._grad_views = None, []  # laid out for the old flags; allocated again when needed

    @property
    def gathers(self) -> bool:
        """False when the shard group is one rank: no collective is needed to have the full weights."""
        return self.mesh.shard_size > 1

    @property
    def offloaded(self) -> bool:
        """Whether the shards live on another device than the one the unit computes on (CPU offload)."""
        return self.shard_device != self.device

    @property
    def materializes(self) -> bool:
        """Whether the full weights live in their own buffer (gathered, cast to the compute dtype, or uploaded)."""
        return self.gathers or self.casts or self.offloaded

    @property
    def is_sharded(self) -> bool:
        return self.state is UnitState.SHARDED

    # Runtime #

    def unshard(self) -> None:
        """Gather the full weights into ``flat_unsharded`` and put the unsharded faces on the modules."""
        if self.state in (UnitState.UNSHARDED, UnitState.SUMMONED):
            return
        if self.state is UnitState.SHARDED:
            self.start_unshard(async_op=False)
        self._finish_unshard()

    @about_unit  # a stalled gather names this unit
    def start_unshard(self, async_op: bool = True) -> None:
        """Issue the all-gather (asynchronously: a prefetch); ``unshard()`` waits for it and copies it out."""
        if self.state is not UnitState.SHARDED:
            return  # already gathered, or a gather is in flight
        self.state = UnitState.GATHERING
        if not self.materializes or self.sharded_numel == 0:
            self._pending_gather = None
            return
        with record_function(f"lightning_shard::unshard({self.name})"):
            self.pool.fill(self.flat_unsharded.untyped_storage(), self.flat_unsharded.numel())
            # The version to restore once the gather has landed (a backend thread may write, and so bump the
            # version counter, any time before wait() returns): see [Note: unit states and autograd].
            self._restore_version = torch.autograd._unsafe_preserve_version_counter(self.flat_unsharded)
            group = self.mesh.shard_group
            if group is None:  # one-rank shard group: cast (or upload) straight into the unsharded buffer
                self._all_gather_input(into=self.flat_unsharded)
                self._pending_gather = None
                return
            send = self._all_gather_input()
            if self.casts or self.offloaded:  # staged in a pool block
                self._gather_blocks.append(send)
            path = collectives.collective_path(self.mesh.shard_backend, self.device, self.mesh.shard_size)
            if path.gathers_in_place:
                outputs, pieces = self._gather_pieces
                if self.casts or self.offloaded:  # staged in a new block: slice it
                    pieces = [send[p.gather_offset : p.gather_offset + p.padded_gather_bytes] for p in self._gathered]
                with torch.no_grad():
                    self._pending_gather = collectives.all_gather_pieces(outputs, pieces, group, async_op)
            else:
                gathered = self.pool.take(self.mesh.shard_size * self.gather_bytes, send.device)
                self._gather_blocks.append(gathered)
                self._pending_gather = collectives.all_gather_flat(gathered, send, group, async_op)

    def _finish_unshard(self) -> None:
        pending, self._pending_gather = self._pending_gather, None
        # See [Note: unit states and autograd]: restore, don't modify, what autograd saved.
        restore_version, self._restore_version = self._restore_version, nullcontext()
        with torch.no_grad(), restore_version:
            gathered = pending.wait() if pending is not None else None
            if gathered is not None:  # gathered rank-major: copy into the param-major buffer
                n = self.mesh.shard_size
                torch.split_with_sizes_copy(
                    gathered.view(n, -1),
                    [p.padded_gather_bytes for p in self.params],
                    dim=1,
                    out=[r.view(n, -1) for r in self._regions],
                )
        for block in self._gather_blocks:  # the gather has landed: its staging is free again
            self.pool.give(block)
        self._gather_blocks.clear()
        self.state = UnitState.UNSHARDED
        for p in self.params:
            p.expose_unsharded()

    def _all_gather_input(self, into: Tensor | None = None) -> Tensor:
        """This rank's chunk as bytes on the compute device: the sharded buffer itself, or a copy (cast to the
        compute dtypes, uploaded from CPU memory under offload) in ``into`` or a new buffer."""
        if not self.casts and not self.offloaded:
            return self.flat_sharded.view(torch.uint8)
        send = into if into is not None else self.pool.take(self.gather_bytes, self.device)
        if not self.casts:
            send.copy_(self.flat_sharded.view(torch.uint8), non_blocking=True)
            return send
        with torch.no_grad():
            for dtype, start, end, byte_start in self._cast_runs:
                send[byte_start : byte_start + (end - start) * dtype.itemsize].view(dtype).copy_(
                    self.flat_sharded[start:end], non_blocking=True
                )
        return send

    def reshard(self) -> None:
        """Free the full weights and put the sharded faces back on the modules."""
        if self.state in (UnitState.SHARDED, UnitState.SUMMONED):  # summon_full_params puts the shards back itself
            return
        if self.state is UnitState.GATHERING:  # a prefetch nobody used: let it land before freeing its target
            self._finish_unshard()
        for p in self.params:
            p.expose_sharded()
        if self.materializes:
            self.pool.drain(self.flat_unsharded.untyped_storage())
        self.state = UnitState.SHARDED

    @about_unit  # a stalled reduction names this unit
    def start_reduce_grads(self) -> collectives.Pending | None:
        """Issue the gradient reduction (averaging over all data-parallel ranks); ``wait()`` on the result puts this
        rank's rows into the shards' grads."""
        self.backward_state = BackwardState.IDLE
        if not self.trainable:
            return None
        with record_function(f"lightning_shard::reduce_grads({self.name})"):
            return start_reduction(self, async_op=self.mesh.replicate_group is None)

    def grad_landing(self) -> Tensor:
        """``sharded_grads``: where this rank's reduced rows go (the shards' ``.grad`` are views of it), allocated
        from the pool at the first reduction and kept from then on."""
        if self.sharded_grads is None:
            numel = self.grad_sharded_numel + len(self.trainable)  # the rows, then room for the "was used" flags
            self.sharded_grads = self.pool.take(numel * self.dtype.itemsize, self.shard_device).view(self.dtype)
            self._grad_views = [
                self.sharded_grads[p.grad_offset : p.grad_offset + p.local_rows * p.row_numel].view(p.sharded.shape)
                for p in self.trainable
            ]
        return self.sharded_grads

    def grad_views(self) -> list[Tensor]:
        """Each trainable shard's ``.grad`` as a view of ``sharded_grads`` (made once)."""
        self.grad_landing()
        return self._grad_views

    def _on_grad_accumulated(self, _param: Tensor) -> None:
        self.expect_backward()
        self.on_gradient_computed(self)

    def expect_backward(self) -> None:
        """Reduce at the end of the coming backward; gradients already ``HELD`` stay held until then."""
        if self.backward_state is BackwardState.IDLE:
            self.backward_state = BackwardState.PENDING

    # Hooks #

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.state is UnitState.SUMMONED:  # a plain module for now: nothing to gather, nothing to reduce
            return args, kwargs
        self._forward_depth += 1
        if self._forward_depth > 1:  # re-entered (a nested call of the same module): already set up
            return args, kwargs
        self.on_pre_forward(self)
        self.unshard()
        self.on_forward_started(self)  # prefetch the unit whose forward comes next
        if torch.is_grad_enabled() and self.trainable:
            args, kwargs = RegisterPostBackward.wrap_inputs(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.state is UnitState.SUMMONED:
            return output
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return output
        output_tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and self.trainable and not output_tensors and not self.is_root:
            # See [Note: a unit some ranks skip].
            output, output_tensors = ReachedByBackward.wrap_outputs(self, output)
        if torch.is_grad_enabled() and output_tensors:
            self.expect_backward()
            for t in output_tensors:
                t.register_hook(self._pre_backward)
            if self.reshard_after_forward:
                self.on_reshard_after_forward(self)
        else:
            self.reshard()  # no backward will come through this forward
        return output

    def _pre_backward(self, grad: Tensor) -> Tensor:
        self.on_first_pre_backward()
        self.expect_backward()
        self.unshard()
        self.on_pre_backward(self)  # prefetch the unit whose backward comes next
        return grad

    def post_backward(self) -> None:
        if self.backward_state is BackwardState.IDLE:
            return
        self.reshard()  # the weights are not needed to reduce: free them first, lowering the peak
        self.on_resharded_in_backward(self)
        if self.hold_grads:
            self.backward_state = BackwardState.HELD
            return
        self.on_reduce_started(self.start_reduce_grads())

    # Initialization from full weights #

    def init_from_full(self, full: dict[int, Tensor]) -> None:
        """Fill the sharded faces from the original full parameters (``id(ShardedParam)`` -> tensor), as global
        rank 0 holds them (see [Note: initial values agree with rank 0])."""
        values = values_of_rank0([full[id(p)] for p in self.params], self.device, self.mesh.data_parallel_group)
        for p, value in zip(self.params, values):
            p.copy_rows_from_full(value)
        self.state = UnitState.UNSHARDED  # faces not yet on modules; reshard() puts the sharded ones there
        self.reshard()

    def init_meta_empty(self, full: dict[int, Tensor]) -> None:
        """Leave parameters built on the meta device as uninitialised shards (a load fills them) and fill the
        others from their full values, as ``init_from_full``; nothing is materialised in full."""
        given = [p for p in self.params if not full[id(p)].is_meta]
        values = values_of_rank0([full[id(p)] for p in given], self.device, self.mesh.data_parallel_group)
        for p, value in zip(given, values):
            p.copy_rows_from_full(value)
        self.state = UnitState.UNSHARDED  # faces not yet on modules; reshard() puts the sharded ones there
        self.reshard()

    def init_from_reset_parameters(
        self, modules: list[nn.Module], full: dict[int, Tensor], device: torch.device
    ) -> None:
        """Materialise the unit in full (one unit at a time), run ``reset_parameters()`` on the ``modules`` that own
        meta-device parameters, and keep this rank's rows of rank 0's values (see [Note: initial values agree with
        rank 0]); parameters not on the meta device keep their values. A tensor-parallel parameter built on the meta
        device is materialised in its global shape (see [Note: meta-device DTensor parameters] in
        parallel/tensor.py)."""
        originals = {id(p): p.unsharded for p in self.params}
        with torch.no_grad():
            values: list[Tensor] = []
            for p in self.params:  # full-size tensors in the parameter dtype, one unit at a time
                source = full[id(p)]
                if not source.is_meta:
                    value = source.to(device)
                    p.unsharded = p.unsharded_face(value)
                else:
                    layout = p.tensor_parallel
                    shape = layout.global_shape if layout is not None else p.global_shape
                    value = torch.empty(shape, dtype=p.dtype, device=device)
                    p.unsharded = nn.Parameter(value, requires_grad=p.requires_grad)
                values.append(value)
                p.expose_unsharded()
            # In reverse module order, so that a tied weight takes the values its first owner gives it
            # (the embedding, not the LM head registered after it).
            for m in reversed(modules):
                run_initializer(m, device)
            # A whole tensor (a plain parameter, or a meta-built tensor-parallel one materialised whole) agrees with
            # global rank 0's; a block the plan gave agrees within its column.
            whole = [p.tensor_parallel is None or full[id(p)].is_meta for p in self.params]
            groups: dict[ProcessGroup | None, list[int]] = {}
            everywhere = None if self.mesh.pipeline is None else self.mesh.data_parallel_group  # the stage's ranks
            for i, is_whole in enumerate(whole):
                groups.setdefault(everywhere if is_whole else self.mesh.data_parallel_group, []).append(i)
            for group, indices in groups.items():
                for i, value in zip(indices, values_of_rank0([values[i] for i in indices], device, group)):
                    layout = self.params[i].tensor_parallel
                    self.params[i].copy_rows_from_full(layout.local_block(value) if layout and whole[i] else value)
            for p in self.params:
                p.unsharded = originals[id(p)]
        self.state = UnitState.UNSHARDED
        self.reshard()

    def __repr__(self) -> str:
        return f"ShardUnit({self.name or '<root>'}, params={len(self.params)}, state={self.state.name})"


def _wait_now(pending: collectives.Pending | None) -> None:
    if pending is not None:
        pending.wait()
