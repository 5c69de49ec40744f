"""The sharding arguments both front ends take: declared once, and checked once.

``ShardArguments`` declares each argument of ``ShardStrategy`` for the ``Trainer`` and for ``Fabric`` besides
Lightning's own (accelerator, devices, cluster environment, precision, checkpoint IO) and each front end's few of
its own: its name, type, default and what the user reads about it. ``declare_shard_arguments`` makes them both
front ends' named constructor parameters and the ``Args`` section of their docstrings, so ``inspect.signature``,
``typing.get_type_hints``, jsonargparse and LightningCLI see the same arguments in both. ``ShardOptions.parse``
checks them when the strategy is constructed, on every rank, before any process group exists, so a bad value can
never leave a rank waiting in a collective.
"""

from __future__ import annotations

import inspect
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_deprecation
from torch import nn
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

from lightning_shard.checkpoint.io.storage import checked_storage_options
from lightning_shard.common.fsdp_compat import (
    FSDP_FLAG_MEANINGS,
    check_fsdp_flags,
    cpu_offload_flag,
    mixed_precision_from_torch,
    sharding_strategy_name,
)
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.option_choices import (
    CpuAllocator,
    GradSync,
    ParamInit,
    PipelineSchedule,
    SavedParameters,
    ShardingStrategy,
    ShardingStrategyName,
    StateDictType,
)
from lightning_shard.engine.policies import WrapPolicy, WrapPolicySpec, resolve_wrap_policy

DEFAULT_TIMEOUT = timedelta(minutes=10)  # long enough for a slow checkpoint write between two collectives, short
# enough that a stalled rank is named within minutes rather than after torch's 30 (gloo) or a silent hang

F = TypeVar("F", bound=Callable[..., Any])
S = TypeVar("S", bound=type)


def _argument(default: Any, doc: str) -> Any:
    """A declared argument: its default, and what the strategies' docstrings say of it."""
    return field(default=default, metadata={"doc": " ".join(doc.split())})


def _fsdp_flag(name: str) -> Any:
    return _argument(True, f"""taken for code written for ``FSDPStrategy``: ``True`` (default) is what ShardStrategy
        always does ({FSDP_FLAG_MEANINGS[name]}); ``False`` is refused.""")


