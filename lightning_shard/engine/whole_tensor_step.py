"""An optimizer step that runs each tensor's update whole, on one rank (``OptimizerUpdate.PER_TENSOR``).

See [Note: what an optimizer may see of a sharded parameter] in ``optimizer_rule`` for why. One step:

1. The closure, if any, runs first (the gradients exist only after it).
2. Every rank sends each tensor's owner its rows of the gradient, of the parameter and of each state tensor shaped
   like the parameter; the owner assembles them whole (one point-to-point exchange over the shard group).
3. On the owner, the parameter's ``.data``, ``.grad`` and state become the whole tensors; on the other ranks the
   parameter's ``.grad`` is ``None`` for the step, so the optimizer skips it there. The optimizer's own ``step``
   runs once: torch's Muon orthogonalises each whole matrix on one rank, Adafactor takes whole rows and columns.
4. The owner sends every rank its rows of the updated parameter and of the state shaped like it, and the rest of
   the state whole (a second exchange; a small all-gather tells the other ranks what the state holds). Between
   steps every rank holds its rows, like any other optimizer's: checkpoints save and load it at any world size.

The parameters the optimizer holds stay the same objects throughout, so state, parameter groups and learning-rate
schedulers are untouched.
"""

from __future__ import annotations

import math
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.engine import collectives
from lightning_shard.engine.optimizer_rule import OptimizerUpdate, mark_prepared, optimizer_update
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.sharded_module import ShardedModule

_RUNNERS: weakref.WeakKeyDictionary[Optimizer, _WholeTensorStep] = weakref.WeakKeyDictionary()


@dataclass
class _Owned:
    """One parameter the optimizer holds, and the rank of its shard group that updates it whole."""

    face: nn.Parameter  # the sharded face the optimizer holds
    param: ShardedParam
    owner: int


@dataclass
class _Swapped:
    """What the step replaced on a parameter, to be put back: its rows (the sharded face's data) and gradient."""

    rows: Tensor
    grad: Tensor | None


def prepare_optimizer(optimizer: Optimizer, engines: list[ShardedModule]) -> None:
    """Before the first step: refuse ``optimizer`` if it cannot run exactly on sharded parameters, and make a
    per-tensor one run each tensor whole (see [Note: what an optimizer may see of a sharded parameter])."""
    if optimizer_update(optimizer) is OptimizerUpdate.PER_TENSOR:
        run_each_tensor_whole(optimizer, engines)
    mark_prepared(optimizer)


