"""Buffers are not sharded: every rank holds all of them. They are given values at set-up when built on the meta
device (see [Note: meta-device buffers]), synced at set-up and, during training, follow DDP (see [Note: buffers
follow DDP] on ``BufferSync``).

[Note: meta-device buffers]
A model built on the meta device has meta buffers too. Nothing loads a non-persistent buffer (a rotary
embedding's ``inv_freq``, a causal mask), so each must get its values from code at set-up:

- a module that owns meta-device parameters and has ``reset_parameters()`` gets storage for its meta buffers
  on its unit, just before that method runs and fills them (``ShardUnit.init_from_reset_parameters``), under
  ``param_init="reset_parameters"``;
- a module that owns no parameters but has ``reset_parameters()`` gets storage for its meta buffers on the
  device, then that method runs once, before any unit is materialised (``initialize_parameterless_buffers``).
  It runs under ``param_init="empty"`` as well: that setting spares the initialisation of parameters that a
  load will overwrite, and such a module has none;
- first of all, a buffer inside a Hugging Face ``transformers`` model that the model's own ``_init_weights``
  sets entirely (rotary ``inv_freq``, Gemma's ``embed_scale``, a causal mask) gets those values, under either
  ``param_init`` (see [Note: buffers transformers initialises] in transformers_buffers.py).

Any other meta buffer would never hold values: set-up refuses the model before anything is sharded, naming
each such buffer (``check_meta_buffers``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_shard.engine import collectives
from lightning_shard.engine.option_choices import ParamInit
from lightning_shard.engine.planning import initializer
from lightning_shard.engine.transformers_buffers import fill_buffers_transformers_initialises


def check_meta_buffers(root: nn.Module, param_init: ParamInit) -> list[tuple[str, nn.Module]]:
    """Give the meta buffers that ``transformers``' own initialisation sets their values; then return the modules
    owning no parameters (with their names) whose ``reset_parameters()`` fills their meta buffers. Raise
    ``TypeError`` naming every meta buffer that nothing would fill (see [Note: meta-device buffers])."""
    # On CPU, where the model computes them when built there; materialize_and_sync_buffers moves them to the device.
    left_by_transformers = fill_buffers_transformers_initialises(root, torch.device("cpu"))
    to_reset: list[tuple[str, nn.Module]] = []
    unfilled: list[str] = []
    for module_name, module in root.named_modules():
        meta = [name for name, buf in module._buffers.items() if buf is not None and buf.is_meta]
        if not meta:
            continue
        why = _why_unfilled(module, param_init)
        if why is not None and id(module) in left_by_transformers:
            why += f"; {left_by_transformers[id(module)]}"
        if why is None:
            if not any(p is not None for p in module._parameters.values()):
                to_reset.append((module_name, module))
            continue
        prefix = f"{module_name}." if module_name else ""
        unfilled += [f"{prefix}{name} ({type(module).__name__}: {why})" for name in meta]
    if unfilled:
        raise TypeError(
            "These buffers were built on the meta device and nothing gives them values: " + ", ".join(unfilled) + "."
            " Build them on a real device (inside the meta context too, e.g. self.register_buffer('mask',"
            " torch.ones(n, n, device='cpu').tril(), persistent=False)), or give the module a reset_parameters()"
            " that fills them (it runs at set-up)."
        )
    return to_reset


def _why_unfilled(module: nn.Module, param_init: ParamInit) -> str | None:
    """Why ``module``'s meta buffers would stay empty; ``None`` when its ``reset_parameters()`` will fill them."""
    if initializer(module) is None:
        return "no reset_parameters()"
    params = [p for p in module._parameters.values() if p is not None]
    if not params:
        return None  # initialize_parameterless_buffers runs it
    if not any(p.is_meta for p in params):
        return "its parameters are not on the meta device, so its reset_parameters() does not run"
    if param_init is ParamInit.EMPTY:
        return "param_init='empty' runs no reset_parameters() of modules that own parameters"
    return None  # the unit's materialisation runs it


def initialize_parameterless_buffers(modules: Iterable[tuple[str, nn.Module]], device: torch.device) -> None:
    """Give each of the named ``modules`` (owning no parameters) storage on ``device`` for its meta buffers and run
    its ``reset_parameters()`` to fill them (see [Note: meta-device buffers])."""
    with torch.no_grad():
        for module_name, module in modules:
            run_initializer(module, device, module_name)


def run_initializer(module: nn.Module, device: torch.device, module_name: str = "") -> None:
    """Give ``module``'s meta buffers storage on ``device`` and run its ``reset_parameters()`` (which must exist);
    a buffer it leaves on the meta device is refused, naming it."""
    for name, buf in module._buffers.items():
        if buf is not None and buf.is_meta:
            module._buffers[name] = torch.empty_like(buf, device=device)
    init = initializer(module)
    assert init is not None  # callers pass only modules that have one
    init()
    prefix = f"{module_name}." if module_name else ""
    still = [prefix + name for name, buf in module._buffers.items() if buf is not None and buf.is_meta]
    if still:
        raise TypeError(
            f"Buffers {', '.join(still)} of {type(module).__name__} are still on the meta device after its"
            " reset_parameters(): fill them there in place (self.buf.copy_(...)) or assign tensors built"
            " on a real device."
        )


def materialize_and_sync_buffers(
    root: nn.Module, device: torch.device, dtype: torch.dtype | None, group: ProcessGroup | None = None
) -> None:
    """Move buffers to ``device`` (floating ones to ``dtype``), and make every rank of ``group`` (``None``: all)
    hold its first rank's values.

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
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        _broadcast_from_rank0_coalesced(_unique_buffers(root.modules()), group)


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

    def __init__(self, root: nn.Module, world_size: int, group: ProcessGroup | None = None) -> None:
        """``group``: the ranks whose buffers agree, its first rank's (``None``: every rank, global rank 0's); under
        pipeline parallelism a stage's data-parallel ranks, each stage holding its own buffers."""
        self.enabled = True  # ShardStrategy(broadcast_buffers=...)
        self._group = group
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
        """Overwrite every buffer with the group's first rank's (collective; nothing with one rank or no buffers)."""
        if self._owners and self._world_size > 1:
            _broadcast_from_rank0_coalesced(_unique_buffers(self._owners), self._group)


def _unique_buffers(modules: Iterable[nn.Module]) -> list[Tensor]:
    """The buffers of ``modules`` (their own, not their children's), each tensor once."""
    seen: dict[int, Tensor] = {}
    for module in modules:
        for buf in module._buffers.values():
            if buf is not None:
                seen.setdefault(id(buf), buf)
    return list(seen.values())


def _broadcast_from_rank0_coalesced(buffers: list[Tensor], group: ProcessGroup | None = None) -> None:
    """Overwrite ``buffers`` on every rank of ``group`` (``None``: all) with its first rank's values: one broadcast
    per device, of every buffer's bytes packed into one flat ``uint8`` tensor, whatever their dtypes."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for buf in buffers:
        by_device.setdefault(buf.device, []).append(buf)
    is_source = torch.distributed.get_rank(group) == 0
    with torch.no_grad():
        for device, bufs in by_device.items():
            if is_source:
                flat = torch.cat([buf.reshape(-1).view(torch.uint8) for buf in bufs])
            else:
                flat = torch.empty(sum(buf.nbytes for buf in bufs), dtype=torch.uint8, device=device)
            collectives.broadcast_from_rank0(flat, group)
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