@dataclass(frozen=True)
class ShardArguments:
    """The sharding arguments as the user passes them, declared once: each field is a keyword argument of both front
    ends' ``ShardStrategy`` with this name, annotation and default, documented by its ``metadata["doc"]``."""

    sharding_strategy: ShardingStrategyName | ShardingStrategy | TorchShardingStrategy = _argument("FULL_SHARD", """
        ``"FULL_SHARD"`` (default), ``"SHARD_GRAD_OP"``, ``"NO_SHARD"`` or ``"HYBRID_SHARD"`` (or the member of
        that name of ``lightning_shard.ShardingStrategy`` or of PyTorch's FSDP enum).""")
    auto_wrap_policy: WrapPolicySpec = _argument(None, """
        which modules become sharding units (gathered and reduced together): a set of module classes or class
        names (``{"GPT2Block"}``), a callable ``(module, name) -> bool``, or an int minimum parameter count;
        PyTorch FSDP's policies (``ModuleWrapPolicy``, ``functools.partial`` of ``size_based_auto_wrap_policy``...)
        select what FSDP would wrap. The root holds whatever no unit claims. ``None``: the whole model is one unit.
        Modules passed to PyTorch's ``wrap()`` in ``configure_model`` or under ``fabric.init_module()`` (or to
        ``lightning_shard.mark_unit``) are units as well, unwrapped (see [Note: manual units]).""")
    device_mesh: tuple[int, int] | None = _argument(None, """
        ``(replicas, shard_size)`` for ``"HYBRID_SHARD"``: shard inside groups of ``shard_size`` ranks, replicate
        across ``replicas`` groups. Default for ``"HYBRID_SHARD"``: ``(num_nodes, devices)``.""")
    mixed_precision: MixedPrecision | TorchMixedPrecision | None = _argument(None, """
        explicit dtypes (``MixedPrecision``, or PyTorch FSDP's, translated field by field) for gathering,
        computing and reducing; overrides what the Trainer's or Fabric's ``precision`` implies (``"bf16-mixed"``:
        gather and compute in bf16, reduce in fp32).""")
    activation_checkpointing_policy: WrapPolicySpec = _argument(None, """
        module classes or class names (as ``auto_wrap_policy``) whose activations are recomputed in backward
        instead of stored.""")
    activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = _argument(None, """
        deprecated, as in ``FSDPStrategy``: a module class or a list of them, taken as
        ``activation_checkpointing_policy`` with a deprecation warning.""")
    grad_sync: Literal["microbatch", "step"] | GradSync = _argument("microbatch", """
        for the micro-batches that do not end an accumulation window (the Trainer's ``accumulate_grad_batches`` >
        1; in Fabric, those run under ``fabric.no_backward_sync(model)``): ``"microbatch"`` (default)
        reduce-scatters after every micro-batch, keeping gradients sharded; ``"step"`` accumulates full gradients
        locally and reduces once per optimizer step (less communication, more memory).""")
    state_dict_type: Literal["sharded", "full"] | StateDictType = _argument("sharded", """
        ``"sharded"`` (default): checkpoints are directories where every rank writes its own rows in safetensors;
        ``"full"``: rank 0 streams the gathered model into one ``model.safetensors`` (and the optimizer into
        ``optimizer.safetensors``). Both load at any world size.""")
    save_trainable_only: bool = _argument(False, """
        checkpoints hold only the parameters that require grad (and every buffer) and their optimizer state: a
        LoRA fine-tune writes its adapters, not the frozen base. Resuming needs the frozen weights restored from
        where they came from (a pretrained import in ``configure_model`` or ``on_fit_start``, or after
        ``fabric.setup_module``): the checkpoint records a fingerprint of each weight it leaves out, and the first
        forward after the load raises, naming them, if they do not hold those values (see docs/user_guide.md,
        "Adapter-only checkpoints").""")
    cpu_offload: bool | CPUOffload = _argument(False, """
        keep parameter shards, gradients and optimizer state in CPU memory and run the optimizer step on the CPU;
        each unit's weights are uploaded to the GPU when it is gathered. Frees GPU memory at the cost of
        host-device copies every step. On a CPU device it changes nothing (a warning says so). PyTorch's
        ``CPUOffload(offload_params=...)`` stands for its flag.""")
    broadcast_buffers: bool = _argument(True, """
        as DDP's ``broadcast_buffers`` (``forward_sync_buffers``): ``True`` (default) overwrites every rank's
        buffers (BatchNorm statistics) with global rank 0's at the start of each forward that follows a training
        forward, in one broadcast; ``False`` leaves each rank's buffers to evolve from its own data. Either way all
        ranks start from rank 0's buffers when the model is set up.""")
    param_init: Literal["reset_parameters", "empty"] | ParamInit = _argument("reset_parameters", """
        how parameters built on the meta device (in ``configure_model``, or under
        ``fabric.init_module(empty_init=True)``) get their first values: ``"reset_parameters"`` (default) runs each
        module's ``reset_parameters()`` one unit at a time; ``"empty"`` leaves them uninitialised for pretrained
        weights loaded in ``on_fit_start`` or by ``fabric.load_raw`` to fill (no unit is materialised in full, so
        the import holds only this rank's shards); a forward before every such parameter is loaded raises naming
        the missing ones.""")
    cpu_allocator: Literal["reuse", "system"] | CpuAllocator = _argument("reuse", """
        what training on CPU does to the process's C allocator (glibc on Linux): ``"reuse"`` (default) keeps large
        freed blocks (autograd's weight gradients, optimizer temporaries) in the heap for the next request instead
        of returning them to the kernel, which at a billion parameters saved over a million page faults a step;
        ``"system"`` leaves the allocator as it is. Ignored when the environment already sets glibc's malloc
        (``MALLOC_*_``, ``GLIBC_TUNABLES``) or preloads another allocator.""")
    tensor_parallel_size: int = _argument(1, """
        ranks that split each layer by a tensor-parallel plan (default 1: none). With ``T > 1`` the strategy
        builds ModelParallelStrategy's ``("data_parallel", "tensor_parallel")`` mesh, ``strategy.device_mesh``
        (``self.device_mesh`` in ``configure_model``); apply the plan on its ``"tensor_parallel"`` dimension
        (``parallelize_module``, without ``fully_shard``) in ``configure_model``, or with Fabric in
        ``parallelize_fn``, and the strategy shards each rank's part over the data-parallel ranks (see
        docs/tensor_parallel.md).""")
    data_parallel_size: int | Literal["auto"] = _argument("auto", """
        ``"auto"`` (default): the world size divided by ``pipeline_parallel_size`` x ``context_parallel_size`` x
        ``tensor_parallel_size``; an int must make the product the world size.""")
    context_parallel_size: int = _argument(1, """
        ranks that split each batch's sequences (default 1: none). With ``C > 1`` the mesh is ``("data_parallel",
        "context_parallel", "tensor_parallel")`` (``strategy.device_mesh``), the ranks of one context-parallel
        group see the same batches and each keeps its part of every sequence tensor (dim 1 of every batch tensor
        of two or more dimensions, with the causal load balance), attention (``scaled_dot_product_attention``)
        sees the whole sequence, ``cross_entropy`` is the whole sequence's, and parameters shard over the data x
        context ranks (see docs/context_parallel.md).""")
    pipeline_parallel_size: int = _argument(1, """
        ``P > 1`` splits the model's blocks (by ``auto_wrap_policy``, or its longest list of repeated blocks)
        into ``P`` stages on consecutive groups of ranks, each sharded over its data-parallel ranks; every call of
        the model runs ``microbatches`` through the stages by ``pipeline_schedule`` and returns the whole output
        on every rank (see docs/pipeline_parallel.md). Default 1: none.""")
    pipeline_schedule: Literal["1F1B", "gpipe"] | PipelineSchedule = _argument("1F1B", """
        the order in which each stage runs its microbatches: ``"1F1B"`` (default; fewer activations held, one extra
        forward) or ``"gpipe"``.""")
    microbatches: int | None = _argument(None, """
        microbatches per call of the model under pipeline parallelism (default ``None``:
        ``pipeline_parallel_size``); must divide the batch size.""")
    pipeline_split_points: list[str] | None = _argument(None, """
        the names of the blocks where pipeline stages 1, 2... begin (default ``None``: as even as possible).""")
    process_group_backend: str | None = _argument(None, """
        ``"gloo"``, ``"nccl"`` or a per-device map such as ``"cpu:gloo,cuda:nccl"``; by default gloo for CPU and
        NCCL for CUDA.""")
    timeout: timedelta | None = _argument(None, """
        how long a rank waits for the others in any collective before it raises ``StalledRanksError`` naming the
        ranks that did not arrive and what it waited for. Default (``None``): 10 minutes.""")
    storage_options: dict[str, Any] | None = _argument(None, """
        fsspec options (a dict) for every checkpoint URL the strategy saves, loads or removes (``s3://...``:
        endpoint, credentials); a ``save_checkpoint(..., storage_options=...)`` call may give its own. Local paths
        take none. Default: the protocol's own configuration (environment variables).""")
    use_orig_params: bool = _fsdp_flag("use_orig_params")
    limit_all_gathers: bool = _fsdp_flag("limit_all_gathers")
    sync_module_states: bool = _fsdp_flag("sync_module_states")


