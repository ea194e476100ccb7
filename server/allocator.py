"""The serving process's allocator (glibc's malloc): freed request memory goes back to the system.

With glibc's defaults, a long-running server's RSS creeps: the mmap threshold rises to the size of the largest
buffer freed (up to 32 MiB), so decoded images, frames and graph tensors then come from the heap, where a freed
block in the middle stays resident; and each thread that allocates may get its own arena to fragment. A fixed
threshold maps every buffer of at least `mmap_threshold` on its own and unmaps it on free; two arenas bound the
fragmentation across the media and engine threads. On the 8-minute loopback soak (scripts/soak.py, tiny d3) this
halved the RSS after warm-up with the same latencies (docs/decisions/allocator.md).

Fixing the mmap threshold also fixes glibc's trim threshold at its 128 KiB default: every time the top of a heap
held more than that free, it was given back, and the next buffer there was faulted in afresh. Media preprocessing
works in buffers of a few hundred KiB, again and again, from many threads: on two cores the seeds' video took 31,500
page faults to preprocess (4.4 videos a second) against 340 at glibc's defaults (8.3). A heap now keeps up to
`trim_threshold` free at its top (16 MiB: at most 32 MiB over the two arenas), and buffers of 1 MiB and more are
still unmapped when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def release_freed_memory(mmap_threshold: int = 1 << 20, max_arenas: int = 2, trim_threshold: int = 16 << 20) -> bool:
    """Set glibc's mmap threshold, trim threshold and arena count for this process; False where the C library is
    not glibc (or refused a setting), and nothing changed."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    return (bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
            and bool(libc.mallopt(M_ARENA_MAX, max_arenas)))
