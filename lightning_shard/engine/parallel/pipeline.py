"""Pipeline parallelism: the model's blocks split into ``P`` consecutive stages, one per pipeline rank, and each
call of the model run as ``M`` microbatches flowing from stage to stage.

Use it on a module before sharding it (``ShardStrategy(pipeline_parallel_size=P)`` does this for the Trainer and
Fabric)::

    split = StageSplit.of(model, is_block, P)      # which blocks each stage holds
    pipeline = Pipeline.install(model, split, ranks, "1F1B", microbatches=4, device=device)
    # model is now this stage: the other stages' modules are gone, and model(x) runs the schedule
    loss = loss_fn(model(x), y)                    # every rank gets the whole output, the same values
    loss.backward()                                # runs the schedule's backward over the stages

[Note: the user's forward runs on every stage]
A stage keeps its blocks and, on the first stage, the modules registered before the first block (embeddings), on
the last the ones after the last block (final norm, head). Every other module that holds parameters is replaced by
``SkippedModule``: a skipped block passes its first argument through, any other skipped module returns a 0-d zero.
Each microbatch runs the user's own ``forward`` on every stage: on stage ``s > 0`` the first block of the stage
takes the activation received from stage ``s - 1`` in place of its first argument (what the skipped modules before
it computed is thrown away), and on every stage but the last the output of its last block is what is sent on. So
the model needs no change, provided its blocks pass the hidden state from one to the next as their first argument
and first (or only) output, and nothing after the blocks reads a value computed before them other than through
them.

[Note: the whole output on every rank]
The last stage's output of each microbatch is concatenated along dim 0 and broadcast to every rank of its
pipeline group, where it comes back from ``model(x)`` as a leaf tensor: whatever the caller computes from it (a
Lightning ``training_step``'s loss, its logging) is the same value on every stage, the value the unsplit model
gives. The backward of that loss lands in the leaf's gradient; a hook on it runs the schedule's backward: the last
stage back-propagates each microbatch's slice of it, every stage sends its input gradients to the stage before.
``"gpipe"`` keeps each microbatch's graph from the forward and runs the backward afterwards. ``"1F1B"`` computes
the output without graphs, then in the backward re-runs each microbatch's forward in its one-forward-one-backward
slot (random state restored, so dropout draws the same masks), holding at most ``P - s`` microbatches' graphs on
stage ``s`` instead of ``M``: an extra forward in exchange for the loss seeing the whole output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable

from lightning_shard.engine.option_choices import PipelineSchedule
from lightning_shard.engine.parallel.pipeline_ranks import PipelineRanks
from lightning_shard.engine.parallel.pipeline_support import unsupported_blocks
from lightning_shard.engine.parallel.pipeline_ties import TiedAcrossStages, TiedParameter, ties_across_stages
from lightning_shard.engine.policies import WrapPolicy


class PipelineError(ValueError):
    """A model, a batch or a configuration that pipeline parallelism cannot split."""


# Stages #


@dataclass(frozen=True)
class StageSplit:
    """Which blocks each stage holds: stage ``s`` holds ``blocks[bounds[s]:bounds[s + 1]]`` (qualified names)."""

    blocks: tuple[str, ...]
    bounds: tuple[int, ...]

    @classmethod
    def of(cls, root: nn.Module, is_block: Callable[[nn.Module, str], bool], stages: int,
           split_points: list[str] | None = None) -> StageSplit:  # fmt: skip
        """The blocks of ``root`` (the outermost modules ``is_block`` selects, in registration order) in ``stages``
        consecutive groups: as even as possible (earlier stages take one more), or starting at each of
        ``split_points`` (names of blocks; stage 0 starts at the first block). Raises ``PipelineError`` naming what
        cannot be split."""
        blocks = tuple(name for name, _ in outermost_blocks(root, is_block))
        if not blocks:
            raise PipelineError(
                f"pipeline_parallel_size={stages} splits the model into stages of whole blocks, but no module of"
                f" {type(root).__name__} is a block by auto_wrap_policy. Pass auto_wrap_policy={{YourBlock}} (the"
                " class or class name of the transformer block)."
            )
        if len(blocks) < stages:
            raise PipelineError(
                f"pipeline_parallel_size={stages} needs at least {stages} blocks, one per stage, but"
                f" {type(root).__name__} has {len(blocks)} ({', '.join(blocks)}). Use a pipeline_parallel_size of at"
                f" most {len(blocks)}."
            )
        if split_points is None:
            base, extra = divmod(len(blocks), stages)
            sizes = [base + (1 if s < extra else 0) for s in range(stages)]
            bounds = [0]
            for size in sizes:
                bounds.append(bounds[-1] + size)
            return cls(blocks, tuple(bounds))
        unknown = [p for p in split_points if p not in blocks]
        if unknown or len(split_points) != stages - 1:
            raise PipelineError(
                f"pipeline_split_points={split_points} must name {stages - 1} blocks where stages 1..{stages - 1}"
                f" begin, in order; {'unknown: ' + ', '.join(unknown) + '; ' if unknown else ''}the blocks are"
                f" {', '.join(blocks)}."
            )
        starts = [blocks.index(p) for p in split_points]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise PipelineError(f"pipeline_split_points={split_points} must be increasing and after the first block.")
        return cls(blocks, (0, *starts, len(blocks)))

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def stage_blocks(self, stage: int) -> tuple[str, ...]:
        return self.blocks[self.bounds[stage] : self.bounds[stage + 1]]

    def to_json(self) -> dict[str, Any]:
        return {"blocks": list(self.blocks), "bounds": list(self.bounds)}


def outermost_blocks(root: nn.Module, is_block: Callable[[nn.Module, str], bool]) -> list[tuple[str, nn.Module]]:
    """The modules ``is_block`` selects that sit in no other selected module, in registration order."""
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}{name}"
            if is_block(child, qualified):
                found.append((qualified, child))
            else:
                visit(child, qualified + ".")

    visit(root, "")
    return found


class SkippedModule(nn.Module):
    """A module of another pipeline stage: see [Note: the user's forward runs on every stage]."""

    def __init__(self, name: str, is_block: bool) -> None:
        super().__init__()
        self.skipped = name
        self.is_block = is_block

    def hold(self, path: str, parameter: nn.Parameter) -> None:
        """Keep ``parameter`` at ``path`` (dotted, under this module) for a weight this stage shares with the
        stage that runs the module: see [Note: weights tied across stages]."""
        *containers, leaf = path.split(".")
        owner: nn.Module = self
        for name in containers:
            if not hasattr(owner, name):
                owner.add_module(name, nn.Module())
            owner = getattr(owner, name)
        owner.register_parameter(leaf, parameter)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_block and args:
            return args[0]
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        return torch.zeros((), device=tensors[0].device if tensors else None)

    def extra_repr(self) -> str:
        return f"{self.skipped!r} on another pipeline stage"


@dataclass(frozen=True)
class Stage:
    """What ``prune_to_stage`` leaves: the stage's first and last block, and the weights it shares with others."""

    first_block: nn.Module
    last_block: nn.Module
    ties: tuple[TiedParameter, ...]


def prune_to_stage(root: nn.Module, split: StageSplit, stage: int) -> Stage:
    """Replace, in ``root``, every module holding parameters or buffers that stage ``stage`` does not run with a
    ``SkippedModule`` (which keeps the weights this stage shares with it: see [Note: weights tied across stages] in
    ``pipeline_ties.py``).
    Raises ``PipelineError`` for a parameter or buffer held by ``root`` itself."""
    places: dict[str, int] = {}  # module name -> the stage that holds it
    parents: dict[str, tuple[nn.Module, str]] = {}
    seen_block = False

    def visit(module: nn.Module, prefix: str) -> None:
        nonlocal seen_block
        for name, child in module.named_children():
            qualified = f"{prefix}{name}"
            if qualified in split.blocks:
                seen_block = True
                places[qualified], parents[qualified] = _stage_of(split, qualified), (module, name)
            elif any(b.startswith(qualified + ".") for b in split.blocks):
                visit(child, qualified + ".")
            elif _holds_state(child):
                places[qualified] = split.stages - 1 if seen_block else 0
                parents[qualified] = (module, name)

    visit(root, "")
    loose = [n for n, _ in root.named_parameters(recurse=False)] + [n for n, _ in root.named_buffers(recurse=False)]
    if loose:
        raise PipelineError(
            f"{type(root).__name__} holds {', '.join(loose)} directly, which no pipeline stage can own: put them in"
            " a submodule (an embedding before the blocks, a head after them)."
        )
    ties = ties_across_stages(root, places)
    kept = {name: p for tie, p in ties if stage in tie.stages for name in tie.names}
    for name, held_by in places.items():
        if held_by != stage:
            parent, attr = parents[name]
            skipped = SkippedModule(name, is_block=name in split.blocks)
            for alias, p in kept.items():
                if alias.startswith(name + "."):
                    skipped.hold(alias[len(name) + 1 :], p)
            setattr(parent, attr, skipped)
    modules = dict(root.named_modules())
    stage_blocks = split.stage_blocks(stage)
    return Stage(modules[stage_blocks[0]], modules[stage_blocks[-1]], tuple(tie for tie, _ in ties))


def _stage_of(split: StageSplit, block: str) -> int:
    index = split.blocks.index(block)
    return next(s for s in range(split.stages) if split.bounds[s] <= index < split.bounds[s + 1])


def _holds_state(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


# Runtime #

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER = 10  # dtype code, ndim, up to 8 sizes; dtype code -1: the sender raised (see _refuse_everywhere)


@dataclass
class _Microbatch:
    args: tuple
    kwargs: dict
    rng: Tensor | None = None  # the CPU random state its first forward started from
    received: Tensor | None = None  # the activation from the stage before (a leaf, when it has a graph)
    output: Tensor | None = None


@dataclass
class Pipeline:
    """The schedule of one pipelined module: see [Note: the whole output on every rank]."""

    module: nn.Module
    ranks: PipelineRanks
    schedule: PipelineSchedule
    microbatches: int
    device: torch.device
    first_block: nn.Module
    last_block: nn.Module
    ties: TiedAcrossStages = field(default_factory=TiedAcrossStages)
    _batches: list[_Microbatch] = field(default_factory=list)
    _current: _Microbatch | None = None
    _captured: Tensor | None = None
    _inside: bool = False
    _sends: list[tuple[dist.Work, Tensor]] = field(default_factory=list)
    # Seconds this stage spent in its microbatches' forwards and backwards (not waiting for its neighbours), and
    # in the schedule's forward and backward altogether; host time (on a GPU, without synchronisation: what was
    # queued). The caller resets them (see ``measured_bubble``).
    busy_seconds: float = 0.0
    schedule_seconds: float = 0.0
    # What 1F1B's repeated forwards run under, as the first ran under the caller's step (context parallelism's)
    recompute_under: Callable[[], AbstractContextManager[Any]] = nullcontext

    @classmethod
    def install(cls, module: nn.Module, split: StageSplit, ranks: PipelineRanks, schedule: PipelineSchedule,
                microbatches: int, device: torch.device) -> Pipeline:  # fmt: skip
        """Prune ``module`` to this rank's stage and make each outermost call of it a run of the schedule. Raises
        ``PipelineError`` for a Hugging Face model (see ``pipeline_support.py``), before pruning anything."""
        if (unsupported := unsupported_blocks(module, split.blocks, split.stages)) is not None:
            raise PipelineError(unsupported)
        stage = prune_to_stage(module, split, ranks.stage)
        first, last = stage.first_block, stage.last_block
        pipeline = cls(module, ranks, schedule, microbatches, device, first, last, TiedAcrossStages(stage.ties))
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if pipeline._inside:
                return original(*args, **kwargs)
            return pipeline.run(args, kwargs)

        module.forward = forward  # type: ignore[method-assign]
        first.register_forward_pre_hook(pipeline._take_received, with_kwargs=True)
        last.register_forward_hook(pipeline._capture)
        return pipeline

    # Hooks: see [Note: the user's forward runs on every stage] #

    def _take_received(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._current is None or self._current.received is None:
            return None
        return (self._current.received, *args[1:]), kwargs

    def _capture(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._current is not None:
            self._captured = output[0] if isinstance(output, tuple) else output

    # Forward #

    def run(self, args: tuple, kwargs: dict) -> Tensor:
        """The whole output of the model on ``args``/``kwargs``, on every rank of the pipeline group."""
        start = time.perf_counter()
        try:
            return self._run(args, kwargs)
        finally:
            self.schedule_seconds += time.perf_counter() - start

    def _run(self, args: tuple, kwargs: dict) -> Tensor:
        self._wait_sends()
        self._batches = [_Microbatch(a, k) for a, k in split_microbatches(args, kwargs, self.microbatches)]
        grad = torch.is_grad_enabled()
        keeps_graphs = grad and self.schedule is PipelineSchedule.GPIPE
        outputs: list[Tensor] = []
        with torch.set_grad_enabled(keeps_graphs):
            for i, batch in enumerate(self._batches):
                batch.rng = torch.get_rng_state()
                out = self._forward_one(i, batch, keeps_graphs)
                if self.ranks.is_last:
                    outputs.append(out.detach())
        self._wait_sends()
        whole = self._broadcast_output(outputs)
        if not grad:
            self._batches = []
            return whole
        whole.requires_grad_(True)
        whole.register_post_accumulate_grad_hook(self._backward)
        return whole

    def _forward_one(self, index: int, batch: _Microbatch, graph: bool) -> Tensor:
        ranks = self.ranks
        if not ranks.is_first:
            batch.received = self._recv(ranks.global_ranks[ranks.stage - 1])
            if graph:
                batch.received.requires_grad_(True)
        self._current, self._captured, self._inside = batch, None, True
        start = time.perf_counter()
        try:
            out = self.module(*batch.args, **batch.kwargs)
        finally:
            self._current, self._inside = None, False
            self.busy_seconds += time.perf_counter() - start
        if not ranks.is_last:
            out = self._captured
            if not isinstance(out, Tensor):
                raise PipelineError(
                    f"The last block of pipeline stage {ranks.stage} ({type(self.last_block).__name__}) did not run"
                    " or returned no tensor: each stage's blocks must be called in the model's forward, each taking"
                    " and returning the hidden state."
                )
            self._send(out.detach(), ranks.global_ranks[ranks.stage + 1])
        elif not isinstance(out, Tensor):
            self._refuse_everywhere(type(out).__name__)
        if graph:
            batch.output = out
        return out

    def _broadcast_output(self, outputs: list[Tensor]) -> Tensor:
        src = self.ranks.global_ranks[-1]
        if self.ranks.is_last:
            whole = torch.cat(outputs).contiguous()
            dist.broadcast(_header(whole, self.device), src, group=self.ranks.group)
            dist.broadcast(whole, src, group=self.ranks.group)
            return whole.clone()
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src, group=self.ranks.group)
        whole = _empty_from(header, self.device)
        dist.broadcast(whole, src, group=self.ranks.group)
        return whole

    def _refuse_everywhere(self, found: str) -> None:
        """The last stage's output is no tensor: tell the other ranks (waiting for its broadcast), then raise."""
        header = torch.full((_HEADER,), -1, dtype=torch.int64, device=self.device)
        dist.broadcast(header, self.ranks.global_ranks[-1], group=self.ranks.group)
        raise PipelineError(_not_a_tensor(found))

    # Backward #

    def _backward(self, whole: Tensor) -> None:
        """Runs when the backward reaches the whole output: the schedule's backward (see [Note: the whole output
        on every rank])."""
        assert whole.grad is not None
        start = time.perf_counter()
        grads = list(torch.tensor_split(whole.grad, self.microbatches)) if self.ranks.is_last else []
        before = self.ties.gradients()
        with torch.enable_grad():
            if self.schedule is PipelineSchedule.GPIPE:
                for i in range(len(self._batches)):
                    self._backward_one(i, grads)
            else:
                self._one_forward_one_backward(grads)
        self._wait_sends()
        self._batches = []
        self.schedule_seconds += time.perf_counter() - start
        if self.ties.bound:  # once the engine has reduced every gradient of this backward (its callback runs first)
            Variable._execution_engine.queue_callback(lambda: self.ties.sum_gradients(before))

    def _one_forward_one_backward(self, grads: list[Tensor]) -> None:
        count, stage = len(self._batches), self.ranks.stage
        warmup = min(self.ranks.size - stage - 1, count)
        forwards = backwards = 0
        for _ in range(warmup):
            self._recompute(forwards)
            forwards += 1
        while forwards < count:
            self._recompute(forwards)
            forwards += 1
            self._backward_one(backwards, grads)
            backwards += 1
        while backwards < count:
            self._backward_one(backwards, grads)
            backwards += 1

    def _recompute(self, index: int) -> None:
        batch = self._batches[index]
        assert batch.rng is not None
        state = torch.get_rng_state()
        torch.set_rng_state(batch.rng)
        try:
            with self.recompute_under():
                self._forward_one(index, batch, graph=True)
        finally:
            torch.set_rng_state(state)

    def _backward_one(self, index: int, grads: list[Tensor]) -> None:
        batch, ranks = self._batches[index], self.ranks
        grad = grads[index] if ranks.is_last else self._recv(ranks.global_ranks[ranks.stage + 1])
        assert batch.output is not None
        start = time.perf_counter()
        torch.autograd.backward(batch.output, grad)
        self.busy_seconds += time.perf_counter() - start
        batch.output = None
        if not ranks.is_first:
            assert batch.received is not None
            received = batch.received.grad
            self._send(received if received is not None else torch.zeros_like(batch.received),
                       ranks.global_ranks[ranks.stage - 1])  # fmt: skip
            batch.received = None

    # Point to point: a header (dtype, shape), then the data #

    def _send(self, tensor: Tensor, dst: int) -> None:
        tensor = tensor.contiguous()
        header = _header(tensor, self.device)
        for sent in (header, tensor):
            work = dist.isend(sent, dst)
            assert work is not None  # this rank is in the default group
            self._sends.append((work, sent))

    def _recv(self, src: int) -> Tensor:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src)
        tensor = _empty_from(header, self.device)
        dist.recv(tensor, src)
        return tensor

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def _header(tensor: Tensor, device: torch.device) -> Tensor:
    if tensor.dim() > _HEADER - 2:
        raise PipelineError(f"An activation of {tensor.dim()} dimensions is more than a pipeline stage can send.")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64, device=device)


def _empty_from(header: Tensor, device: torch.device) -> Tensor:
    code, ndim, *sizes = header.tolist()
    if code < 0:
        raise PipelineError(_not_a_tensor("something other than a tensor"))
    return torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=device)


