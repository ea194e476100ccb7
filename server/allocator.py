"""The serving process's allocator (glibc's malloc): freed request memory goes back to the system.

With glibc's defaults, a long-running server's RSS creeps: the mmap threshold rises to the size of the largest
buffer freed (up to 32 MiB), so decoded images, frames and graph tensors then come from the heap, where a freed
block in the middle stays resident; and each thread that allocates may get its own arena to fragment. A fixed
threshold maps every buffer of at least `mmap_threshold` on its own and unmaps it on free; two arenas bound the
fragmentation across the media and engine threads. On the 8-minute loopback soak (scripts/soak.py, tiny d3) this
halved the RSS after warm-up with the same latencies (README, "Bounds").
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters (malloc.h)
M_ARENA_MAX = -8


def release_freed_memory(mmap_threshold: int = 1 << 20, max_arenas: int = 2) -> bool:
    """Set glibc's mmap threshold and arena count for this process; False where the C library is not glibc (or
    refused a setting), and nothing changed."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_ARENA_MAX, max_arenas))
