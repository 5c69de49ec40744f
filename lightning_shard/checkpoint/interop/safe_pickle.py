"""Reading ``torch.save`` files (Lightning's ``.ckpt``, a DCP directory's ``meta.pt`` and its byte entries) without
ever running code from them, and telling them apart from other files by their first bytes (``is_pickle``,
``is_torch_zip``), so that a reader names such a file for what it is rather than reporting a damaged safetensors file.

[Note: no pickle runs]
A pickle is a program: unpickling an arbitrary one may call any function it names (``os.system``). These files are
read only with ``torch.load(weights_only=True)``, whose unpickler builds tensors, plain containers and numbers and
nothing else, widened here by exactly the types Lightning itself writes into a checkpoint (``lightning_types()``):
its ``AttributeDict`` of hyperparameters (read as a plain dict), ``pathlib`` paths, numeric numpy scalars and
arrays. Every other name a pickle refers to is refused before anything is built, with a ``CheckpointError`` that
names it. There is no switch to
unpickle in full: a checkpoint comes from a shared file system or the internet as often as from its own job, and
one that needs more than these types is converted once, where its origin is known (docs/troubleshooting.md).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_shard.checkpoint.format import CheckpointError

_MODULE_ALIASES = {"posix": "os", "nt": "os"}  # where os.system & co. pickle from
# torch.save writes a zip archive (since torch 1.6) holding a pickle; older files, and _use_new_zipfile_serialization
# =False, are a bare pickle, whose first byte is the PROTO opcode. A safetensors file starts with its header's length,
# a little-endian u64 that these bytes would make absurdly large.
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = b"\x80"


def is_pickle(path: Path) -> bool:
    """Whether the file at ``path`` starts as ``torch.save``'s output does (a zip archive or a pickle)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(_ZIP_MAGIC) or head[:1] == _PICKLE_PROTO


def is_torch_zip(path: Path) -> bool:
    """Whether ``path`` is a file that starts as the zip archive ``torch.save`` writes (the only archives
    ``load_restricted`` takes)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _ZIP_MAGIC
    except OSError:
        return False


def lightning_types() -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """The types beyond tensors and plain containers that Lightning writes into checkpoints, as
    ``torch.serialization.safe_globals`` takes them: a pair reads the type a name stands for as another type.

    ``AttributeDict`` (hyperparameters, as older Lightning releases saved them) is read as the plain ``dict`` it
    holds: the restricted reader fills only plain dicts, and a checkpoint's hyperparameters are data, used by name.
    """
    import importlib
    import pathlib

    import numpy as np

    multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
    attribute_dicts = ("lightning.fabric.utilities.data", "lightning.pytorch.utilities.parsing",
                       "pytorch_lightning.utilities.parsing", "lightning_fabric.utilities.data")
    return [
        *[(dict, f"{module}.AttributeDict") for module in attribute_dicts],
        pathlib.PosixPath,  # a path in hyperparameters or a callback's state
        pathlib.PurePosixPath,
        # a numpy number (np.float64(0.5)) or numeric array in a callback's state, written by numpy 1 or 2; an array's
        # elements are unpickled by this same restricted reader
        np.dtype,
        np.ndarray,
        *_numeric_dtype_classes(),
        *[(fn, f"numpy.{core}.multiarray.{name}") for fn, name in ((multiarray.scalar, "scalar"),
                                                                    (_empty_array_to_fill, "_reconstruct"))
          for core in ("core", "_core")],
    ]


def _empty_array_to_fill(subtype: Any, shape: Any, dtype: Any) -> Any:
    """numpy's ``_reconstruct`` as its own pickles call it: an empty array of shape ``(0,)``, whose state (shape,
    dtype and bytes, checked against each other by numpy) the pickle sets next. Any other shape would allocate what a
    few bytes of pickle claim (a 1 TiB array from 100 bytes), so it is refused."""
    import importlib

    import numpy as np

    if tuple(shape) != (0,):
        raise CheckpointError(
            f"the pickle asks numpy for an array of shape {tuple(shape)} before giving its data; numpy's own pickles"
            " ask for an empty one, so the file is crafted or damaged (nothing was allocated)"
        )
    multiarray = importlib.import_module("numpy._core.multiarray" if hasattr(np, "_core") else "numpy.core.multiarray")
    return multiarray._reconstruct(subtype, shape, dtype)


def _numeric_dtype_classes() -> list[type]:
    """numpy's dtype classes of booleans and numbers (numpy 1.25 and later pickle a dtype by its class)."""
    import numpy as np

    names = ("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Float16", "Float32",
             "Float64", "Complex64", "Complex128")
    dtypes = getattr(np, "dtypes", None)
    return [getattr(dtypes, f"{n}DType") for n in names if hasattr(dtypes, f"{n}DType")]