_HINTS = typing.get_type_hints(ShardArguments)
_PARAMETERS = [
    inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=_HINTS[f.name])
    for f in fields(ShardArguments)
]


def _takes_shard_arguments(function: F, lightning_init: Callable[..., Any] | None = None) -> F:
    """Give ``function``, which takes the sharding arguments as ``**arguments``, the signature that names them: its
    own parameters, then each of ``ShardArguments`` as a keyword-only parameter with its annotation and default, as
    ``inspect.signature`` and ``typing.get_type_hints`` (and so jsonargparse and LightningCLI) read it. Its own
    parameters written without an annotation are Lightning's, annotated as ``lightning_init`` (the constructor of
    the Lightning strategy it extends) annotates them."""
    signature = inspect.signature(function)
    lightning_hints = typing.get_type_hints(lightning_init) if lightning_init is not None else {}
    own = [
        p.replace(annotation=lightning_hints[p.name]) if p.annotation is p.empty and p.name in lightning_hints else p
        for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    function.__signature__ = signature.replace(parameters=[*own, *_PARAMETERS])  # type: ignore[attr-defined]
    hints = {p.name: p.annotation for p in own if p.annotation is not p.empty}
    function.__annotations__ = {**hints, "return": None, **_HINTS}
    return function


def declare_shard_arguments(cls: S) -> S:
    """Class decorator of both front ends' ``ShardStrategy``: ``__init__`` takes the sharding arguments (see
    ``_takes_shard_arguments``), and the docstring documents them, in an ``Args`` section of its own or after the
    front end's own ``Args`` (then its last section)."""
    lightning_init = next(base.__dict__["__init__"] for base in cls.__mro__[1:] if "__init__" in base.__dict__)
    _takes_shard_arguments(cls.__dict__["__init__"], lightning_init)  # its own, not an inherited one
    text = inspect.cleandoc(cls.__doc__ or "")
    if "\nArgs:\n" not in text:
        text += "\n\nArgs:"
    for argument in fields(ShardArguments):
        text += "\n" + textwrap.fill(argument.metadata["doc"], 116, initial_indent=f"    {argument.name}: ",
                                     subsequent_indent=" " * 8, break_long_words=False, break_on_hyphens=False)
    cls.__doc__ = text + "\n"
    return cls


@dataclass(frozen=True)
class ShardOptions:
    """The checked sharding arguments of a ``ShardStrategy`` (``ShardArguments`` says what each is)."""

    sharding_strategy: ShardingStrategy
    wrap_policy: WrapPolicy | None
    device_mesh: tuple[int, int] | None
    mixed_precision: MixedPrecision | None
    checkpointing_policy: WrapPolicy | None
    grad_sync: GradSync
    state_dict_type: StateDictType
    saved_parameters: SavedParameters  # save_trainable_only: see [Note: weights a checkpoint leaves out]
    cpu_offload: bool
    broadcast_buffers: bool
    param_init: ParamInit
    cpu_allocator: CpuAllocator
    timeout: timedelta  # how long any rank waits in one collective before StalledRanksError
    process_group_backend: str | None
    storage_options: dict[str, Any] | None  # for checkpoint URLs
    tensor_parallel_size: int  # see [Note: the data-parallel ranks under tensor parallelism]
    data_parallel_size: int | None  # None: "auto", the world size / (pipeline x context x tensor_parallel_size)
    context_parallel_size: int  # see lightning_shard.engine.parallel.context
    pipeline_parallel_size: int  # see lightning_shard.engine.parallel.pipeline
    pipeline_schedule: PipelineSchedule
    microbatches: int  # per call of the model under pipeline parallelism
    pipeline_split_points: tuple[str, ...] | None  # None: blocks split evenly

    @classmethod
    @_takes_shard_arguments
    def parse(cls, **arguments: Any) -> ShardOptions:
        """Check every argument; raise ``TypeError``/``ValueError`` naming the argument and the valid values.

        PyTorch FSDP's forms of the arguments Lightning's ``FSDPStrategy`` takes (a ``ShardingStrategy`` member, a
        ``CPUOffload``, a ``MixedPrecision``, ``use_orig_params``/``limit_all_gathers``/``sync_module_states``) are
        translated where they mean exactly what ours do, and refused otherwise (``common.fsdp_compat``)."""
        unknown = sorted(arguments.keys() - _HINTS.keys())
        if unknown:
            raise TypeError(f"ShardStrategy.__init__() got an unexpected keyword argument {unknown[0]!r}")
        given = ShardArguments(**arguments)
        check_fsdp_flags(
            use_orig_params=given.use_orig_params,
            limit_all_gathers=given.limit_all_gathers,
            sync_module_states=given.sync_module_states,
        )
        checkpointing_policy = _checkpointing_policy(
            given.activation_checkpointing, given.activation_checkpointing_policy
        )
        cpu_offload = cpu_offload_flag(given.cpu_offload)
        mixed_precision = mixed_precision_from_torch(
            given.mixed_precision, has_wrap_policy=given.auto_wrap_policy is not None
        )
        if not isinstance(cpu_offload, bool):
            raise TypeError(
                f"cpu_offload must be True or False, got {cpu_offload!r} (PyTorch's CPUOffload(offload_params=...) is"
                " taken too)."
            )
        if not isinstance(given.save_trainable_only, bool):
            raise TypeError(f"save_trainable_only must be True or False, got {given.save_trainable_only!r}.")
        if not isinstance(given.broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be True or False, got {given.broadcast_buffers!r}.")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(
                "mixed_precision must be a lightning_shard.MixedPrecision (or None), or PyTorch FSDP's MixedPrecision;"
                f" got {type(mixed_precision).__name__}. For the usual cases pass a precision string instead"
                " (precision='bf16-mixed' on the Trainer or Fabric)."
            )
        strategy = ShardingStrategy.parse(sharding_strategy_name(given.sharding_strategy))
        context_parallel_size = _positive_int(given.context_parallel_size, "context_parallel_size")
        if context_parallel_size > 1 and checkpointing_policy is not None:
            raise ValueError(
                f"context_parallel_size={context_parallel_size} with activation checkpointing is not supported: the"
                " recomputation in backward runs the attention outside the step that makes it see the whole"
                " sequence. Drop activation_checkpointing_policy, or use context_parallel_size=1."
            )
        pipeline = _pipeline_options(given, strategy)
        return cls(
            sharding_strategy=strategy,
            wrap_policy=resolve_wrap_policy(given.auto_wrap_policy),
            device_mesh=_check_mesh_fits_strategy(_parse_device_mesh(given.device_mesh), strategy),
            mixed_precision=mixed_precision,
            checkpointing_policy=resolve_wrap_policy(checkpointing_policy, "activation_checkpointing_policy"),
            grad_sync=GradSync.parse(given.grad_sync),
            state_dict_type=StateDictType.parse(given.state_dict_type),
            saved_parameters=SavedParameters.TRAINABLE if given.save_trainable_only else SavedParameters.ALL,
            cpu_offload=cpu_offload,
            broadcast_buffers=given.broadcast_buffers,
            param_init=ParamInit.parse(given.param_init),
            cpu_allocator=CpuAllocator.parse(given.cpu_allocator),
            timeout=_parse_timeout(given.timeout),
            process_group_backend=_parse_backend(given.process_group_backend),
            tensor_parallel_size=_positive_int(given.tensor_parallel_size, "tensor_parallel_size"),
            data_parallel_size=None if given.data_parallel_size == "auto" else _positive_int(
                given.data_parallel_size, "data_parallel_size", "or 'auto'"
            ),
            context_parallel_size=context_parallel_size,
            storage_options=checked_storage_options(given.storage_options),
            **pipeline,
        )


def _pipeline_options(given: ShardArguments, sharding_strategy: ShardingStrategy) -> dict[str, Any]:
    """The pipeline arguments, checked: the stages are whole blocks by ``auto_wrap_policy`` (classes or names; none:
    the model's repeated blocks, found at set-up), and what pipeline parallelism does not compose with yet is
    refused, naming it. ``microbatches`` defaults to one per stage."""
    size = _positive_int(given.pipeline_parallel_size, "pipeline_parallel_size")
    schedule = PipelineSchedule.parse(given.pipeline_schedule)
    microbatches = size if given.microbatches is None else _positive_int(given.microbatches, "microbatches")
    split_points, auto_wrap_policy = given.pipeline_split_points, given.auto_wrap_policy
    if split_points is not None and not (
        isinstance(split_points, (list, tuple)) and all(isinstance(n, str) for n in split_points)
    ):
        raise TypeError(f"pipeline_split_points must be a list of block names, got {split_points!r}.")
    if size > 1:
        if sharding_strategy is ShardingStrategy.HYBRID_SHARD:
            raise ValueError(
                f"pipeline_parallel_size={size} with sharding_strategy='HYBRID_SHARD' is not supported yet: pipeline"
                " stages shard over their data-parallel ranks (FULL_SHARD, SHARD_GRAD_OP or NO_SHARD). See the"
                " composition table in docs/pipeline_parallel.md."
            )
        if isinstance(auto_wrap_policy, (int, bool)):
            raise ValueError(
                f"pipeline_parallel_size={size} splits the model into stages of whole blocks, which auto_wrap_policy"
                f" names; got {auto_wrap_policy!r}. Pass auto_wrap_policy={{YourBlock}} (the block class, or its"
                " name)."
            )
    return {"pipeline_parallel_size": size, "pipeline_schedule": schedule, "microbatches": microbatches,
            "pipeline_split_points": None if split_points is None else tuple(split_points)}  # fmt: skip


def _positive_int(value: object, name: str, other: str = "") -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"{name} must be a positive int{' ' + other if other else ''}, got {value!r}.")


