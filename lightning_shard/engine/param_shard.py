"""One parameter's sharded state: which rows this rank holds, and its two faces.

A parameter of global shape ``(rows, *row_shape)`` is split along dim 0 into ``shard_size``
chunks of ``rows_per_rank = ceil(rows / shard_size)`` rows; the last chunks are padded (a rank
may hold zero real rows when there are fewer rows than ranks). A 0-dim parameter is one row.

- The **sharded** face is an ordinary ``nn.Parameter`` of shape ``(local_rows, *row_shape)``: a
  view into the unit's flat sharded buffer. It is what the module holds between steps, what
  ``named_parameters()`` returns and what the optimizer updates in place, so optimizer state is
  sharded too.
- The **unsharded** face is an ``nn.Parameter`` of the global shape, a view into the unit's flat
  unsharded buffer. The module holds it during forward; autograd accumulates its gradient.

A parameter a tensor-parallel plan made a ``DTensor`` is sharded as its local tensor: ``global_shape`` is then the
local tensor's shape, and the unsharded face is presented as the ``DTensor`` (see [Note: DTensor parameters in the
engine] in ``tensor_parallel``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_shard.engine.parallel.tensor import TensorParallelLayout

# Every sharded face, whichever model holds it, by id (a WeakSet would compare tensors with ==).
_SHARDS: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def is_shard(param: Tensor) -> bool:
    """Whether ``param`` is the sharded face of a parameter of a sharded model (this rank's rows of it)."""
    return _SHARDS.get(id(param)) is param


@dataclass
class ShardedParam:
    """Bookkeeping for one parameter inside a unit (see the module docstring for the two faces)."""

    fqns: list[str]  # qualified names under the root, e.g. ["model.wte.weight", "model.lm_head.weight"] when tied
    owners: list[tuple[nn.Module, str]]  # every (module, attribute) that holds this parameter (tied weights: several)
    global_shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    shard_size: int
    shard_rank: int
    sharded_offset: int = 0  # element offset of this parameter's padded chunk in the unit's flat sharded buffer
    compute_dtype: torch.dtype | None = None  # dtype it is gathered and computed in; None: its own dtype
    gather_offset: int = 0  # byte offset of its padded chunk in one rank's part of the all-gather
    grad_offset: int = 0  # element offset of its padded chunk in one rank's part of the gradient reduction
    tensor_parallel: TensorParallelLayout | None = None  # the plan's DTensor layout; global_shape is then the local's
    sharded: nn.Parameter = field(init=False, repr=False)
    unsharded: nn.Parameter = field(init=False, repr=False)

    @property
    def fqn(self) -> str:
        """The first name under which the parameter appears (``named_parameters()`` order)."""
        return self.fqns[0]

    # Geometry #

    @property
    def rows(self) -> int:
        return self.global_shape[0] if len(self.global_shape) > 0 else 1

    @property
    def row_shape(self) -> torch.Size:
        return self.global_shape[1:]

    @property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @property
    def rows_per_rank(self) -> int:
        return math.ceil(self.rows / self.shard_size)

    @property
    def padded_shard_numel(self) -> int:
        """Elements of one rank's chunk, padding included: the stride between ranks in collectives."""
        return self.rows_per_rank * self.row_numel

    @property
    def first_row(self) -> int:
        return self.shard_rank * self.rows_per_rank

    @property
    def local_rows(self) -> int:
        """Real (unpadded) rows this rank holds; 0 when there are fewer rows than ranks."""
        return self.rows_held_by(self.shard_rank)[1]

    def rows_held_by(self, shard_rank: int) -> tuple[int, int]:
        """``(first row, number of real rows)`` that the rank ``shard_rank`` of the shard group holds."""
        first = shard_rank * self.rows_per_rank
        return first, max(0, min(self.rows_per_rank, self.rows - first))

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    # Where its rows sit in the whole tensor (a tensor-parallel parameter's local tensor is one block of it) #

    @property
    def full_shape(self) -> torch.Size:
        """The shape of the whole parameter: ``global_shape``, or the tensor-parallel plan's global shape."""
        return self.tensor_parallel.global_shape if self.tensor_parallel is not None else self.global_shape

    def rows_in_full(self) -> tuple[int, int, tuple[int, int] | None]:
        """``(start, stop, columns)``: this rank's rows of the whole parameter are rows ``[start, stop)`` of it,
        restricted to columns ``[columns[0], columns[1])`` when the tensor-parallel plan splits dim 1 (``None``: every
        column)."""
        first, stop = self.first_row, self.first_row + self.local_rows
        tp = self.tensor_parallel
        if tp is None or tp.shard_dim is None:
            return first, stop, None
        if tp.shard_dim == 0:
            return tp.local_offset[0] + first, tp.local_offset[0] + stop, None
        return first, stop, (tp.local_offset[1], tp.local_offset[1] + self.global_shape[1])

    # Faces #

    def bind_sharded(self, flat_sharded: Tensor) -> None:
        """Create the sharded ``nn.Parameter`` as a view of this parameter's chunk of ``flat_sharded``."""
        start = self.sharded_offset
        view = flat_sharded[start : start + self.local_rows * self.row_numel].view(self.local_rows, *self.row_shape)
        self.sharded = nn.Parameter(view, requires_grad=self.requires_grad)
        _SHARDS[id(self.sharded)] = self.sharded

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.compute_dtype or self.dtype

    @property
    def padded_gather_bytes(self) -> int:
        """Bytes of one rank's chunk in the all-gather (compute dtype, padding included)."""
        return self.padded_shard_numel * self.gather_dtype.itemsize

    def bind_unsharded(self, unsharded_bytes: Tensor) -> None:
        """Create the unsharded ``nn.Parameter`` as a view of this parameter's region of the unit's byte buffer."""
        padded = self.unsharded_region(unsharded_bytes).view(self.gather_dtype)
        padded = padded.view(self.shard_size * self.rows_per_rank, *self.row_shape)
        self.unsharded = self.unsharded_face(padded[: self.rows].view(self.global_shape))

    def unsharded_face(self, full: Tensor) -> nn.Parameter:
        """``full`` (this parameter's gathered tensor) as the parameter the module computes with: itself, or the
        tensor-parallel plan's ``DTensor`` over it."""
        face = full if self.tensor_parallel is None else self.tensor_parallel.face(full)
        return nn.Parameter(face, requires_grad=self.requires_grad)

    def local_grad(self, grad: Tensor | None) -> Tensor | None:
        """The gradient the module computed, as a plain tensor of ``global_shape`` (a ``DTensor``'s local part)."""
        if grad is None or self.tensor_parallel is None:
            return grad
        return self.tensor_parallel.local_grad(grad)

    def unsharded_region(self, unsharded_bytes: Tensor) -> Tensor:
        """The ``shard_size * padded_gather_bytes`` bytes holding this parameter in full (param-major layout)."""
        start = self.gather_offset * self.shard_size
        return unsharded_bytes[start : start + self.padded_gather_bytes * self.shard_size]

    def copy_rows_from_full(self, full: Tensor) -> None:
        """Copy this rank's rows of the full tensor ``full`` into the sharded face."""
        if self.local_rows == 0:
            return
        rows = full.reshape(self.rows, *self.row_shape)[self.first_row : self.first_row + self.local_rows]
        with torch.no_grad():
            self.sharded.copy_(rows)

    def grad_rows(self, full_grad: Tensor | None, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``full_grad`` as ``(rows, row_numel)`` in ``dtype`` for chunking; zeros (on ``device``) if the parameter
        got no gradient."""
        if full_grad is None:
            return torch.zeros(self.rows, self.row_numel, dtype=dtype, device=device)
        return full_grad.reshape(self.rows, self.row_numel).to(dtype)

    # Module attributes #

    def expose_unsharded(self) -> None:
        for module, name in self.owners:
            module._parameters[name] = self.unsharded

    def expose_sharded(self) -> None:
        for module, name in self.owners:
            module._parameters[name] = self.sharded
