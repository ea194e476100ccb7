"""Wall-clock timing for the benchmarks: one warm-up call, then the median of repeated calls."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-call allocations and provider set-up are not what is measured
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bound_run_ms(session, binding, repeats: int, warmup: int = 3) -> float:
    """Mean ms of an onnxruntime session's run over IO-bound inputs and outputs (on the device: only the GPU's
    time and the launches are measured), after `warmup` runs."""
    for _ in range(warmup):
        session.run_with_iobinding(binding)
    binding.synchronize_outputs()
    start = time.perf_counter()
    for _ in range(repeats):
        session.run_with_iobinding(binding)
    binding.synchronize_outputs()
    return (time.perf_counter() - start) / repeats * 1e3