def load_restricted(source: Path | bytes, what: str, mmap: bool = False) -> Any:
    """``torch.load`` of ``source`` (a path, or the bytes of one ``torch.save``) admitting only tensors, plain
    containers and ``lightning_types()`` (see [Note: no pickle runs]). Tensors land on the CPU; with ``mmap`` (a path
    only) they stay memory-mapped, so only the bytes read from them are ever in memory. ``what`` names the source in
    errors. Raises ``CheckpointError`` naming every function or class the pickle refers to beyond those."""
    types = lightning_types()
    with torch.serialization.safe_globals(types):
        _refuse_unsafe_globals(source, what)
        if mmap and isinstance(source, Path):  # torch checks each record's size only when it reads it into memory
            _check_record_sizes(source, what)
        try:
            if isinstance(source, Path):
                return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
            return torch.load(io.BytesIO(source), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:  # refused while reading: a name the scan could not see, an opcode
            names, built = _names_in(str(err)), _BUILT_IN_ERROR.findall(str(err))
            if names or built:
                refusal = _refusal(what, names, "calls") if names else _refusal(what, built, "builds")
                raise CheckpointError(refusal) from None
            raise CheckpointError(
                f"{what} holds a pickle that torch.load(weights_only=True) refuses ({_refused_line(err)});"
                " lightning_shard never unpickles in full (see 'holds a pickle that calls' in docs/troubleshooting.md)."
            ) from None
        except CheckpointError as err:  # refused by one of the admitted functions
            raise CheckpointError(f"{what} is refused: {err}") from None
        except (RuntimeError, ValueError, EOFError, zipfile.BadZipFile, OSError, MemoryError) as err:
            raise CheckpointError(f"{what} cannot be read as a torch.save file: {_first_line(err)}") from None


def _check_record_sizes(path: Path, what: str) -> None:
    """Refuse a ``torch.save`` archive whose pickle claims a storage of another size than its record holds: a
    memory-mapped load would read the bytes of other records, or past the file, as that tensor's."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise CheckpointError(f"{what} holds {len(pickles)} data.pkl pickles; a torch.save archive holds one.")
            prefix = pickles[0][: -len("data.pkl")]
            sizes = {info.filename: info.file_size for info in archive.infolist()}
            claimed = _claimed_storages(archive.read(pickles[0]))
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(f"{what} is not a torch.save archive that can be read: {_first_line(err)}") from None
    for key, nbytes in claimed.items():
        record = f"{prefix}data/{key}"
        if sizes.get(record) != nbytes:
            raise CheckpointError(
                f"{what} is damaged: its pickle claims {nbytes} bytes for the storage {key!r}, whose record holds"
                f" {sizes.get(record, 'no')} bytes."
            )


def _claimed_storages(data: bytes) -> dict[str, int]:
    """The bytes the pickle ``data`` of a ``torch.save`` archive claims for each storage it refers to (its persistent
    ids ``("storage", <storage class>, key, location, numel)``), found by walking its opcodes: nothing is built or
    called."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    claimed: dict[str, int] = {}
    for op, arg, _ in pickletools.genops(data):
        if op.name == "MARK":
            marks.append(len(stack))
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
            memo[arg if op.name != "MEMOIZE" else len(memo)] = stack[-1] if stack else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo.get(arg))
        elif op.name == "GLOBAL":
            stack.append(_Global(str(arg).replace(" ", ".")))
        elif op.name == "STACK_GLOBAL":
            qualname, module = stack.pop(), stack.pop()
            stack.append(_Global(f"{module}.{qualname}"))
        elif op.name == "TUPLE":
            start = marks.pop()
            stack[start:] = [tuple(stack[start:])]
        elif op.name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(op.name[-1])
            stack[len(stack) - n :] = [tuple(stack[len(stack) - n :])]
        elif op.name == "BINPERSID":
            pid = stack.pop()
            if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
                claimed[str(pid[2])] = int(pid[4]) * _itemsize(pid[1])
            stack.append(None)
        elif op.arg is not None and not op.stack_before and len(op.stack_after) == 1:
            stack.append(arg)  # a literal: a string, a number
        else:  # anything else: what it takes off the stack, and a stand-in for what it puts there
            before = op.stack_before
            if pickletools.markobject in before:
                del stack[marks.pop() :]
                before = before[: before.index(pickletools.markobject)]
            del stack[len(stack) - len(before) :]
            stack.extend([None] * len(op.stack_after))
    return claimed


class _Global(str):
    """A global a pickle names, by its dotted name."""


def _itemsize(storage_class: Any) -> int:
    """The bytes of one element of the storage class a persistent id names (``torch.FloatStorage``: 4)."""
    name = str(storage_class).rpartition(".")[2]
    by_name = {storage: dtype for dtype, storage in torch.storage._dtype_to_storage_type_map().items()}
    if name == "UntypedStorage":
        return 1
    if name not in by_name:
        raise ValueError(f"a storage of the unknown class {storage_class}")
    return by_name[name].itemsize


def _refuse_unsafe_globals(source: Path | bytes, what: str) -> None:
    """Scan the pickle without running it; refuse it when it names anything that is not admitted."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(
            source if isinstance(source, Path) else io.BytesIO(source)
        )
    except (ValueError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, pickle.UnpicklingError) as err:
        raise CheckpointError(f"{what} is not a torch.save archive that can be read: {_first_line(err)}") from None
    if unsafe:
        raise CheckpointError(_refusal(what, sorted(unsafe)))


def _refusal(what: str, names: list[str], verb: str = "calls") -> str:
    shown = ", ".join(_display(n) for n in names)
    return (
        f"{what} holds a pickle that {verb} {shown}; refused. lightning_shard reads torch.save files only with"
        " torch.load(weights_only=True), admitting tensors, plain containers and the types Lightning writes"
        " (AttributeDict, pathlib paths, numeric numpy values), and never unpickles in full: a pickle can run any"
        " command. A checkpoint that needs other types must be rewritten with plain values where its origin is"
        " trusted (see 'holds a pickle that calls' in docs/troubleshooting.md)."
    )


def _display(name: str) -> str:
    module, _, attr = name.rpartition(".")
    alias = _MODULE_ALIASES.get(module)
    return f"{name} ({alias}.{attr})" if alias else name


_GLOBAL_IN_ERROR = re.compile(r"GLOBAL ([\w.]+)")
_BUILT_IN_ERROR = re.compile(r"but got <class '([\w.]+)'>")  # a type built through an admitted name (object arrays)


def _names_in(message: str) -> list[str]:
    return sorted(set(_GLOBAL_IN_ERROR.findall(message)))


def _refused_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if "nsupported" in line]
    return lines[0] if lines else "an unsupported construct"


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"
