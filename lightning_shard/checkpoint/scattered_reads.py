"""One system call reads a span of a file into many places: ``preadv`` given an ``iovec`` array that numpy builds.

``os.preadv`` takes a Python buffer per place, and a rank reading a checkpoint written by 1,024 ranks has ~100,000
small pieces to place (see [Note: checking pieces where they land]): a slice object each costs more than copying the
piece. Here the array of (address, length) pairs is a numpy array, shifted for the next file with one vectorised add,
and handed to the C library's ``preadv`` through ``ctypes``. Addresses are raw, so ``ScatteredRead`` checks every
place to lie inside its buffer before any read, and the buffers are kept alive with it.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

import numpy as np


def _libc_preadv() -> Any:
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        return None  # an iovec is then not two 64-bit words
    try:
        function = ctypes.CDLL(None, use_errno=True).preadv
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    function.restype = ctypes.c_ssize_t
    return function


_PREADV: Any = _libc_preadv() if os.name == "posix" else None
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
_IOV_ROWS_AT_ONCE = 2**16  # iovecs built in one numpy call (1 MiB): many files' at once when they have few places


def available() -> bool:
    """Whether this system's C library has ``preadv`` and ``ScatteredRead`` can call it."""
    return _PREADV is not None


def _joined(places: list[tuple[Any, int, int, int]]) -> list[tuple[Any, int, int, int]]:
    """``places`` with each run of places that continue one another in one buffer (same step) as one."""
    out: list[tuple[Any, int, int, int]] = []
    for place in places:
        if out:
            buffer, start, length, step = out[-1]
            if place[0] is buffer and place[3] == step and place[1] == start + length:
                out[-1] = (buffer, start, length + place[2], step)
                continue
        out.append(place)
    return out


class ScatteredRead:
    """Bytes ``[offset, offset + nbytes)`` of files alike into places that move by a fixed step from one file to the
    next: ``places`` are ``(buffer, start, length, step)``, in the order of their bytes in the file, each right after
    the one before; for the ``i``-th file, a place is ``buffer[start + i * step : start + i * step + length]``. Bytes
    to skip go to a place of step 0 (read, not kept)."""

    def __init__(self, places: list[tuple[Any, int, int, int]], count: int) -> None:
        for buffer, start, length, step in places:
            if start < 0 or length < 0 or step < 0 or start + (count - 1) * step + length > buffer.nbytes:
                raise ValueError("Internal error: a scattered read would write outside its buffer.")
        places = _joined(places)
        self._buffers = [buffer for buffer, _, _, _ in places]  # kept alive: the addresses point into them
        addresses = np.array([buffer.ctypes.data + start for buffer, start, _, _ in places], dtype=np.uint64)
        steps = np.array([step for _, _, _, step in places], dtype=np.uint64)
        lengths = np.array([length for _, _, length, _ in places], dtype=np.uint64)
        files = min(count, max(1, _IOV_ROWS_AT_ONCE // max(1, len(places))))  # files whose iovecs are built at once
        self._iov = np.empty((files, len(places), 2), dtype=np.uint64)  # struct iovec: address, length
        self._iov[:, :, 1] = lengths
        self._addresses, self._steps, self._built = addresses, steps, -files  # files built: _built.._built+files-1
        self._calls = [(row, min(_IOV_MAX, len(places) - row)) for row in range(0, len(places), _IOV_MAX)]
        self._wants = [int(lengths[row : row + rows].sum()) for row, rows in self._calls]
        self.count = count
        self.nbytes = sum(self._wants)

    def _iovecs(self, index: int) -> int:
        """The address of file ``index``'s iovecs, built with those of the files after it when not yet built."""
        files, places = self._iov.shape[0], self._iov.shape[1]
        if not self._built <= index < self._built + files:
            self._built = index
            upto = np.arange(index, index + files, dtype=np.uint64)[:, None]
            np.add(self._addresses, self._steps * upto, out=self._iov[:, :, 0])
        return int(self._iov.ctypes.data) + 16 * places * (index - self._built)

    def read(self, fd: int, index: int, offset: int) -> int:
        """Read file ``index``'s bytes from ``offset`` of ``fd`` into its places; how many were read (fewer: the file
        ends)."""
        if not 0 <= index < self.count:
            raise ValueError(f"Internal error: file {index} of a scattered read over {self.count}.")
        pointer, total = self._iovecs(index), 0
        for (row, rows), want in zip(self._calls, self._wants):
            got = _PREADV(fd, pointer + 16 * row, rows, offset + total)
            while got < 0 and ctypes.get_errno() == errno.EINTR:
                got = _PREADV(fd, pointer + 16 * row, rows, offset + total)
            if got < 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
            total += got
            if got != want:
                break
        return total
