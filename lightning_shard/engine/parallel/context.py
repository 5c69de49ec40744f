"""Context parallelism: each batch's sequence split over ``C`` ranks, attention over the whole sequence, and the
loss of the whole sequence, with the user's module unchanged.

Use it around each step (``ShardStrategy(context_parallel_size=C)`` does this for the Trainer and Fabric)::

    cp = ContextParallel.of(device_mesh["context_parallel"])
    batch = cp.split(batch)          # every tensor of two or more dimensions, along dim 1
    with cp.step(model):             # attention and cross-entropy see the whole sequence
        loss = training_step(model, batch)
    loss.backward()

[Note: the causal load balance]
Under causal attention the last positions attend to the whole sequence and the first ones to almost nothing, so
contiguous parts would leave rank 0 idle while rank ``C - 1`` works. The sequence is cut into ``2C`` chunks and rank
``i`` takes chunks ``i`` and ``2C - 1 - i``: every rank gets one early and one late chunk, the same causal work.
``positions`` says which positions a rank holds; ``split`` takes exactly those of every sequence tensor of the batch
(inputs, targets, ``position_ids``, an attention mask of shape ``(B, S)``), so position ids stay those of the
whole sequence, and models that take them (Hugging Face's ``position_ids``, a rotary table indexed by them) place
each token where it is. A model that derives positions from the length it sees (``torch.arange(x.size(1))``) would
number the part from 0: ``attach`` refuses it (see [Note: positions and labels under context parallelism] in
``context_checks.py``); give it ``position_ids`` in the batch.

[Note: context-parallel ranks shard and reduce like data-parallel ones]
The engine shards each parameter over the ``D * C`` ranks of one tensor-parallel coordinate and averages the
gradients over all of them. That is exactly right when each rank back-propagates the mean loss of its own tokens:
the attention's all-to-alls carry gradient between the ranks of one sequence, so the ``C`` ranks' gradients sum to
``C`` times the gradient of that sequence's mean loss, and averaging over ``D * C`` ranks gives DDP's average over
the ``D`` data-parallel ranks. ``cross_entropy`` with ``reduction="mean"`` (``nn.CrossEntropyLoss`` included) is
replaced during ``step`` by the whole sequence's mean: the sum of this rank's token losses, summed over the group by
an all-reduce whose backward is the all-reduce of the gradients, divided by the group's count of counted targets
(``ignore_index`` and ``weight`` respected). Its value is what one rank would compute on the whole sequence, the
same on every context-parallel rank, and its gradient is the one above. Any other loss is each rank's part: its
gradients are still right when each rank holds as many counted tokens as the others, but the value logged is the
part's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from lightning_shard.engine.parallel.context_checks import ContextParallelError, StepChecks
from lightning_shard.engine.parallel.ulysses import ulysses_attention

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ContextParallel:
    """This rank's place in its context-parallel group and what a step under it does."""

    group: ProcessGroup
    size: int
    rank: int
    _orders: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, device_mesh: DeviceMesh) -> ContextParallel:
        """The context parallelism of a 1-D mesh (``device_mesh["context_parallel"]``)."""
        return cls(device_mesh.get_group(), device_mesh.size(), device_mesh.get_local_rank())

    # Batches: see [Note: the causal load balance] #

    def positions(self, seq_len: int, device: torch.device | None = None, rank: int | None = None) -> Tensor:
        """The positions of a ``seq_len`` sequence that ``rank`` (default: this rank) holds, in its order."""
        rank = self.rank if rank is None else rank
        chunk = seq_len // (2 * self.size)
        late = 2 * self.size - 1 - rank
        return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                          torch.arange(late * chunk, (late + 1) * chunk, device=device)])  # fmt: skip

    def split(self, batch: Any) -> Any:
        """``batch`` with every tensor of two or more dimensions cut to this rank's positions along dim 1 (the
        sequence); other tensors and values stay whole. All split tensors must have one sequence length, a multiple
        of ``2 * size``."""
        from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

        leaves, spec = tree_flatten_with_path(batch)
        sequences = [(keystr(path), leaf) for path, leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() >= 2]
        if not sequences:
            return batch
        lengths = {name: t.size(1) for name, t in sequences}
        seq_len = sequences[0][1].size(1)
        if len(set(lengths.values())) > 1:
            raise ContextParallelError(
                f"context_parallel_size={self.size} splits every batch tensor of two or more dimensions along dim 1,"
                f" the sequence, but they have different lengths there: {lengths}. Give every sequence tensor (inputs,"
                " targets, position_ids, an attention mask of shape (B, S)) the same length, and tensors that are no"
                " sequence fewer dimensions."
            )
        if seq_len % (2 * self.size):
            raise ContextParallelError(
                f"The sequence length {seq_len} of the batch (dim 1 of {sequences[0][0] or 'the batch'}) is not"
                f" divisible by 2 * context_parallel_size = {2 * self.size}: each of the {self.size} context-parallel"
                f" ranks takes two of {2 * self.size} equal chunks. Pad or cut sequences to a multiple of"
                f" {2 * self.size}."
            )
        index = {}

        def cut(t: Any) -> Any:
            if not isinstance(t, Tensor) or t.dim() < 2:
                return t
            if t.device not in index:
                index[t.device] = self.positions(seq_len, t.device)
            return t.index_select(1, index[t.device])

        return tree_unflatten([cut(leaf) for _, leaf in leaves], spec)

    # Steps #

    def attach(self, module: nn.Module) -> None:
        """Make every outermost call of ``module`` a step on a split batch: its arguments are ``split`` and it runs
        as under ``step`` (calls of ``module`` inside it, a LightningModule's ``self(x)`` in its ``training_step``,
        are part of that step). Replaces what an earlier ``attach`` on ``module`` did.

        A step that would number positions from this rank's part of the sequence (a Hugging Face model called
        without ``position_ids``, an embedding looked up at ``torch.arange`` of the part's length) or shift labels
        within it (a Hugging Face model called with ``labels``) raises ``ContextParallelError`` naming the module,
        before its output exists: see [Note: positions and labels under context parallelism] in
        ``context_checks.py``."""
        for handle in _ATTACHED.pop(module, ()):
            handle.remove()
        checks = StepChecks(self.size, self.group)
        hooks = _StepHooks(self, checks)
        _ATTACHED[module] = (
            module.register_forward_pre_hook(hooks.enter, with_kwargs=True),
            module.register_forward_hook(hooks.exit, always_call=True),
            *checks.install(module),
        )

    @contextmanager
    def step(self, module: nn.Module) -> Iterator[None]:
        """Run a step of ``module`` on a split batch: every ``scaled_dot_product_attention`` call attends over the
        whole sequence (see [Note: Ulysses attention] in ``ulysses.py``) and every ``cross_entropy`` with
        ``reduction="mean"`` is the whole sequence's (see [Note: context-parallel ranks shard and reduce like
        data-parallel ones]). Raises ``ContextParallelError`` after a step that called no attention."""
        mode = _StepMode(self)
        with mode:
            yield
        if mode.attention_calls == 0:
            raise ContextParallelError(_unreachable_attention(module, self.size))

    def _order(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(order, unorder)``: the index that puts the ranks' positions (concatenated in rank order) into
        sequence order, and its inverse."""
        key = (seq_len, device)
        if key not in self._orders:
            ranked = torch.cat([self.positions(seq_len, device, rank) for rank in range(self.size)])
            self._orders[key] = (torch.argsort(ranked), ranked)
        return self._orders[key]

    def attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        """``F.scaled_dot_product_attention`` over the whole sequence, on this rank's positions of each argument."""
        if attn_mask is not None:
            raise ContextParallelError(
                f"scaled_dot_product_attention got an attn_mask of shape {tuple(attn_mask.shape)} under"
                f" context_parallel_size={self.size}: a mask built from this rank's part of the sequence cannot"
                " describe the whole one. Use is_causal=True (or no mask); for right-padded sequences, mark the"
                " padded targets with ignore_index instead of masking them (Hugging Face: leave attention_mask out"
                " of the batch)."
            )
        if query.dim() != 4 or key.size(-2) != query.size(-2):
            raise ContextParallelError(
                f"scaled_dot_product_attention under context_parallel_size={self.size} takes (batch, heads,"
                f" sequence, head_dim) queries, keys and values of one length, got {tuple(query.shape)} and"
                f" {tuple(key.shape)}."
            )
        for name, heads in (("query", query.size(1)), ("key/value", key.size(1))):
            if heads % self.size:
                raise ContextParallelError(
                    f"The attention has {heads} {name} heads, which context_parallel_size={self.size} does not"
                    f" divide: each context-parallel rank attends with an equal share of the heads over the whole"
                    f" sequence. Choose a context_parallel_size that divides {heads}."
                )
        order, unorder = self._order(query.size(2) * self.size, query.device)
        return ulysses_attention(
            F.scaled_dot_product_attention, query, key, value, self.group, self.size, order, unorder,
            dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )  # fmt: skip

    def cross_entropy(
        self,
        input: Tensor,
        target: Tensor,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ) -> Tensor:
        """The mean cross-entropy over the whole sequence's counted targets, from this rank's part."""
        summed = F.cross_entropy(input, target, weight, ignore_index=ignore_index, reduction="sum",
                                 label_smoothing=label_smoothing)  # fmt: skip
        with torch.no_grad():
            counted = target != ignore_index
            if weight is None:
                count = counted.sum().to(summed.dtype)
            else:
                count = (weight[target.clamp(min=0)] * counted).sum().to(summed.dtype)
            dist.all_reduce(count, group=self.group)
        return _AllReduceSum.apply(summed, self.group) / count


class _AllReduceSum(torch.autograd.Function):
    """The sum over the group; its backward sums the gradients over the group (each rank's value feeds every
    rank's result)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _StepHooks:
    """The forward hooks ``attach`` registers: the outermost call splits its arguments and runs in a ``_StepMode``,
    which its forward hook leaves (also when the forward raised: ``always_call``)."""

    def __init__(self, context: ContextParallel, checks: StepChecks) -> None:
        self.context = context
        self.checks = checks
        self.depth = 0  # calls of the module in progress
        self.mode: _StepMode | None = None

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self.depth += 1
        if self.depth > 1:  # a call inside the step: its arguments are split already
            return None
        args, kwargs = self.context.split((args, kwargs))
        self.mode = _StepMode(self.context)
        self.mode.__enter__()
        self.checks.begin((args, kwargs))
        return args, kwargs

    def exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.depth -= 1
        if self.depth > 0 or self.mode is None:  # inside the step, or the split itself raised
            return
        mode, self.mode = self.mode, None
        self.checks.end()
        mode.__exit__(None, None, None)
        if mode.attention_calls == 0 and output is not None:  # None: the forward raised
            raise ContextParallelError(_unreachable_attention(module, self.context.size))


_ATTACHED: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CROSS_ENTROPY_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                       "label_smoothing")  # fmt: skip


class _StepMode(TorchFunctionMode):
    """Routes a step's attention and mean cross-entropy calls to ``ContextParallel``; everything else runs as it
    is (the mode is off inside its own handler, so the calls it makes run plainly)."""

    def __init__(self, context: ContextParallel) -> None:
        super().__init__()
        self.context = context
        self.attention_calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.attention_calls += 1
            return self.context.attention(**_bind(_SDPA_ARGS, args, kwargs))
        if func is F.cross_entropy:
            bound = _bind(_CROSS_ENTROPY_ARGS, args, kwargs)
            plain_mean = bound.pop("reduction", "mean") == "mean" and bound.pop("size_average", None) is None
            if plain_mean and bound.pop("reduce", None) is None and not bound["target"].is_floating_point():
                return self.context.cross_entropy(**bound)
        return func(*args, **kwargs)


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    return {**dict(zip(names, args)), **kwargs}


def _unreachable_attention(module: nn.Module, size: int) -> str:
    """Why a step with no attention call fails, naming the module most likely to hold the attention."""
    named = [(name, m) for name, m in module.named_modules() if "attention" in type(m).__name__.lower()
             or "attn" in type(m).__name__.lower()]  # fmt: skip
    where = (f"its attention module {named[0][0] or 'the root'} ({type(named[0][1]).__name__})" if named
             else f"{type(module).__name__}")  # fmt: skip
    return (
        f"context_parallel_size={size} splits the sequence over {size} ranks, but no"
        f" torch.nn.functional.scaled_dot_product_attention call ran in the step of {type(module).__name__}, so the"
        f" strategy cannot make the attention see the whole sequence: {where} computes attention itself. Call"
        " F.scaled_dot_product_attention in it (Hugging Face models: attn_implementation='sdpa')."
    )