def _parse_device_mesh(device_mesh: object) -> tuple[int, int] | None:
    """``(replicas, shard_size)`` as a tuple of two positive ints (whether it covers the world is checked at set-up,
    once the world size is known)."""
    if device_mesh is None:
        return None
    if (
        isinstance(device_mesh, (tuple, list))
        and len(device_mesh) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in device_mesh)
    ):
        return int(device_mesh[0]), int(device_mesh[1])
    raise ValueError(f"device_mesh must be a pair of positive ints (replicas, shard_size), got {device_mesh!r}.")


def _check_mesh_fits_strategy(
    device_mesh: tuple[int, int] | None, strategy: ShardingStrategy
) -> tuple[int, int] | None:
    """A ``device_mesh`` must describe what ``strategy`` does: only HYBRID_SHARD both shards and replicates (whether
    it covers the world is checked at set-up, once the world size is known)."""
    if device_mesh is None:
        return None
    replicas, shard_size = device_mesh
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and replicas != 1:
        raise ValueError(
            f"device_mesh={device_mesh} replicates across {replicas} groups, which only HYBRID_SHARD does;"
            f" use sharding_strategy='HYBRID_SHARD' or drop device_mesh."
        )
    if strategy is ShardingStrategy.NO_SHARD and shard_size != 1:
        raise ValueError(
            f"device_mesh={device_mesh} shards over {shard_size} ranks, but sharding_strategy='NO_SHARD' replicates"
            f" every parameter on every rank; use sharding_strategy='HYBRID_SHARD' or drop device_mesh."
        )
    return device_mesh


