"""A sharding unit: the parameters of one wrapped module, communicated together.

A unit owns two flat buffers:

- ``flat_sharded: Tensor  # 1D (S,)``: this rank's chunk of every parameter, padded, concatenated
  (trainable parameters first, then frozen ones). The sharded ``nn.Parameter`` faces are views of it.
- ``flat_unsharded: Tensor  # 1D (shard_size * S,)``: every parameter in full, param-major, padded.
  Its storage is freed (resized to 0) while the unit is sharded and refilled by ``unshard()``.

With a shard group of one rank (``NO_SHARD``) the two are the same buffer and nothing is gathered.

[Note: unit states and autograd]
A unit is ``SHARDED`` or ``UNSHARDED`` (its full weights exist). Forward runs unsharded: the
pre-forward hook all-gathers (one collective) and puts the unsharded faces on the modules; the
post-forward hook frees them again under ``FULL_SHARD``/``HYBRID_SHARD`` and puts the sharded
faces back. Autograd has saved references to the unsharded faces; the pre-backward hook (a hook
on the forward's output tensors) gathers into the same storage, so those references see the
weights again. The copy into the storage preserves the version counter: it restores the values
autograd saved, it does not change them. Gradients accumulate on the unsharded faces; the
post-backward (a node on the forward's inputs, or the engine's end-of-backward callback for units
whose inputs need no gradient) reduce-scatters them in one collective and adds this rank's rows
to the sharded faces' ``.grad``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
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
    UNSHARDED = enum.auto()  # full weights gathered; modules hold the unsharded faces


class BackwardState(enum.Enum):
    """Whether gradients computed since the last reduction are waiting on the unsharded faces."""

    IDLE = enum.auto()  # nothing to reduce
    PENDING = enum.auto()  # a forward with grad ran (or a gradient arrived): reduce before the step


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
    ) -> None:
        self.name = name
        self.module = module
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.params = sorted(params, key=lambda p: not p.requires_grad)  # trainable first: see _reduce_grads
        self.trainable = [p for p in self.params if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(
                f"Sharding unit {name or '<root>'!r} ({type(module).__name__}) mixes parameter dtypes"
                f" {sorted(str(d) for d in dtypes)}. A unit is gathered as one flat buffer of one dtype:"
                f" make the differently-typed submodules units of their own with auto_wrap_policy."
            )
        self.dtype = dtypes.pop() if dtypes else torch.float32
        offset = 0
        for p in self.params:
            p.sharded_offset = offset
            offset += p.padded_shard_numel
        self.sharded_numel = offset  # S: this rank's padded elements
        self.grad_sharded_numel = sum(p.padded_shard_numel for p in self.trainable)
        self.flat_sharded = torch.zeros(self.sharded_numel, dtype=self.dtype, device=device)
        if self.gathers:
            self.flat_unsharded = torch.empty(self.sharded_numel * mesh.shard_size, dtype=self.dtype, device=device)
        else:
            self.flat_unsharded = self.flat_sharded
        for p in self.params:
            p.bind_sharded(self.flat_sharded)
            p.bind_unsharded(self.flat_unsharded)
            if p.requires_grad:
                p.unsharded.register_post_accumulate_grad_hook(self._on_grad_accumulated)
        self.state = UnitState.UNSHARDED
        self.backward_state = BackwardState.IDLE
        self._forward_depth = 0
        self.on_first_pre_backward: Callable[[], None] = lambda: None  # set by the engine
        self.on_pre_forward: Callable[[ShardUnit], None] = lambda unit: None  # set by the engine
        self.on_reshard_after_forward: Callable[[ShardUnit], None] = ShardUnit.reshard  # the engine may defer it

    @property
    def gathers(self) -> bool:
        """False when the shard group is one rank: the sharded buffer already is the full one."""
        return self.mesh.shard_size > 1

    @property
    def is_sharded(self) -> bool:
        return self.state is UnitState.SHARDED

    # Runtime #

    def unshard(self) -> None:
        """Gather the full weights into ``flat_unsharded`` (no-op if already unsharded)."""
        if self.state is UnitState.UNSHARDED:
            return
        if self.gathers and self.sharded_numel > 0:
            with record_function(f"lightning_shard::unshard({self.name})"):
                storage = self.flat_unsharded.untyped_storage()
                storage.resize_(self.flat_unsharded.numel() * self.flat_unsharded.element_size())
                gathered = torch.empty_like(self.flat_unsharded)
                collectives.all_gather_flat(gathered, self.flat_sharded, self.mesh.shard_group)
                # See [Note: unit states and autograd]: restore, don't modify, what autograd saved.
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.flat_unsharded):
                    torch.split_with_sizes_copy(
                        gathered.view(self.mesh.shard_size, -1),
                        [p.padded_shard_numel for p in self.params],
                        dim=1,
                        out=[p.padded_unsharded_view(self.flat_unsharded).view(self.mesh.shard_size, -1)
                             for p in self.params],
                    )
        self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Free the full weights and put the sharded faces back on the modules."""
        if self.state is UnitState.SHARDED:
            return
        for p in self.params:
            p.expose_sharded()
        if self.gathers:
            self.flat_unsharded.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    def expose_unsharded(self) -> None:
        for p in self.params:
            p.expose_unsharded()

    def reduce_grads(self) -> None:
        """Average the gradients on the unsharded faces over all data-parallel ranks into the sharded faces' grads."""
        self.backward_state = BackwardState.IDLE
        if not self.trainable:
            return
        with record_function(f"lightning_shard::reduce_grads({self.name})"):
            self._reduce_grads()

    def _reduce_grads(self) -> None:
        mesh = self.mesh
        n, k = mesh.shard_size, len(self.trainable)
        grads = [p.unsharded.grad for p in self.trainable]
        for p in self.trainable:
            p.unsharded.grad = None
        device = self.flat_sharded.device
        # Each rank's chunk ends with k "was used" flags, so that after the sum every rank knows which
        # parameters got a gradient on some rank: those unused everywhere keep grad None, as with DDP.
        used = torch.tensor([g is not None for g in grads], dtype=self.dtype, device=device)
        chunked = torch.empty(n, self.grad_sharded_numel + k, dtype=self.dtype, device=device)
        pieces = [p.grad_rows(g) for p, g in zip(self.trainable, grads)]
        torch._chunk_cat([*pieces, used.expand(n, k)], dim=0, num_chunks=n, out=chunked)
        del grads, pieces  # the unsharded gradients are copied: free them before communicating
        chunked.div_(mesh.world_size)  # DDP's order: divide, then sum (exact for power-of-two world sizes)
        if mesh.shard_group is not None:
            reduced = collectives.reduce_scatter_sum(chunked.view(-1), mesh.shard_group, mesh.shard_rank)
        else:
            reduced = chunked.view(-1)
        if mesh.replicate_group is not None:
            collectives.all_reduce_sum(reduced, mesh.replicate_group)
        used_anywhere = (reduced[self.grad_sharded_numel :] > 0).tolist()
        for p, is_used in zip(self.trainable, used_anywhere):
            if not is_used:
                continue
            start = p.sharded_offset
            grad = reduced[start : start + p.local_rows * p.row_numel].view(p.sharded.shape)
            if p.sharded.grad is None:
                p.sharded.grad = grad
            else:
                p.sharded.grad.add_(grad)

    def _on_grad_accumulated(self, _param: Tensor) -> None:
        self.backward_state = BackwardState.PENDING

    # Hooks #

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._forward_depth += 1
        if self._forward_depth > 1:  # re-entered (a nested call of the same module): already set up
            return args, kwargs
        self.on_pre_forward(self)
        self.unshard()
        self.expose_unsharded()
        if torch.is_grad_enabled() and self.trainable:
            args, kwargs = _RegisterPostBackward.wrap_inputs(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self._forward_depth -= 1
        if self._forward_depth > 0:
            return output
        output_tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and output_tensors:
            self.backward_state = BackwardState.PENDING
            for t in output_tensors:
                t.register_hook(self._pre_backward)
            if self.reshard_after_forward:
                self.on_reshard_after_forward(self)
        else:
            self.reshard()  # no backward will come through this forward
        return output

    def _pre_backward(self, grad: Tensor) -> Tensor:
        self.on_first_pre_backward()
        self.backward_state = BackwardState.PENDING
        self.unshard()
        return grad

    def post_backward(self) -> None:
        if self.backward_state is BackwardState.IDLE:
            return
        self.reshard()  # the weights are not needed to reduce: free them first, lowering the peak
        self.reduce_grads()

    # Initialization from full weights #

    def init_from_full(self, full: dict[int, Tensor]) -> None:
        """Fill the sharded faces from the original full parameters (``id(ShardedParam)`` -> tensor)."""
        for p in self.params:
            p.copy_rows_from_full(full[id(p)])
        self.state = UnitState.UNSHARDED  # faces not yet on modules; reshard() puts the sharded ones there
        self.reshard()

    def init_from_reset_parameters(
        self, modules: list[nn.Module], full: dict[int, Tensor], device: torch.device
    ) -> None:
        """Materialise the unit in full (one unit at a time), run ``reset_parameters()`` on the ``modules`` that own
        meta-device parameters, and keep this rank's rows; parameters not on the meta device keep their values."""
        storage = self.flat_unsharded.untyped_storage()
        storage.resize_(self.flat_unsharded.numel() * self.flat_unsharded.element_size())
        self.expose_unsharded()
        with torch.no_grad():
            for p in self.params:
                if not full[id(p)].is_meta:
                    p.unsharded.copy_(full[id(p)])
            for m in modules:
                for name, buf in m._buffers.items():
                    if buf is not None and buf.is_meta:
                        m._buffers[name] = torch.empty_like(buf, device=device)
                m.reset_parameters()  # type: ignore[operator]
            if self.gathers:
                for p in self.params:
                    p.copy_rows_from_full(p.unsharded)
        self.state = UnitState.UNSHARDED
        self.reshard()

    def __repr__(self) -> str:
        return f"ShardUnit({self.name or '<root>'}, params={len(self.params)}, state={self.state.name})"


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
