"""Meta-device buffers of Hugging Face ``transformers`` models, given their values by the model's own initialisation.

[Note: buffers transformers initialises]
``AutoModelForCausalLM.from_config(config)`` under ``torch.device("meta")`` builds every buffer on the meta device,
and a checkpoint holds none of the non-persistent ones: a rotary embedding's ``inv_freq`` and ``original_inv_freq``
(Llama, Qwen2, Mistral, Gemma, Phi-3, Mixtral), Gemma's ``embed_tokens.embed_scale``, the causal-mask ``bias`` of
GPT-Neo's attention. transformers' own ``from_pretrained`` gives them values the same way for a model it builds on
the meta device: it gives each buffer storage, marks every tensor that already holds its values with the
``_is_hf_initialized`` flag, and runs the model's ``_init_weights`` (through ``initialize_weights``, with
``torch.nn.init`` guarded so that flagged tensors are left alone). ``_init_weights`` is where each model says what
its buffers hold (its rotary rule, its embedding scale, its mask), computed from the config as its constructor
computes them; we call it and recompute no formula of our own.

Set-up does the same, for the modules that hold meta buffers only (``fill_buffers_transformers_initialises``, on
CPU, where the model computes them when built there; set-up then moves every buffer to the device and broadcasts rank
0's): for each, the ``_init_weights`` of the nearest ``PreTrainedModel`` at or above it (the one transformers'
``initialize_weights`` would use) runs with every other tensor of that module flagged, so that no parameter is
initialised and no random number drawn for one (under ``param_init="empty"`` the load gives the parameters their
values; under ``"reset_parameters"`` the unit does). Not ``initialize_weights()`` itself: it visits every module of
the model and leaves each marked as initialised on the user's model; the step it repeats per module is the one used
here, where a meta buffer is. ``load_from_checkpoint`` (inference.py) gives the same values the same way.

One rule decides which buffers this covers, and nothing is guessed: ``_init_weights`` runs twice, once into storage
whose bytes are all 0x00 and once into storage whose bytes are all 0xFF, and a buffer counts as given its values only
when both runs leave the same bytes in every element. A buffer it does not write, or writes in part, keeps its meta
storage and is refused by ``check_meta_buffers`` in buffers.py, named, with ``_init_weights`` given as the reason; so
is every meta buffer of a module whose ``_init_weights`` raises. The buffers are tiny (a rotary table of
``head_dim / 2`` floats, a scalar, a mask), so the second run costs nothing that matters.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

_FLAG = "_is_hf_initialized"  # transformers' mark of a tensor that already holds its values
_PROBE_BYTES = (0x00, 0xFF)  # the two fills a covered buffer's values must not depend on


def fill_buffers_transformers_initialises(root: nn.Module, device: torch.device) -> dict[int, str]:
    """Give each meta buffer held inside a ``transformers`` model the values the model has when built on a real
    device, on ``device``, through the model's own ``_init_weights`` (see [Note: buffers transformers initialises]).

    Returns, by ``id`` of each module whose meta buffers (some or all) stay on the meta device, why: the refusal that
    follows names them. Without ``transformers`` loaded, or without a meta buffer in one of its models, returns ``{}``
    and touches nothing.
    """
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:  # transformers not imported: no module can be one of its models
        return {}
    left: dict[int, str] = {}
    filled: dict[int, Tensor] = {}  # id of a meta buffer -> its filled tensor, for a buffer several modules hold
    for owner, module in _modules_with_meta_buffers(root, modeling_utils.PreTrainedModel):
        for name, buf in module._buffers.items():  # one the first holder filled, taken by every other holder
            if buf is not None and id(buf) in filled:
                module._buffers[name] = filled[id(buf)]
        meta = {name: buf for name, buf in module._buffers.items() if buf is not None and buf.is_meta}
        if not meta:
            continue
        why = _fill_module(owner, module, meta, device)
        for name, buf in meta.items():
            now = module._buffers[name]
            if now is not None and not now.is_meta:
                filled[id(buf)] = now
        if why is not None:
            left[id(module)] = why
    return left


def _modules_with_meta_buffers(root: nn.Module, pretrained: type) -> Iterator[tuple[nn.Module, nn.Module]]:
    """(the ``PreTrainedModel`` whose ``_init_weights`` applies, the module) for each module holding a meta buffer
    inside a ``transformers`` model, in module order: the module itself when it is one, else its nearest ancestor
    that is, as ``initialize_weights`` dispatches."""
    stack: list[tuple[nn.Module, nn.Module | None]] = [(root, None)]
    seen: set[int] = set()
    while stack:
        module, owner = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, pretrained):
            owner = module
        if owner is not None and any(b is not None and b.is_meta for b in module._buffers.values()):
            yield owner, module
        stack.extend((child, owner) for child in reversed([c for c in module._modules.values() if c is not None]))


def _fill_module(owner: nn.Module, module: nn.Module, meta: dict[str, Tensor], device: torch.device) -> str | None:
    """Run ``owner._init_weights(module)`` into fresh storage for ``module``'s ``meta`` buffers, once per probe fill;
    keep the buffers it sets entirely and put the others back on the meta device. ``None`` when it set them all,
    else why not."""
    init_weights: Callable[[nn.Module], None] = owner._init_weights  # type: ignore[assignment]
    runs: list[dict[str, Tensor | None]] = []
    try:
        with _flagged([*module.parameters(), *module.buffers()]):  # before the probes: those stay unflagged
            for byte in _PROBE_BYTES:
                for name, buf in meta.items():
                    module._buffers[name] = _filled_with(byte, buf, device)
                with torch.no_grad(), _guarded_torch_init():
                    init_weights(module)
                runs.append({name: module._buffers[name] for name in meta})
    except Exception as err:  # a model's own initialisation failing leaves its buffers to the refusal
        for name, buf in meta.items():
            module._buffers[name] = buf
        return f"{type(owner).__name__}._init_weights raised {type(err).__name__}: {err}"
    unset = [name for name in meta if not _same_bytes(runs[0][name], runs[1][name])]
    for name in unset:
        module._buffers[name] = meta[name]
    if unset:
        return f"{type(owner).__name__}._init_weights does not set it"
    return None


def _filled_with(byte: int, like: Tensor, device: torch.device) -> Tensor:
    """A new contiguous tensor of ``like``'s shape and dtype on ``device``, every byte of it ``byte``."""
    out = torch.empty(like.shape, dtype=like.dtype, device=device)
    out.reshape(-1).view(torch.uint8).fill_(byte)
    return out


def _same_bytes(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether ``a`` and ``b`` are real tensors of one shape and dtype holding the same bytes (NaN included)."""
    if a is None or b is None or a.is_meta or b.is_meta or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


@contextlib.contextmanager
def _flagged(tensors: list[Tensor]) -> Iterator[None]:
    """Mark ``tensors`` as already initialised for transformers' guarded init functions; unmark on exit the ones
    this marked (a flag transformers set itself stays)."""
    marked = [t for t in tensors if not getattr(t, _FLAG, False)]
    for t in marked:
        setattr(t, _FLAG, True)
    try:
        yield
    finally:
        for t in marked:
            delattr(t, _FLAG)


def _guarded_torch_init() -> contextlib.AbstractContextManager[Any]:
    """transformers' ``guard_torch_init_functions()`` (``torch.nn.init`` leaves flagged tensors alone), as its
    ``initialize_weights`` runs ``_init_weights``; nothing where this transformers has none."""
    initialization = sys.modules.get("transformers.initialization")
    guard = getattr(initialization, "guard_torch_init_functions", None)
    return guard() if guard is not None else contextlib.nullcontext()