def _parse_timeout(timeout: object) -> timedelta:
    """A positive ``timedelta``; ``None`` is ``DEFAULT_TIMEOUT``."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta such as timedelta(minutes=10) (or None for the default of"
            f" {DEFAULT_TIMEOUT}), got {timeout!r}."
        )
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}.")
    return timeout


def _parse_backend(backend: object) -> str | None:
    """``None`` (gloo on CPU, NCCL on CUDA), a backend name torch knows, or a per-device map such as
    ``"cpu:gloo,cuda:nccl"``."""
    if backend is None:
        return None
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if isinstance(backend, str):
        names = [part.split(":", 1)[-1] for part in backend.split(",")] if ":" in backend else [backend]
        if names and all(name.strip().lower() in known for name in names):
            return backend
    raise ValueError(
        f"process_group_backend must be one of {', '.join(repr(b) for b in known)}, a per-device map such as"
        f" 'cpu:gloo,cuda:nccl', or None (gloo on CPU, NCCL on GPUs); got {backend!r}."
    )


def check_backend_for_device(backend: str, device_type: str) -> None:
    """Refuse, before the process group exists, a backend that cannot run on the strategy's devices."""
    if device_type == "cpu" and backend.strip().lower() == "nccl":
        raise ValueError(
            "process_group_backend='nccl' needs CUDA devices, but this ShardStrategy runs on the CPU. Use"
            " process_group_backend='gloo' (or None), or accelerator='gpu'."
        )