def _not_a_tensor(found: str) -> str:
    return (
        f"The pipelined model returned {found}; under pipeline parallelism its forward must return one tensor"
        " (the logits), which every stage receives. Compute the loss from it outside the model."
    )


def split_microbatches(args: tuple, kwargs: dict, microbatches: int) -> Iterator[tuple[tuple, dict]]:
    """``microbatches`` consecutive slices along dim 0 of every tensor of ``args``/``kwargs`` whose dim 0 is the
    batch size (that of the first tensor); other values are passed whole to each. Raises ``PipelineError`` when
    ``microbatches`` does not divide the batch size."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0]
    if not tensors:
        raise PipelineError("The pipelined model was called without a tensor argument to split into microbatches.")
    size = tensors[0].size(0)
    if size % microbatches:
        raise PipelineError(
            f"microbatches={microbatches} does not divide the batch size {size} that the model was called with:"
            f" each microbatch must hold the same number of samples. Use a batch size that is a multiple of"
            f" {microbatches} (drop_last=True in the DataLoader for a short last batch), or other microbatches."
        )
    step = size // microbatches
    for i in range(microbatches):
        cut = [leaf[i * step : (i + 1) * step] if isinstance(leaf, Tensor) and leaf.dim() > 0 and
               leaf.size(0) == size else leaf for leaf in leaves]  # fmt: skip
        yield tree_unflatten(cut, spec)


def measured_bubble(busy_seconds: float, seconds: float) -> float:
    """The share of ``seconds`` (a step, or the schedule's part of it) a stage spent outside its own microbatches'
    forwards and backwards."""
    return max(0.0, 1.0 - busy_seconds / seconds) if seconds > 0 and math.isfinite(busy_seconds) else 0.0


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage of a module: the schedule that runs it, the name of the submodule whose calls run it
    (``""``: the module), the split of the blocks over the stages (a checkpoint records it), and the block rule
    (also the units the stage is sharded by)."""

    pipeline: Pipeline
    prefix: str
    split: StageSplit
    blocks: WrapPolicy
