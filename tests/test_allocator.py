"""The server's allocator settings (server/allocator.py): a buffer the server frees goes back to the system, even
after glibc's dynamic mmap threshold has risen past its size (which, at the defaults, keeps it resident)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from systemone.local_server import rss_mb
from systemone.server.allocator import release_freed_memory
if sys.argv[1] == "on":
    assert release_freed_memory()
big = bytearray(16 << 20)
del big  # at glibc's defaults the mmap threshold now rises to 16 MiB
base = rss_mb()
blocks = [bytearray(8 << 20) for _ in range(40)]  # 320 MiB of decoded media, say
last = blocks[-1]
del blocks  # all freed but the last
print(int(rss_mb() - base))
"""


def retained_mib(setting: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_freed_buffers_leave_the_process():
    assert retained_mib("off") > 200  # the defaults keep what was freed resident
    assert retained_mib("on") < 32


REUSE_PROBE = """
import resource, sys, threading
import numpy as np
from systemone.server.allocator import release_freed_memory
assert release_freed_memory(trim_threshold=int(sys.argv[1]))
faults = []
def work():  # a media thread's working buffers: a few hundred KiB, again and again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(200):
        buffer = np.ones(512 << 7)  # 512 KiB
        del buffer
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(faults[0])
"""


def page_faults(trim_threshold: int) -> int:
    out = subprocess.run([sys.executable, "-c", REUSE_PROBE, str(trim_threshold)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


def test_buffers_under_the_mmap_threshold_are_reused_not_faulted_in_again():
    """With the heap's top trimmed at 128 KiB (what a fixed mmap threshold leaves), each 512 KiB buffer is faulted in
    afresh (128 pages); the server's trim threshold keeps it for the next one."""
    assert page_faults(128 << 10) > 200 * 50
    assert page_faults(16 << 20) < 200 * 5