class ShardOptionsMixin:
    """The validated arguments as read-only attributes of a front end's strategy (``strategy.sharding_strategy``...)."""

    options: ShardOptions

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self.options.sharding_strategy

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        """The explicit ``mixed_precision`` argument (``None``: what the precision plugin implies)."""
        return self.options.mixed_precision

    @property
    def grad_sync(self) -> GradSync:
        return self.options.grad_sync

    @property
    def state_dict_type(self) -> StateDictType:
        return self.options.state_dict_type

    @property
    def cpu_offload(self) -> bool:
        return self.options.cpu_offload

    @property
    def broadcast_buffers(self) -> bool:
        return self.options.broadcast_buffers

    @property
    def param_init(self) -> ParamInit:
        return self.options.param_init

    @property
    def cpu_allocator(self) -> CpuAllocator:
        return self.options.cpu_allocator

    @property
    def tensor_parallel_size(self) -> int:
        return self.options.tensor_parallel_size

    @property
    def context_parallel_size(self) -> int:
        return self.options.context_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.options.pipeline_parallel_size


def _checkpointing_policy(
    activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None, policy: WrapPolicySpec
) -> WrapPolicySpec:
    """``activation_checkpointing_policy``, or the classes of FSDPStrategy's older ``activation_checkpointing`` (with
    FSDPStrategy's deprecation warning); both at once are refused as FSDPStrategy refuses them."""
    if activation_checkpointing is None:
        return policy
    if policy is not None:
        raise ValueError(
            "You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter."
        )
    classes = set(activation_checkpointing) if isinstance(activation_checkpointing, list | tuple | set) else {
        activation_checkpointing
    }
    rank_zero_deprecation(
        f"`ShardStrategy(activation_checkpointing={activation_checkpointing})` is deprecated, use "
        f"`ShardStrategy(activation_checkpointing_policy={classes})` instead."
    )
    return classes
