"""Wall-clock timing for the benchmarks: one warm-up call, then the median of repeated calls."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

Way = TypeVar("Way")


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


def alternating_ms(ways: Sequence[Way], call: Callable[[Way, int], Callable[[], object]], repeats: int
                   ) -> dict[Way, np.ndarray]:
    """Each way's ms over `repeats` rounds after one warm-up round, the ways in turn, their order reversed every
    other round (so neither always runs first). `call(way, round)` sets the way up, untimed, and returns what is
    timed."""
    times: dict[Way, list[float]] = {way: [] for way in ways}
    for i in range(repeats + 1):
        for way in ways if i % 2 else ways[::-1]:
            run = call(way, i)
            start = time.perf_counter()
            run()
            if i:  # the first round is a warm-up
                times[way].append((time.perf_counter() - start) * 1e3)
    return {way: np.array(ms) for way, ms in times.items()}