def run_each_tensor_whole(optimizer: Optimizer, engines: list[ShardedModule]) -> None:
    """Make ``optimizer.step`` run each parameter's update whole on one rank (see the module docstring)."""
    if getattr(optimizer.step, "_lightning_shard_whole_tensor", False):
        return
    runner = _WholeTensorStep(optimizer, engines, optimizer.step)
    _RUNNERS[optimizer] = runner

    def step(self: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        return runner.step(closure)

    bound = types.MethodType(step, optimizer)
    bound.__func__._lightning_shard_whole_tensor = True  # type: ignore[attr-defined]
    optimizer.step = bound  # type: ignore[method-assign]


def row_state_keys(optimizer: Optimizer) -> dict[int, list[str]] | None:
    """For an optimizer that runs each tensor whole: each parameter's state entries split by rows (by id of the
    parameter), the same on every rank, as its last step or load settled them; ``None`` for any other optimizer. A
    save splits these by rows and stores the others whole, where a shape test could differ between ranks."""
    runner = _RUNNERS.get(optimizer)
    return runner.row_keys if runner is not None else None


def note_loaded_split(optimizer: Optimizer, whole: dict[int, set[str]]) -> None:
    """After a load: which state entries of each parameter (by id) the checkpoint stored whole, so that the next
    step splits the others by rows on every rank alike. Nothing for an optimizer that runs on the shards."""
    runner = _RUNNERS.get(optimizer)
    if runner is None:
        return
    for param, state in optimizer.state.items():
        runner.row_keys[id(param)] = sorted(k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0
                                            and k not in whole.get(id(param), set()))


class _WholeTensorStep:
    """The step ``run_each_tensor_whole`` installs: the closure, the gather to the owners, the optimizer's own step,
    the rows sent back (see the module docstring)."""

    def __init__(self, optimizer: Optimizer, engines: list[ShardedModule], step: Callable[..., Any]) -> None:
        self.optimizer = optimizer
        self.engines = engines
        self._step = step  # the optimizer's step as it was (a learning-rate scheduler may have wrapped it)
        # Each parameter's state entries split by rows, as its owner told every rank at the last step (by id of the
        # parameter): the same on every rank, where a shape test would not be (see ``_row_keys``).
        self.row_keys: dict[int, list[str]] = {}

    def step(self, closure: Callable[[], Any] | None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = [(engine, plan) for engine in self.engines if (plan := self._plan(engine))]
        with torch.no_grad():
            swapped = [_gather_to_owners(engine, plan, self.optimizer.state, self.row_keys) for engine, plan in plans]
            try:
                self._step()
            finally:
                for (engine, plan), held in zip(plans, swapped):
                    _scatter_from_owners(engine, plan, self.optimizer.state, held, self.row_keys)
                _in_parameter_order(self.optimizer)
        return loss

    def _plan(self, engine: ShardedModule) -> list[_Owned]:
        """The optimizer's parameters of ``engine`` with their owners; empty where each rank holds whole tensors.
        Worked out at every step: the shard group can change (an elastic restart re-binds the mesh)."""
        if engine.mesh.shard_group is None or engine.mesh.shard_size == 1:
            return []
        by_face = {id(p.sharded): p for p in engine.sharded_params()}
        held = [q for group in self.optimizer.param_groups for q in group["params"] if id(q) in by_face]
        # By the whole tensor's size, the same in every tensor-parallel column: see [Note: whole tensors under
        # tensor parallelism].
        owners = assign_owners([math.prod(by_face[id(q)].full_shape) for q in held], engine.mesh.shard_size)
        return [_Owned(q, by_face[id(q)], owner) for q, owner in zip(held, owners)]


def _in_parameter_order(optimizer: Optimizer) -> None:
    """Order the optimizer's state as the parameter groups list the parameters, as one process's first step creates
    it: the owners' step creates the state of their own parameters first, and a save walks the state in its order,
    which must be the same on every rank."""
    states = optimizer.state
    order = [q for group in optimizer.param_groups for q in group["params"] if q in states]
    if [id(q) for q in states] != [id(q) for q in order]:
        ordered = {q: states[q] for q in order}
        states.clear()
        states.update(ordered)


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """The rank that updates each tensor: largest first, each to the rank with the fewest elements so far (ties:
    the lowest rank), so every rank updates about ``sum(sizes) / ranks`` elements. The same on every rank."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


# Gather #


def _row_keys(state: dict[str, Any], face: Tensor, told: dict[int, list[str]]) -> list[str]:
    """The state entries split by rows like the parameter: as the owner told every rank at the last step, else (state
    loaded into a new process) by the checkpoint's rule, the shard's own shape. The rule alone could differ between
    ranks where a whole entry's shape equals one rank's rows (Adafactor's (1, C) column statistics on a rank holding
    one row)."""
    if id(face) in told and set(told[id(face)]) <= set(state):
        return told[id(face)]
    return sorted(k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0 and v.shape == face.shape)


def _pieces(p: ShardedParam, whole: Tensor) -> list[Tensor]:
    """``whole``'s rows held by each rank of the shard group, as views (rank order)."""
    rows = whole.view(p.rows, *p.row_shape)
    return [rows[first : first + n] for first, n in map(p.rows_held_by, range(p.shard_size))]


def _gather_to_owners(
    engine: ShardedModule, plan: list[_Owned], states: dict[Any, Any], told: dict[int, list[str]]
) -> dict[int, _Swapped]:
    """Steps 2 and 3 of the module docstring: the owners' tensors become whole, the others' gradients ``None``."""
    group = engine.mesh.shard_group
    assert group is not None
    rank, size, device = group.rank(), group.size(), engine.device
    outgoing: list[list[Tensor]] = [[] for _ in range(size)]
    incoming: list[list[Tensor]] = [[] for _ in range(size)]
    assembled: list[tuple[_Owned, list[str], list[Tensor]]] = []
    for entry in plan:
        face, p = entry.face, entry.param
        state = states.get(face, {})
        keys = _row_keys(state, face, told)
        # In this order on every rank: the gradient (where there is one: the same ranks-wide), the rows, the state.
        mine = ([face.grad] if face.grad is not None else []) + [face.data] + [state[k] for k in keys]
        if entry.owner != rank:
            outgoing[entry.owner] += [_on(t, device) for t in mine if t.numel() > 0]
            continue
        wholes = [torch.empty(p.global_shape, dtype=t.dtype, device=device) for t in mine]
        pieces = [_pieces(p, w) for w in wholes]
        for q in range(size):
            if q != rank:
                incoming[q] += [ps[q] for ps in pieces if ps[q].numel() > 0]
        for ps, t in zip(pieces, mine):
            ps[rank].copy_(t.view_as(ps[rank]))
        assembled.append((entry, keys, wholes))
    collectives.exchange(outgoing, incoming, group, "whole-tensor optimizer gather").wait()
    swapped = {id(entry.face): _Swapped(entry.face.data, entry.face.grad) for entry in plan}
    for entry in plan:
        if entry.owner != rank:
            entry.face.grad = None  # the optimizer skips it here: its owner updates it
    for entry, keys, wholes in assembled:
        face = entry.face
        wholes = [_joined(entry.param, w).to(face.device) for w in wholes]
        grad = wholes.pop(0) if face.grad is not None else None
        face.data = wholes[0]
        face.grad = grad
        state = states.get(face, {})
        for key, whole in zip(keys, wholes[1:]):
            state[key] = whole
    return swapped


# Scatter #


def _scatter_from_owners(
    engine: ShardedModule, plan: list[_Owned], states: dict[Any, Any], swapped: dict[int, _Swapped],
    told: dict[int, list[str]],
) -> None:
    """Step 4 of the module docstring: every rank gets its rows of the updated parameter and state back."""
    group = engine.mesh.shard_group
    assert group is not None
    rank, size, device = group.rank(), group.size(), engine.device
    layouts = _state_layouts(plan, states, rank, group)
    for entry, layout in zip(plan, layouts):
        told[id(entry.face)] = sorted(key for key, kind, *_ in layout if kind == "rows")
    outgoing: list[list[Tensor]] = [[] for _ in range(size)]
    incoming: list[list[Tensor]] = [[] for _ in range(size)]
    finish: list[Callable[[], None]] = []
    for i, entry in enumerate(plan):
        face, p, held = entry.face, entry.param, swapped[id(entry.face)]
        layout = layouts[i]
        if entry.owner == rank:
            whole_param, state = face.data, states[face] if face in states else {}
            params = _pieces(p, _on(_part(p, whole_param), device))
            rows = {k: _pieces(p, _on(_part(p, state[k]), device)) for k, kind, *_ in layout if kind == "rows"}
            whole = {k: _on(state[k], device) for k, kind, *_ in layout if kind == "whole"}
            for q in range(size):
                if q != rank:
                    outgoing[q] += [t for t in [params[q], *(rows[k][q] for k in sorted(rows))] if t.numel() > 0]
                    outgoing[q] += [whole[k] for k in sorted(whole) if whole[k].numel() > 0]
            finish.append(_owner_finish(face, held, state, params[rank], {k: r[rank] for k, r in rows.items()}))
        else:
            local_rows = p.rows_held_by(rank)[1]
            param_rows = torch.empty_like(held.rows, device=device) if held.rows.device != device else held.rows
            new_rows = {k: torch.empty((local_rows, *p.row_shape), dtype=dtype, device=device)
                        for k, kind, _, dtype, _ in layout if kind == "rows"}
            new_whole = {k: torch.empty(shape, dtype=dtype, device=device)
                         for k, kind, shape, dtype, _ in layout if kind == "whole"}
            incoming[entry.owner] += [t for t in [param_rows, *(new_rows[k] for k in sorted(new_rows))]
                                      if t.numel() > 0]
            incoming[entry.owner] += [new_whole[k] for k in sorted(new_whole) if new_whole[k].numel() > 0]
            values = {k: value for k, kind, _, _, value in layout if kind == "value"}
            finish.append(_other_finish(face, held, states, param_rows, new_rows | new_whole, values))
    collectives.exchange(outgoing, incoming, group, "whole-tensor optimizer scatter").wait()
    for done in finish:
        done()


_Layout = list[tuple[str, str, torch.Size, torch.dtype, Any]]  # (key, "rows" | "whole" | "value", shape, dtype, value)


def _state_layouts(plan: list[_Owned], states: dict[Any, Any], rank: int, group: dist.ProcessGroup) -> list[_Layout]:
    """What each parameter's state holds after the step, as its owner tells it (one all-gather of small lists)."""
    mine: dict[int, _Layout] = {}
    for i, entry in enumerate(plan):
        if entry.owner != rank:
            continue
        layout: _Layout = []
        for key, value in sorted(states.get(entry.face, {}).items()):
            if isinstance(value, Tensor):
                kind = "rows" if value.dim() > 0 and value.shape == entry.face.shape else "whole"
                layout.append((key, kind, value.shape, value.dtype, None))
            else:
                layout.append((key, "value", torch.Size(), torch.float32, value))
        mine[i] = layout
    told: list[dict[int, _Layout] | None] = [None] * group.size()
    dist.all_gather_object(told, mine, group=group)
    layouts: dict[int, _Layout] = {}
    for part in told:
        layouts.update(part or {})
    return [layouts[i] for i in range(len(plan))]


def _owner_finish(
    face: nn.Parameter, held: _Swapped, state: dict[str, Any], param_rows: Tensor, state_rows: dict[str, Tensor]
) -> Callable[[], None]:
    def done() -> None:
        held.rows.copy_(param_rows.view_as(held.rows))
        face.data = held.rows
        face.grad = held.grad
        for key, rows in state_rows.items():
            state[key] = rows.to(face.device).clone()
    return done


def _other_finish(
    face: nn.Parameter, held: _Swapped, states: dict[Any, Any], param_rows: Tensor, tensors: dict[str, Tensor],
    values: dict[str, Any],
) -> Callable[[], None]:
    def done() -> None:
        state = states.setdefault(face, {})
        if param_rows is not held.rows:
            held.rows.copy_(param_rows)
        face.grad = held.grad
        state.clear()
        state.update({k: t.to(face.device) for k, t in tensors.items()} | values)
        if not state:  # as on the owner: no entry for a parameter without state
            states.pop(face, None)
    return done


# [Note: whole tensors under tensor parallelism]
# Under tensor parallelism a parameter's rows are rows of this column's tensor-parallel part. The owner first
# assembles the part from its shard group, then joins the parts over its tensor-parallel group (the plan's
# ``DTensor.full_tensor()``), runs the update on the whole tensor, and keeps its own part again before sending the
# rows back. The owner is chosen by the whole tensor's size and the parameter's position, so every rank of a
# tensor-parallel group owns the same parameters: the joins are collectives of owners only, in the same order.


def _joined(p: ShardedParam, part: Tensor) -> Tensor:
    """``part`` (shaped like this column's tensor-parallel part of ``p``) joined with the other columns' into the
    whole tensor; ``part`` itself without a split."""
    layout = p.tensor_parallel
    if layout is None or layout.shard_dim is None:
        return part
    return layout.face(part).full_tensor()


def _part(p: ShardedParam, whole: Tensor) -> Tensor:
    """This column's tensor-parallel part of ``whole`` (``_joined``'s inverse), contiguous."""
    layout = p.tensor_parallel
    if layout is None or layout.shard_dim is None:
        return whole
    dim = layout.shard_dim
    return whole.narrow(dim, layout.local_offset[dim], p.global_shape[dim]).contiguous()


def _on(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` contiguous on the device collectives run on (a copy only when it is elsewhere: offload)."""
    return tensor.to(device).contiguous()
