"""Does media preprocessing scale over this machine's cores? The seeds' photo (1280x960) through `qwen_image` and
their video (20 frames of 1280x720) through `qwen_video` (resize, normalize, pixel rows), K at once: in threads sharing F frame threads (the server with
--media-processes 0), through P pixel worker processes as the server runs them by default (runtime/pixel_workers.py),
and in K bare processes of one thread each. Prints videos a second, CPU seconds per wall second (this process)
and page faults a video (scripts/results/gpu_media_scaling_h200.txt: on the H200's host threads stopped at 5-7
videos/s, about 2.7 cores, where 16 bare processes did 42-48).

    python scripts/media_scaling.py [server[:ARENAS] | default]
"""

from __future__ import annotations

import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from functools import cache
from typing import Any

import numpy as np


def setup(allocator: str) -> None:
    """This process's allocator (the server's, with ARENAS malloc arenas, or glibc's defaults) and one BLAS thread."""
    from systemone.runtime.blas_threads import one_blas_thread
    from systemone.server.allocator import release_freed_memory

    if allocator.startswith("server"):
        release_freed_memory(max_arenas=int(allocator.partition(":")[2] or 2))
    one_blas_thread()


@cache
def frames() -> tuple[np.ndarray, ...]:
    return tuple(np.random.default_rng(i).integers(0, 256, (720, 1280, 3), dtype=np.uint8) for i in range(20))


def one_video(pool: Any = None) -> tuple[int, int, int]:
    from systemone.runtime.d3.video import qwen_video

    return qwen_video(frames(), 16, 2, 2, (0.5,) * 3, (0.5,) * 3, pool)[1]  # pool: PixelWorkers or None


@cache
def photo() -> np.ndarray:
    return np.random.default_rng(99).integers(0, 256, (960, 1280, 3), dtype=np.uint8)


def one_image(pool: Any = None) -> tuple[int, int, int]:
    """The seeds' photo (1280x960: no resize, normalize and pixel rows only) as the d3 encoder makes its rows."""
    from systemone.runtime.d3.media import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS
    from systemone.runtime.image_transform import qwen_image

    return qwen_image(photo(), 16, 2, 2, (0.5,) * 3, (0.5,) * 3, IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS, pool)[1]


def in_process(_: int) -> tuple[int, int, int]:
    return one_video()


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from systemone.runtime.blas_threads import one_blas_thread
    from systemone.runtime.pixel_workers import PixelWorkers, default_processes

    allocator = sys.argv[1] if len(sys.argv) > 1 else "server"
    setup(allocator)
    print(f"{os.cpu_count()} CPUs, allocator {allocator}")
    one_video(), one_image()
    setups = [(f"threads: {n} frame threads", PixelWorkers(0, threads=n)) for n in (2, 8)]
    setups.append((f"pixel workers: {default_processes()} processes", PixelWorkers(default_processes())))
    for name, pool in setups:
        pool.start()
        for at_once in (1, 4, 16):
            with ThreadPoolExecutor(at_once, initializer=one_blas_thread) as outer:
                list(outer.map(lambda _: one_image(pool), range(at_once)))
                start = time.perf_counter()
                list(outer.map(lambda _: one_image(pool), range(5 * at_once)))
                wall = time.perf_counter() - start
            print(f"{name}, {at_once:2d} at once: {5 * at_once / wall:5.1f} photos/s", flush=True)
        for at_once in (1, 4, 16):
            with ThreadPoolExecutor(at_once, initializer=one_blas_thread) as outer:
                list(outer.map(lambda _: one_video(pool), range(at_once)))
                start, cpu, faulted = time.perf_counter(), time.process_time(), faults()
                list(outer.map(lambda _: one_video(pool), range(3 * at_once)))
                wall = time.perf_counter() - start
            print(f"{name}, {at_once:2d} at once: {3 * at_once / wall:5.1f} "
                  f"videos/s, cpu/wall {(time.process_time() - cpu) / wall:5.2f}, faults a video "
                  f"{(faults() - faulted) / (3 * at_once):.0f}", flush=True)
        pool.close()
    for at_once in (16,):
        with ProcessPoolExecutor(at_once, initializer=setup, initargs=(allocator,)) as processes:
            list(processes.map(in_process, range(at_once)))
            start = time.perf_counter()
            list(processes.map(in_process, range(3 * at_once)))
            wall = time.perf_counter() - start
        print(f"processes: {at_once:2d} at once, 1 thread each: {3 * at_once / wall:5.1f} videos/s", flush=True)


if __name__ == "__main__":
    main()
