"""The soak's memory sampler: a process's resident memory split by the kind of mapping that holds it, read from
/proc/PID/smaps, adds up to its RSS."""

from __future__ import annotations

import os

import numpy as np

from systemone.local_server import resident_by_mapping, rss_mb


def test_resident_memory_by_mapping_adds_up_to_the_rss_and_sees_a_new_buffer():
    before = resident_by_mapping(os.getpid())
    assert abs(sum(before.values()) - rss_mb()) < 8, (before, rss_mb())
    assert before["libraries"] > 0
    held = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, mapped on its own and touched
    after = resident_by_mapping(os.getpid())
    assert after["anonymous"] - before["anonymous"] > 60, (before, after)
    del held
