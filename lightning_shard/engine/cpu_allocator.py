"""How the C allocator of a process training on CPU hands out and takes back large blocks.

[Note: the CPU allocator]
On Linux, glibc's ``malloc`` serves a block above its ``mmap`` threshold with a fresh ``mmap`` and returns it with
``munmap`` when freed. The threshold adapts to what the program frees, but never above 32 MiB. A training step on
CPU allocates many blocks above that which the engine does not own: autograd's gradient of every unsharded weight
(64 MiB for one ``Linear(2048, 8192)``), the optimizer's temporaries (AdamW's ``exp_avg_sq.sqrt()`` of each
shard), the activations of a large batch. Each is fresh pages every step; at a billion parameters the kernel spent
more time faulting and zeroing them (about 1.7 million page faults a rank a step) than the step spent computing.

With ``CpuAllocator.REUSE`` (the default) the engine raises the threshold to ``MMAP_THRESHOLD`` and keeps up to
``TRIM_THRESHOLD`` of free memory at the top of the heap, so those blocks are carved from the heap and, once freed,
reused by the next request of the step instead of going back to the kernel. The engine's own buffers come from its
pool either way (see [Note: the buffer pool]). What it costs: memory a step frees stays in the process (glibc can
reuse it for anything), so the resident size no longer drops between the peaks of a step; the peak itself moves
by what the heap cannot reuse exactly (measured in docs/benchmarks.md).

The settings are process-wide and made once, when the first module is sharded on a CPU (or with its shards in CPU
memory). They are left alone when the user chose the allocator's behaviour: any ``MALLOC_*_`` setting or
``glibc.malloc`` tunable in the environment, or a replacement allocator preloaded (jemalloc, tcmalloc, mimalloc).
``CpuAllocator.SYSTEM`` leaves them alone too. The C library must be glibc; elsewhere nothing is changed.
"""

from __future__ import annotations

import ctypes
import enum
import os
import platform

from lightning_shard.engine.option_choices import CpuAllocator

MMAP_THRESHOLD = 128 * 2**20  # blocks up to this size come from the heap (every weight gradient up to 32M entries)
TRIM_THRESHOLD = 256 * 2**20  # free memory at the top of the heap kept for the next request instead of returned

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3

_USER_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_REPLACEMENT_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


class AllocatorSetting(enum.Enum):
    """What ``apply_cpu_allocator`` found or did, for logs and tests."""

    APPLIED = "applied"  # this process's glibc malloc now reuses large blocks
    LEFT_AS_IS = "left as is"  # CpuAllocator.SYSTEM
    USER_CHOSEN = "chosen by the user"  # MALLOC_* variables, glibc tunables or a preloaded allocator
    UNSUPPORTED = "unsupported"  # the C library is not glibc, or mallopt refused


_applied: AllocatorSetting | None = None  # the outcome of the first REUSE request in this process


def apply_cpu_allocator(choice: CpuAllocator) -> AllocatorSetting:
    """Make the process's C allocator follow ``choice`` (once per process; later calls return the first outcome)."""
    global _applied
    if choice is CpuAllocator.SYSTEM:
        return AllocatorSetting.LEFT_AS_IS
    if _applied is None:
        _applied = _reuse_large_blocks()
    return _applied


def _reuse_large_blocks() -> AllocatorSetting:
    if _user_chose_allocator(os.environ):
        return AllocatorSetting.USER_CHOSEN
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return AllocatorSetting.UNSUPPORTED
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return AllocatorSetting.UNSUPPORTED
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mmap threshold first: a glibc that refuses it (older ones cap it at 32 MiB) changes nothing, whereas a
    # trim threshold set alone would turn the adaptive mmap threshold off and leave it at its 128 KiB start.
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return AllocatorSetting.UNSUPPORTED
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return AllocatorSetting.APPLIED


def _user_chose_allocator(environ: os._Environ[str] | dict[str, str]) -> bool:
    if any(name in environ for name in _USER_ENVIRONMENT):
        return True
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return True
    preload = environ.get("LD_PRELOAD", "")
    return any(name in preload for name in _REPLACEMENT_ALLOCATORS)

