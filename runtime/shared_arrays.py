"""Arrays another process reads and writes in place: a file in shared memory (/dev/shm), mapped by both.

The media worker processes (runtime/pixel_workers.py) take decoded frames and give back pixel rows this way.
Through a pipe, a video's 55 MB of frames and 48 MB of rows would each be pickled, copied through the kernel and
unpickled by one thread of this process for every worker. The space is reserved when a block is made
(posix_fallocate), so a full /dev/shm (Docker's default is 64 MB) is an OSError here, not a SIGBUS in the middle
of a write.
"""

from __future__ import annotations

import itertools
import mmap
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALIGN = 64  # each array starts on a cache line
_names = itertools.count()


def shared_directory() -> str:
    """/dev/shm where there is one to write in (memory-backed); else the temporary directory."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class SharedHandle:
    """What another process needs to map a block's arrays: the file and each array's (offset, shape, dtype)."""

    path: str
    arrays: tuple[tuple[int, tuple[int, ...], str], ...]
    size: int


def _layout(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> tuple[list[tuple[int, tuple[int, ...], str]], int]:
    arrays, offset = [], 0
    for shape, dtype in specs:
        arrays.append((offset, tuple(int(n) for n in shape), np.dtype(dtype).str))
        offset += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
    return arrays, max(offset, ALIGN)


def _views(memory: mmap.mmap, handle: SharedHandle) -> list[np.ndarray]:
    """The block's arrays over `memory` (each keeps the mapping alive for as long as it lives)."""
    return [np.frombuffer(memory, dtype=np.dtype(dtype), count=int(np.prod(shape, dtype=np.int64)),
                          offset=offset).reshape(shape) for offset, shape, dtype in handle.arrays]


class SharedBlock:
    """Arrays in one shared file, zero-filled. `unlink` takes the file's name away: the memory is freed once this
    process's arrays and every other process's mapping are gone."""

    def __init__(self, handle: SharedHandle, arrays: list[np.ndarray]):
        self.handle = handle
        self.arrays = arrays

    @classmethod
    def create(cls, specs: Sequence[tuple[tuple[int, ...], np.dtype]], directory: str | None = None) -> SharedBlock:
        arrays, size = _layout(specs)
        path = os.path.join(directory or shared_directory(), f"systemone-{os.getpid()}-{next(_names)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)  # the pages now, or ENOSPC now
            else:
                os.ftruncate(fd, size)
            # Not MAP_POPULATE: on this project's machine, populating a 44 MB block took 15-23 ms where the first
            # read's page faults added about 3 ms to a read of 5 (a video's rows, written by another process).
            memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        handle = SharedHandle(path, tuple(arrays), size)
        return cls(handle, _views(memory, handle))

    def unlink(self) -> None:
        try:
            os.unlink(self.handle.path)
        except FileNotFoundError:
            pass


def remove_orphans(directory: str | None = None) -> int:
    """Delete the blocks of processes that are gone (a server killed mid-job leaves its blocks in /dev/shm);
    returns how many. A block whose process id is alive, or whose file is not ours, is left alone."""
    directory = directory or shared_directory()
    removed = 0
    for name in os.listdir(directory):
        prefix, _, rest = name.partition("-")
        pid = rest.partition("-")[0]
        if prefix != "systemone" or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's process: not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def attach(handle: SharedHandle) -> list[np.ndarray]:
    """Another process's block, mapped here for reading and writing."""
    fd = os.open(handle.path, os.O_RDWR)
    try:
        memory = mmap.mmap(fd, handle.size)
    finally:
        os.close(fd)
    return _views(memory, handle)
