"""``summon_full_params``: a sharded model's full weights in memory for the length of a ``with`` block.

    with summon_full_params(model):       # collective: every rank enters and leaves it
        logits = model(x)                  # a plain model now: no gathers, no collectives
        print(model.state_dict().keys())   # full tensors under their usual names

[Note: summon_full_params]
On entry every parameter is gathered in full, one tensor at a time (one all-gather each over the shard group, in
the parameter's own dtype: the fp32 master weights under mixed precision, not the compute dtype), into a new
``nn.Parameter`` that is put on every module holding the parameter, so tied weights stay one tensor under all their
names. The units are then ``UnitState.SUMMONED``: their hooks return at once, so the model runs as a plain module
(no gathers, no gradient reductions, no buffer broadcasts, no input casts: a forward computes in the parameters'
dtype unless autocast is on), and ``load_state_dict`` loads into the full tensors as into an unsharded model. The
shards, their gradients and the optimizer state are left as they are. On exit, with ``writeback``, each rank
copies its rows of what the modules hold then into its shards; the sharded faces go back on the modules and the
full tensors are dropped.

Entering is refused in the middle of a step: inside a forward (the units running it hold their gathered weights,
and their hooks count the calls) and between a forward with gradients and its backward (which needs the weights
autograd saved). Every rank runs the same step, so every rank refuses, before any collective.

With ``rank0_only``, the other ranks still take part in every all-gather (their shard group needs them) but drop
each tensor at once: they hold at most one gathered parameter at a time and keep their shards on the modules. A
forward there would gather with collectives that rank 0, running a plain model, never joins, so their modules
refuse to be called until the block ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_shard.engine.compile import outside_compiled_code
from lightning_shard.engine.parallel.tensor import local_tensor
from lightning_shard.engine.param_shard import ShardedParam, is_shard
from lightning_shard.engine.progress import about
from lightning_shard.engine.sharded_module import ShardedModule, sharded_module_of
from lightning_shard.engine.unit import BackwardState, UnitState

_SUMMONED: set[int] = set()  # ids of the engines inside summon_full_params, on every rank (rank0_only or not)


@contextmanager
def summon_full_params(
    module: nn.Module, *, writeback: bool = False, rank0_only: bool = False, offload_to_cpu: bool = False
) -> Iterator[None]:
    """Inside the block, ``module`` holds its full weights; on exit it is sharded again. Collective: every rank must
    enter and leave it.

    ``module`` is the sharded model: the module given to ``shard_model`` or to ``ShardStrategy`` (the
    LightningModule), or the one ``fabric.setup_module`` returned; a part of a sharded model is refused, and a module
    none of whose parameters is sharded is left as it is (FSDP's no-op). Inside the block every parameter is a full
    tensor under its usual name (``named_parameters()``, ``state_dict()``, tied weights one tensor), in the
    parameters' own dtype (the fp32 master weights under mixed precision) and with their ``requires_grad``; ``.grad``
    is ``None``. The model runs as a plain module: a forward, ``generate`` or an evaluation communicates nothing, so
    ranks may run different code (only rank 0 generating, say). Gradients computed inside land on the full tensors
    and are dropped on exit; the shards' gradients are left as they were. A checkpoint saved inside the block is
    written from the shards, without the block's changes.

    Args:
        writeback: on a normal exit (the block did not raise), write the full weights the modules hold then (edited
            in place, loaded with ``load_state_dict``, stepped by an optimizer) into the shards, each rank its own
            rows, so every rank must make the same changes, as with DDP. ``False`` (the default): changes are
            visible inside the block and discarded on exit.
        rank0_only: only global rank 0 holds the full weights; the other ranks keep their shards and may not call
            the model inside the block. Not with ``writeback``.
        offload_to_cpu: the full weights live in CPU memory (each gathered on the model's device and moved, so the
            device holds one parameter at a time); a forward then needs CPU inputs. Nothing changes on a CPU model.

    Memory: the full model, in the parameters' dtype, on every rank (on rank 0 only with ``rank0_only``; in CPU
    memory with ``offload_to_cpu``), beside the shards; plus one parameter's gathered copy on the ranks that drop
    them. See [Note: summon_full_params].
    """
    _check_flags(writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)
    engine = _engine_of(module)
    if engine is None:  # nothing of it is sharded: it holds its full weights already, as FSDP's no-op
        yield
        return
    _refuse_mid_step(engine)
    holds = not rank0_only or engine.mesh.rank == 0
    device = torch.device("cpu") if offload_to_cpu else engine.device
    refusals: list[RemovableHandle] = []
    _SUMMONED.add(id(engine))
    try:
        full = _gather_full_params(engine, device, keep=holds)
        if holds:
            _expose(engine, full)
        else:
            refusals = _refuse_calls(engine)
        del full  # the modules hold the full tensors now: nothing else keeps them alive after the block
        yield
        if writeback:
            _write_back(engine)
    finally:
        for handle in refusals:
            handle.remove()
        _put_shards_back(engine)
        _SUMMONED.discard(id(engine))


# Checks #


def _check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"summon_full_params({name}=...) must be True or False, got {value!r}.")
    if flags["rank0_only"] and flags["writeback"]:
        raise ValueError(
            "summon_full_params(rank0_only=True, writeback=True) is not supported: only rank 0 would hold the full"
            " weights, so the other ranks would have nothing to write into their shards. Use writeback=True with"
            " rank0_only=False."
        )


def _engine_of(module: nn.Module) -> ShardedModule | None:
    """The engine of ``module``, or of the module a wrapper holds as ``_forward_module`` (Fabric's set-up module);
    ``None`` for a module none of whose parameters is sharded. A part of a sharded model is refused."""
    engine = sharded_module_of(module) if isinstance(module, nn.Module) else None
    if engine is not None or (isinstance(module, nn.Module) and not any(map(is_shard, module.parameters()))):
        return engine
    raise TypeError(
        f"summon_full_params() needs the sharded model, not a {type(module).__name__}: the module given to"
        " ShardStrategy (the LightningModule), the one fabric.setup_module() returned, or the one given to"
        " shard_model(). A part of a sharded model cannot be summoned on its own: summon the whole model and use"
        " the part inside the block."
    )


def _refuse_mid_step(engine: ShardedModule) -> None:
    """Raise unless ``engine``'s model is between steps (see [Note: summon_full_params]); the same on every rank."""
    if id(engine) in _SUMMONED:
        raise RuntimeError(
            "summon_full_params() is already open on this model: the model holds its full weights until that block"
            " ends. Use the weights inside the open block instead of entering another one."
        )
    if any(unit._forward_depth > 0 for unit in engine.units):
        raise RuntimeError(
            "summon_full_params() was called inside a forward of the sharded model (from a forward hook, or from"
            " the model's own forward): the units running it hold their gathered weights. Enter it outside the"
            " forward: before it, or after its backward (e.g. in on_train_batch_end or on_validation_epoch_start)."
        )
    if any(unit.backward_state is BackwardState.PENDING or not unit.is_sharded for unit in engine.units):
        raise RuntimeError(
            "summon_full_params() was called between a forward with gradients and its backward: the weights that"
            " backward needs are gathered for it. Enter it after the backward (and the optimizer step), or run a"
            " forward that no backward follows under torch.no_grad()."
        )
    if engine.uninitialized:
        raise RuntimeError(
            "summon_full_params() would show parameters that hold uninitialised memory (built on the meta device"
            " and not loaded yet): " + ", ".join(engine.uninitialized.values()) + ". Load them first"
            " (load_state_dict() with full tensors, load_safetensors_into(), fabric.load_raw())."
        )


# Entry #


def _gather_full_params(engine: ShardedModule, device: torch.device, keep: bool) -> dict[int, nn.Parameter]:
    """Every parameter in full on ``device`` (``id(ShardedParam)`` -> tensor), gathered one at a time; with ``keep``
    false each is dropped as soon as it is gathered and nothing is returned. Collective."""
    full: dict[int, nn.Parameter] = {}
    # Normal tensors even under inference mode (a Lightning evaluation hook), so the block may edit them anywhere.
    with torch.no_grad(), torch.inference_mode(False):
        for unit in engine.units:
            with about(unit.name):  # a stalled gather names its unit
                for p in unit.params:
                    tensor = engine.gather_full(p, p.sharded.detach().to(device))  # on device
                    if keep:
                        face = tensor if p.tensor_parallel is None else p.tensor_parallel.face(tensor)
                        full[id(p)] = nn.Parameter(face, requires_grad=p.sharded.requires_grad)
                    del tensor  # freed here where nothing keeps it, not at the next gather
    return full


def _expose(engine: ShardedModule, full: dict[int, nn.Parameter]) -> None:
    """Put the full tensors on every module that holds each parameter, and let the hooks leave the units alone."""
    for unit in engine.units:
        for p in unit.params:
            for owner, name in p.owners:
                owner._parameters[name] = full[id(p)]
        unit.state = UnitState.SUMMONED


def _refuse_calls(engine: ShardedModule) -> list[RemovableHandle]:
    """Forward pre-hooks (run before the engine's) that refuse any call of the model on a rank without the full
    weights under ``rank0_only``."""
    rank = engine.mesh.rank

    def refuse(module: nn.Module, args: tuple) -> None:
        raise RuntimeError(
            f"Rank {rank} called the model inside summon_full_params(rank0_only=True): only global rank 0 holds the"
            " full weights there; this rank holds its shards, and its forward would wait for all-gathers that rank 0"
            " never joins. Call the model on rank 0 only inside the block (e.g. under `if trainer.is_global_zero:`),"
            " or use rank0_only=False."
        )

    hook = outside_compiled_code(refuse)
    return [m.register_forward_pre_hook(hook, prepend=True) for m in engine.root.modules()]


# Exit #


def _write_back(engine: ShardedModule) -> None:
    """Copy this rank's rows of what the modules hold into the shards; every parameter is checked first, so a
    refusal writes nothing."""
    held = [(p, _held_full(p)) for p in engine.sharded_params()]
    with torch.no_grad(), torch.inference_mode(False):
        for p, value in held:
            p.copy_rows_from_full(local_tensor(value.detach()))


def _held_full(p: ShardedParam) -> Tensor:
    """The full tensor the modules hold for ``p`` at the end of the block (a tensor assigned in its place counts)."""
    held = [owner._parameters.get(name) for owner, name in p.owners]
    first = held[0]
    if any(t is not first for t in held):
        raise RuntimeError(
            f"{', '.join(p.fqns)} are one tied parameter but hold different tensors at the end of"
            " summon_full_params(writeback=True), so there is no one value to write back. Change the tied"
            " parameter in place (or assign the same tensor under every name)."
        )
    if first is None or local_tensor(first).shape != p.global_shape:
        shape = "nothing" if first is None else f"shape {tuple(first.shape)}"
        raise RuntimeError(
            f"{p.fqn} holds {shape} at the end of summon_full_params(writeback=True), not the parameter's full shape"
            f" {tuple(p.global_shape)}, so it cannot be written into the shards. Keep each parameter's shape inside"
            " the block."
        )
    return first


def _put_shards_back(engine: ShardedModule) -> None:
    for unit in engine.units:
        if unit.state is UnitState.SUMMONED:
            for p in unit.params:
                p.expose_sharded()
            unit.state = UnitState.SHARDED
