"""What a context-parallel step refuses: a model that would number positions from its own part of the sequence, or
shift labels within it. ``ContextParallel.attach`` installs these checks; see [Note: positions and labels under
context parallelism].

[Note: positions and labels under context parallelism]
Each rank holds chunks ``i`` and ``2C - 1 - i`` of every sequence (see [Note: the causal load balance] in
``context.py``), so the positions a rank holds are never ``0..n-1`` for its part of length ``n``. A model is exact
under the split when it takes its positions from the batch (which ``split`` cuts with the tokens) and its loss from
targets shifted before the split. Two things would number or pair tokens within the part instead, silently; each is
refused in the step that would do it, before its output exists, so before the first optimizer step:

- A Hugging Face model (a ``transformers.PreTrainedModel``) called without ``position_ids`` counts them from 0 over
  the length it sees, and one called with ``labels`` shifts them by one inside the part. The call's own arguments say
  so: a forward pre-hook (with kwargs) on each Hugging Face model reads the outermost Hugging Face call of every
  step, at the cost of binding its arguments to the forward's signature.
- Any other model that looks an ``nn.Embedding`` up at exactly ``0..n-1`` along the last dimension, for a part of
  length ``n``: a learned position embedding indexed by ``torch.arange(x.size(1))``. No rank holds those positions,
  so such a lookup is positions numbered from the part. This compares values, so it runs only in the first step with
  gradients and the first without, and its verdict is agreed over the context-parallel group (one all-reduce per
  lookup of the part's length): every rank raises in the same lookup, and none is left waiting in the attention's
  all-to-all for a rank that raised.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from lightning_shard.engine.parallel.hugging_face import pretrained_model_class


class ContextParallelError(ValueError):
    """A batch, a model or an attention call that context parallelism cannot split."""


class StepChecks:
    """The checks of [Note: positions and labels under context parallelism] for one attached module: ``install``
    registers its hooks, ``begin`` and ``end`` bracket each step."""

    def __init__(self, size: int, group: ProcessGroup | None) -> None:
        self.size, self.group = size, group
        self.stepping = False
        self.length: int | None = None  # the length of this rank's part of the step's sequences
        self.compares = False  # whether this step compares embedding lookups
        self._compared: set[bool] = set()  # the grad modes of the steps that did
        self._hf_calls = 0  # Hugging Face calls in progress

    def install(self, module: nn.Module) -> list[RemovableHandle]:
        """Hook every Hugging Face model and every ``nn.Embedding`` in ``module``; the handles remove them."""
        pretrained = pretrained_model_class()
        handles = []
        for name, sub in module.named_modules():
            if pretrained is not None and isinstance(sub, pretrained):
                enter = functools.partial(self._enter_hf, name, inspect.signature(sub.forward))
                handles += [sub.register_forward_pre_hook(enter, with_kwargs=True),
                            sub.register_forward_hook(self._exit_hf, always_call=True)]  # fmt: skip
            elif isinstance(sub, nn.Embedding):
                handles.append(sub.register_forward_pre_hook(functools.partial(self._lookup, name)))
        return handles

    def begin(self, batch: Any) -> None:
        """A step on ``batch`` (this rank's part of it) starts."""
        self.stepping, self.length, self._hf_calls = True, _part_length(batch), 0
        grad = torch.is_grad_enabled()
        self.compares = self.length is not None and self.length > 1 and grad not in self._compared
        if self.compares:
            self._compared.add(grad)

    def end(self) -> None:
        self.stepping, self.length, self.compares = False, None, False

    # Hooks #

    def _enter_hf(self, name: str, signature: inspect.Signature, module: nn.Module, args: tuple,
                  kwargs: dict) -> None:  # fmt: skip
        self._hf_calls += 1
        if not self.stepping or self._hf_calls > 1:  # outside a step, or called by a Hugging Face model
            return
        missing = _hf_call_problems(signature, args, kwargs)
        if missing:
            raise ContextParallelError(_hf_message(module, name, missing, self.size))

    def _exit_hf(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._hf_calls -= 1

    def _lookup(self, name: str, module: nn.Module, args: tuple) -> None:
        index = args[0] if args else None
        if not self.compares or not isinstance(index, Tensor) or index.is_floating_point() or index.dim() == 0:
            return
        n = index.size(-1)
        if n != self.length:
            return
        local = (index == torch.arange(n, device=index.device)).all().to(torch.int32).reshape(1)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)  # every rank raises, or none
        if local.item():
            raise ContextParallelError(_embedding_message(module, name, n, self.size))


def _part_length(batch: Any) -> int | None:
    """The length (dim 1) of the first sequence tensor of a split batch: this rank's part of its sequences."""
    from torch.utils._pytree import tree_leaves

    return next((t.size(1) for t in tree_leaves(batch) if isinstance(t, Tensor) and t.dim() >= 2), None)


def _hf_call_problems(signature: inspect.Signature, args: tuple, kwargs: dict) -> list[str]:
    """Which of ``position_ids`` (missing) and ``labels`` (given) make a Hugging Face call number or shift within
    the part."""
    try:
        given = dict(signature.bind_partial(*args, **kwargs).arguments)
    except TypeError:  # the model's own call raises the error
        return []
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            given.update(given.pop(parameter.name, {}))
    problems = []
    if "position_ids" in signature.parameters and given.get("position_ids") is None:
        problems.append("position_ids")
    if given.get("labels") is not None:
        problems.append("labels")
    return problems


def _hf_message(module: nn.Module, name: str, problems: list[str], size: int) -> str:
    called, because, fixes = [], [], []
    if "position_ids" in problems:
        called.append("without position_ids")
        because.append("the model would number the positions of its part from 0 and place every token of it wrongly"
                       " (rotary or learned position embeddings)")  # fmt: skip
        fixes.append("Pass the whole sequence's positions from the batch: position_ids=position_ids, with"
                     " torch.arange(S).expand(B, S) in the batch (the strategy cuts it with the tokens), and an"
                     " attention_mask of ones.")  # fmt: skip
    if "labels" in problems:
        called.append("with labels=")
        because.append("its own loss would shift the labels within the part, pairing tokens across the boundaries"
                       " of the part's chunks")  # fmt: skip
        fixes.append("Shift the labels in the batch (targets = tokens[:, 1:]) and compute the loss from .logits with"
                     " F.cross_entropy in the step, which the strategy makes the whole sequence's.")  # fmt: skip
    where = f" ({name})" if name else ""
    return (
        f"{type(module).__name__}{where} was called {' and '.join(called)} under context_parallel_size={size}: each"
        f" rank holds chunks i and {2 * size - 1}-i of {2 * size} of every sequence, so {' and '.join(because)}."
        f" {' '.join(fixes)} See docs/context_parallel.md (Hugging Face models)."
    )


def _embedding_message(module: nn.Module, name: str, length: int, size: int) -> str:
    shape = " x ".join(str(s) for s in getattr(module, "weight", torch.empty(0)).shape)
    return (
        f"The embedding {name or 'module'} ({type(module).__name__} of {shape}) was looked up at positions"
        f" 0..{length - 1}, numbered from this rank's part of the sequence: under context_parallel_size={size} each"
        f" rank holds chunks i and {2 * size - 1}-i of {2 * size}, never the positions 0..{length - 1}, so a position"
        " embedding indexed by torch.arange(x.size(1)) places every token of the part wrongly. Take the positions"
        " from the batch: put position_ids = torch.arange(S).expand(B, S) in it (the strategy cuts it with the"
        f" tokens) and look {name or 'the embedding'} up at them."
    )
