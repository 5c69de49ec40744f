"""A sharding unit: the parameters of one wrapped module, communicated together.

A unit owns two flat buffers:

- ``flat_sharded: Tensor  # 1D (S,), parameter dtype``: this rank's chunk of every parameter,
  padded, concatenated. The sharded ``nn.Parameter`` faces are views of it (the fp32 master
  weights under mixed precision).
- ``flat_unsharded: Tensor  # 1D (shard_size * B,), uint8``: every parameter in full, param-major,
  padded, each in its compute dtype (``B`` bytes per rank). Its storage is freed (resized to 0)
  while the unit is sharded and refilled by ``unshard()``.

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
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_shard import collectives
from lightning_shard.mesh import ShardMesh
from lightning_shard.param_shard import ShardedParam


class UnitState(enum.Enum):
    """Whether a unit's full weights exist (see [Note: unit states and autograd])."""

    SHARDED = enum.auto()  # only this rank's chunk exists; modules hold the sharded faces
    GATHERING = enum.auto()  # a prefetch all-gather is in flight; modules still hold the sharded faces
    UNSHARDED = enum.auto()  # full weights gathered; modules hold the unsharded faces


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
    ) -> None:
        self.name = name
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
        for p in self.params:
            p.bind_sharded(self.flat_sharded)
            p.bind_unsharded(self.flat_unsharded)
            if p.requires_grad:
                p.unsharded.register_post_accumulate_grad_hook(self._on_grad_accumulated)
        # Each parameter's full bytes in the unsharded buffer (views stay valid while its storage is freed).
        self._regions = [p.unsharded_region(self.flat_unsharded) for p in self.params]
        self.state = UnitState.UNSHARDED
        self._pending_gather: collectives.Pending | None = None
        self._restore_version: AbstractContextManager = nullcontext()
        self.backward_state = BackwardState.IDLE
        self.hold_grads = False  # set by the engine while gradients accumulate unreduced (grad_sync="step")
        self.is_root = False  # set by the engine: the root stays gathered from its forward to the end of backward
        self._forward_depth = 0
        self.on_first_pre_backward: Callable[[], None] = lambda: None  # set by the engine
        self.on_pre_forward: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        self.on_forward_started: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        self.on_pre_backward: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        # The engine overlaps reductions with the rest of backward; alone, a unit finishes its own at once.
        self.on_reduce_started: Callable[[collectives.Pending | None], None] = _wait_now
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
        if self.state is UnitState.UNSHARDED:
            return
        if self.state is UnitState.SHARDED:
            self.start_unshard(async_op=False)
        self._finish_unshard()

    def start_unshard(self, async_op: bool = True) -> None:
        """Issue the all-gather (asynchronously: a prefetch); ``unshard()`` waits for it and copies it out."""
        if self.state is not UnitState.SHARDED:
            return  # already gathered, or a gather is in flight
        self.state = UnitState.GATHERING
        if not self.materializes or self.sharded_numel == 0:
            self._pending_gather = None
            return
        with record_function(f"lightning_shard::unshard({self.name})"):
            self.flat_unsharded.untyped_storage().resize_(self.flat_unsharded.numel())
            # The version to restore once the gather has landed (a backend thread may write, and so bump the
            # version counter, any time before wait() returns): see [Note: unit states and autograd].
            self._restore_version = torch.autograd._unsafe_preserve_version_counter(self.flat_unsharded)
            group = self.mesh.shard_group
            if group is None:  # one-rank shard group: cast (or upload) straight into the unsharded buffer
                self._all_gather_input(into=self.flat_unsharded)
                self._pending_gather = None
                return
            send = self._all_gather_input()
            if collectives.exchanges_point_to_point(self.mesh.shard_backend, self.device):
                pieces = [(r, p) for r, p in zip(self._regions, self.params) if p.padded_gather_bytes > 0]
                with torch.no_grad():
                    self._pending_gather = collectives.all_gather_pieces(
                        [r for r, _ in pieces],
                        [send[p.gather_offset : p.gather_offset + p.padded_gather_bytes] for _, p in pieces],
                        group,
                        async_op,
                    )
            else:
                gathered = torch.empty(self.mesh.shard_size * self.gather_bytes, dtype=torch.uint8, device=send.device)
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
        self.state = UnitState.UNSHARDED
        for p in self.params:
            p.expose_unsharded()

    def _all_gather_input(self, into: Tensor | None = None) -> Tensor:
        """This rank's chunk as bytes on the compute device: the sharded buffer itself, or a copy (cast to the
        compute dtypes, uploaded from CPU memory under offload) in ``into`` or a new buffer."""
        if not self.casts and not self.offloaded:
            return self.flat_sharded.view(torch.uint8)
        send = into if into is not None else torch.empty(self.gather_bytes, dtype=torch.uint8, device=self.device)
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
        if self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:  # a prefetch nobody used: let it land before freeing its target
            self._finish_unshard()
        for p in self.params:
            p.expose_sharded()
        if self.materializes:
            self.flat_unsharded.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    def start_reduce_grads(self) -> collectives.Pending | None:
        """Issue the gradient reduction (averaging over all data-parallel ranks); ``wait()`` on the result puts this
        rank's rows into the shards' grads."""
        self.backward_state = BackwardState.IDLE
        if not self.trainable:
            return None
        with record_function(f"lightning_shard::reduce_grads({self.name})"):
            return self._start_reduce(async_op=self.mesh.replicate_group is None)

    def _start_reduce(self, async_op: bool) -> collectives.Pending:
        mesh = self.mesh
        n, k = mesh.shard_size, len(self.trainable)
        grads = [p.unsharded.grad for p in self.trainable]
        for p in self.trainable:
            p.unsharded.grad = None
        if mesh.world_size == 1:  # nothing to average: the gradients become the shards' gradients as they are
            return collectives.Pending(None, functools.partial(self._keep_local_grads, grads))
        if mesh.shard_group is not None and collectives.exchanges_point_to_point(mesh.shard_backend, self.device):
            return self._start_exchange_reduce(grads)
        device = self.device
        present = {g.dtype for g in grads if g is not None}
        in_dtype = present.pop() if len(present) == 1 else self.reduce_dtype  # _chunk_cat wants one input dtype
        # Each rank's chunk ends with k "was used" flags, so that after the sum every rank knows which
        # parameters got a gradient on some rank: those unused everywhere keep grad None, as with DDP.
        used_here = [g is not None for g in grads]
        used = torch.tensor(used_here, dtype=in_dtype, device=device)
        chunked = torch.empty(n, self.grad_sharded_numel + k, dtype=self.reduce_dtype, device=device)
        pieces = [p.grad_rows(g, in_dtype, device) for p, g in zip(self.trainable, grads)]
        torch._chunk_cat([*pieces, used.expand(n, k)], dim=0, num_chunks=n, out=chunked)  # casts to reduce dtype
        del grads, pieces  # the unsharded gradients are copied: free them before communicating
        # DDP divides by the world size before summing. For a power-of-two world size dividing this rank's
        # chunk after the sum gives the same bits (the scaling is exact) and touches 1/N of the data.
        power_of_two = mesh.world_size & (mesh.world_size - 1) == 0
        if not power_of_two or mesh.shard_group is None:
            chunked.div_(mesh.world_size)
        if mesh.shard_group is not None:
            reduction = collectives.reduce_scatter_sum(
                chunked.view(-1), mesh.shard_group, async_op, mesh.world_size if power_of_two else 1
            )
        else:
            reduction = collectives.Pending(None, lambda: chunked.view(-1))
        return collectives.Pending(None, lambda: self._finish_reduce(_result(reduction), used_here))

    def _start_exchange_reduce(self, grads: list[Tensor | None]) -> collectives.Pending:
        """The reduce-scatter as a point-to-point exchange (see [Note: the fast path per backend]): every rank
        sends each peer that peer's rows of every gradient, straight from the gradients (no rank-major copy),
        and sums what it receives for its own rows. The result has the layout ``_start_reduce`` gives."""
        mesh = self.mesh
        assert mesh.shard_group is not None
        n, me, k, total = mesh.shard_size, mesh.shard_rank, len(self.trainable), self.grad_sharded_numel
        with torch.no_grad():
            used_here = [g is not None for g in grads]
            used = torch.tensor(used_here, dtype=self.reduce_dtype, device=self.device)
            mats = [p.grad_rows(g, self.reduce_dtype, self.device) for p, g in zip(self.trainable, grads)]
            del grads
            power_of_two = mesh.world_size & (mesh.world_size - 1) == 0
            if not power_of_two:  # DDP divides before summing; for a power of two, after is the same bits
                mats = [m / mesh.world_size for m in mats]
            # What each peer sends for this rank's rows, one row per peer in the reduction's layout; with more
            # than two ranks a row for this rank's own part too, so that the rows are summed in rank order.
            received = torch.empty(n if n > 2 else 1, total + k, dtype=self.reduce_dtype, device=self.device)
            for p in self.trainable:  # zero the padding, which nobody sends, so that only numbers are summed
                if p.local_rows < p.rows_per_rank:
                    received[:, p.grad_offset + p.local_rows * p.row_numel : p.grad_offset + p.padded_shard_numel] = 0

            def row_of(rank: int) -> Tensor:
                return received[rank if n > 2 else 0]

            def own_piece(row: Tensor, p: ShardedParam) -> Tensor:
                return row[p.grad_offset : p.grad_offset + p.local_rows * p.row_numel]

            outgoing: list[list[Tensor]] = [[] for _ in range(n)]
            incoming: list[list[Tensor]] = [[] for _ in range(n)]
            for q in range(n):
                if q == me:
                    continue
                for p, m in zip(self.trainable, mats):
                    first, count = p.rows_held_by(q)
                    if count:
                        outgoing[q].append(m[first : first + count].view(-1))
                    if p.local_rows:
                        incoming[q].append(own_piece(row_of(q), p))
                outgoing[q].append(used)
                incoming[q].append(row_of(q)[total:])
        rank_major_bytes = n * (total + k) * self.reduce_dtype.itemsize  # what a reduce-scatter's input would be
        exchange = collectives.reduce_scatter_exchange(outgoing, incoming, mesh.shard_group, rank_major_bytes)

        def summed() -> Tensor:
            exchange.wait()
            with torch.no_grad():
                # Two ranks: add this rank's part into the peer's row (a + b == b + a). More: put it in its own
                # row and sum the rows in rank order, the same order on every rank.
                target = row_of(me)
                place = Tensor.add_ if n == 2 else Tensor.copy_
                for p, m in zip(self.trainable, mats):
                    if p.local_rows:
                        first, count = p.rows_held_by(me)
                        place(own_piece(target, p), m[first : first + count].view(-1))
                place(target[total:], used)
                out = target if n == 2 else received.sum(0)
                return out.div_(mesh.world_size) if power_of_two else out

        return collectives.Pending(None, lambda: self._finish_reduce(summed(), used_here))

    def _keep_local_grads(self, grads: list[Tensor | None]) -> None:
        """One rank: each gradient becomes its shard's gradient (no copy unless the dtype or device differs);
        parameters without a gradient keep ``None``."""
        for p, g in zip(self.trainable, grads):
            if g is None:
                continue
            grad = g.to(device=self.shard_device, dtype=self.dtype).view(p.sharded.shape)
            if p.sharded.grad is None:
                p.sharded.grad = grad
            else:
                p.sharded.grad.add_(grad)

    def _finish_reduce(self, reduced: Tensor, used_here: list[bool]) -> None:
        if self.mesh.replicate_group is not None:
            collectives.all_reduce_sum(reduced, self.mesh.replicate_group)
        # The summed flags matter only for parameters this rank did not use; when it used them all (the usual
        # case) they are not read, which on a GPU saves a device synchronisation per unit.
        used_anywhere = used_here if all(used_here) else (reduced[self.grad_sharded_numel :] > 0).tolist()
        shard_grads = reduced
        if self.reduce_dtype != self.dtype or self.offloaded:  # to the shards' dtype and device
            shard_grads = reduced[: self.grad_sharded_numel].to(device=self.shard_device, dtype=self.dtype)
        for p, is_used in zip(self.trainable, used_anywhere):
            if not is_used:
                continue
            grad = shard_grads[p.grad_offset : p.grad_offset + p.local_rows * p.row_numel].view(p.sharded.shape)
            if p.sharded.grad is None:
                p.sharded.grad = grad
            else:
                p.sharded.grad.add_(grad)

    def _on_grad_accumulated(self, _param: Tensor) -> None:
        self.expect_backward()

    def expect_backward(self) -> None:
        """Reduce at the end of the coming backward; gradients already ``HELD`` stay held until then."""
        if self.backward_state is BackwardState.IDLE:
            self.backward_state = BackwardState.PENDING

    # Hooks #

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._forward_depth += 1
        if self._forward_depth > 1:  # re-entered (a nested call of the same module): already set up
            return args, kwargs
        self.on_pre_forward(self)
        self.unshard()
        self.on_forward_started(self)  # prefetch the unit whose forward comes next
        if torch.is_grad_enabled() and self.trainable:
            args, kwargs = _RegisterPostBackward.wrap_inputs(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return output
        output_tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and self.trainable and not output_tensors and not self.is_root:
            # See [Note: a unit some ranks skip].
            output, output_tensors = _ReachedByBackward.wrap_outputs(self, output)
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
        if self.hold_grads:
            self.backward_state = BackwardState.HELD
            return
        self.on_reduce_started(self.start_reduce_grads())

    # Initialization from full weights #

    def init_from_full(self, full: dict[int, Tensor]) -> None:
        """Fill the sharded faces from the original full parameters (``id(ShardedParam)`` -> tensor), as global
        rank 0 holds them (see ``_from_rank0``)."""
        for p in self.params:
            p.copy_rows_from_full(_from_rank0(full[id(p)], self.device))
        self.state = UnitState.UNSHARDED  # faces not yet on modules; reshard() puts the sharded ones there
        self.reshard()

    def init_from_reset_parameters(
        self, modules: list[nn.Module], full: dict[int, Tensor], device: torch.device
    ) -> None:
        """Materialise the unit in full (one unit at a time), run ``reset_parameters()`` on the ``modules`` that own
        meta-device parameters, and keep this rank's rows; parameters not on the meta device keep their values."""
        originals = {id(p): p.unsharded for p in self.params}
        with torch.no_grad():
            for p in self.params:  # full-size tensors in the parameter dtype, one unit at a time
                source = full[id(p)]
                p.unsharded = nn.Parameter(
                    torch.empty(p.global_shape, dtype=p.dtype, device=device) if source.is_meta else source.to(device),
                    requires_grad=p.requires_grad,
                )
                p.expose_unsharded()
            # In reverse module order, so that a tied weight takes the values its first owner gives it
            # (the embedding, not the LM head registered after it).
            for m in reversed(modules):
                for name, buf in m._buffers.items():
                    if buf is not None and buf.is_meta:
                        m._buffers[name] = torch.empty_like(buf, device=device)
                m.reset_parameters()  # type: ignore[operator]
            for p in self.params:
                p.copy_rows_from_full(_from_rank0(p.unsharded.data, device))
                p.unsharded = originals[id(p)]
        self.state = UnitState.UNSHARDED
        self.reshard()

    def __repr__(self) -> str:
        return f"ShardUnit({self.name or '<root>'}, params={len(self.params)}, state={self.state.name})"


def _from_rank0(full: Tensor, device: torch.device) -> Tensor:
    """``full`` as global rank 0 holds it: every rank starts from rank 0's weights, as with DDP, even when the
    ranks built or initialised the model differently (no common seed). One broadcast per parameter, at setup."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return full
    on_device = full.detach().to(device).contiguous()
    if on_device.data_ptr() == full.data_ptr():
        on_device = on_device.clone()  # never overwrite the caller's tensor
    collectives.broadcast_from_rank0(on_device)
    return on_device


def _wait_now(pending: collectives.Pending | None) -> None:
    if pending is not None:
        pending.wait()


def _result(pending: collectives.Pending) -> Tensor:
    result = pending.wait()
    assert result is not None
    return result


class _ReachedByBackward(torch.autograd.Function):
    """Identity on a unit's floating outputs that makes them require grad through one of its trainable weights,
    which gets no gradient from it.

    [Note: a unit some ranks skip]
    A rank whose forward uses none of a unit's trainable parameters, on inputs that need no
    gradient (a branch taken on some ranks only), gets outputs that need no gradient: left alone,
    its backward would never reach the unit, nor the units after it through their inputs, while
    the other ranks gather and reduce there. Every rank must issue the same collectives in the
    same order, so such outputs are routed through this function: the backward reaches the unit
    where it reaches it on the other ranks, and the unit reduces zeros (and flags) for what this
    rank did not use. The root is left out: it is gathered for the whole step and reduced at the
    end of backward on every rank, and its outputs are what the user's code receives.
    """

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, *outputs: Tensor) -> tuple[Tensor, ...]:
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        return (None, *grads)

    @staticmethod
    def wrap_outputs(unit: ShardUnit, output: Any) -> tuple[Any, list[Tensor]]:
        flat, spec = tree_flatten(output)
        positions = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.is_floating_point()]
        if not positions:
            return output, []
        wrapped = _ReachedByBackward.apply(unit.trainable[0].unsharded, *(flat[i] for i in positions))
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return tree_unflatten(flat, spec), list(wrapped)


class _RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once the unit's gradients are all computed."""

    @staticmethod
    def forward(ctx: Any, unit: ShardUnit, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.unit.post_backward()
        return (None, *grads)

    @staticmethod
    def wrap_inputs(unit: ShardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
        if not positions:
            return args, kwargs
        wrapped = _RegisterPostBackward.apply(unit, *(flat[i] for i in positions))
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return tree_unflatten(flat, spec)
