"""Where the pixel work of media runs: in worker processes (--media-processes), or in threads of this process.

A video's pixel work (each sampled frame resized, normalized and written into the vision graph's rows) is numpy in
many calls a frame, and every thread needs the GIL between them: on the H200's 16-core host, threads stopped at 5
to 7 videos a second with 2.7 cores busy, where 16 processes did 42 to 48 (scripts/results/
gpu_media_scaling_h200.txt). So a job's inputs and its output go through shared memory (runtime/shared_arrays.py)
and its parts (a video's frame pairs, a d1 image's rows of tiles) run in the processes. With no processes, or when
shared memory is full or a process died, the parts run in this process's threads, with the same results.

An image (a job of one input) that finds no other job running runs in threads here: with no other work the GIL
does not hold threads back, and the shared memory's page faults cost more than the work (on the H200 host the seeds'
photo made its rows in 6.7 ms in threads, 53 ms through the processes; at 4 at once 148 photos/s through the
processes, 89 in threads).

A job ends with its request: the request's deadline goes to the processes as a time (the monotonic clock is the
machine's) together with a cancel flag in shared memory, and a part looks at both between frames.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from .blas_threads import one_blas_thread
from .deadline import Deadline
from .shared_arrays import SharedBlock, SharedHandle, attach, remove_orphans

log = logging.getLogger("systemone.media")

# A job's work on its inputs, one part at a time: fill(inputs, out, part, stopped) writes the part's share of
# `out`, and returns early once stopped() says the request is gone. A module-level function (or a partial of one),
# so that a process can be sent it.
Fill = Callable[[Sequence[np.ndarray], np.ndarray, Any, Callable[[], bool]], None]

# Threads for parts run here, and for other per-frame work (JPEG frames decoded): a bound on this process's
# threads whatever the number of media jobs.
THREADS = min(8, os.cpu_count() or 1)
PARENT_CHECK_S = 0.5  # how often a worker process looks whether its server is still there


def default_processes() -> int:
    """All cores but two (the event loop and the engine thread keep theirs), at most 16; none below 6 cores, where
    threads, which reach about 2.7 cores, do as well without the copies (on 2 cores a video made its rows at 8.9 a
    second in 2 threads, 4.2 through one process: scripts/media_scaling.py)."""
    cores = os.cpu_count() or 1
    return min(16, cores - 2) if cores >= 6 else 0


def _start_process(parent: int) -> None:
    # Ctrl-C reaches the whole process group: the server shuts its workers down, they need not see it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    one_blas_thread()
    # A server killed outright (SIGKILL, the OOM killer) cannot shut its workers down, and a worker never sees its
    # task queue close (it holds the queue's writing end too): each leaves on its own once its parent is gone.
    threading.Thread(target=_leave_with, args=(parent,), name="systemone-parent-watch", daemon=True).start()


def _leave_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _run_part(fill: Fill, inputs: SharedHandle, output: SharedHandle, part: Any, end: float) -> None:
    """One part in a worker process, on the parent's shared arrays: the first input array is the cancel flag."""
    flag, *arrays = attach(inputs)
    (out,) = attach(output)
    fill(arrays, out, part, lambda: bool(flag[0]) or time.monotonic() > end)


def _nothing() -> None:
    pass


class PixelWorkers:
    def __init__(self, processes: int = 0, threads: int = THREADS, directory: str | None = None,
                 lone_images_here: bool = True):
        if processes < 0 or threads < 1:
            raise ValueError("pixel workers need at least one thread and no negative number of processes")
        self.processes = processes
        self.thread_count = threads
        self.directory = directory
        self.threads = ThreadPoolExecutor(threads, thread_name_prefix="systemone-frames", initializer=one_blas_thread)
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self.lone_images_here = lone_images_here
        self._running = 0
        self.in_processes = 0  # jobs that ran in the processes
        self.fallbacks = 0  # jobs that ran here because shared memory was full or a process died (/metrics)

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: a fork would copy this process's threads' locks (and a CUDA context) mid-use.
                self._pool = ProcessPoolExecutor(self.processes, multiprocessing.get_context("spawn"),
                                                 initializer=_start_process, initargs=(os.getpid(),))
            return self._pool

    def start(self) -> None:
        """Start every worker process now (each imports numpy and OpenCV once), so no request waits for that;
        first delete the shared blocks a killed server left behind."""
        if self.processes:
            removed = remove_orphans(self.directory)
            if removed:
                log.info("removed %d shared memory blocks of media jobs of servers that are gone", removed)
            executor = self._executor()
            for future in [executor.submit(_nothing) for _ in range(self.processes)]:
                future.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.threads.shutdown(wait=False, cancel_futures=True)

    def fill(self, fill: Fill, inputs: Sequence[np.ndarray], shape: tuple[int, ...], parts: Sequence[Any],
             deadline: Deadline, dtype: type = np.float32) -> np.ndarray:
        """A new array of `shape`, written by `fill` part by part, in the processes where there are any; raises
        the deadline's error once it has passed or the request was abandoned."""
        with self._lock:
            alone = self._running == 0
            self._running += 1
        try:
            if self.processes and not (alone and len(inputs) == 1 and self.lone_images_here):
                try:
                    executor = self._executor()
                    out = self._in_processes(executor, fill, inputs, shape, parts, deadline, dtype)
                    with self._lock:
                        self.in_processes += 1
                    return out
                except OSError as exc:
                    log.warning("a media job runs in threads: shared memory refused it (%s)", exc)
                except BrokenProcessPool:
                    log.warning("a media worker process died; a new pool starts, this job runs in threads")
                    self._replace_pool(executor)
                with self._lock:
                    self.fallbacks += 1
            return self._in_threads(fill, inputs, shape, parts, deadline, dtype)
        finally:
            with self._lock:
                self._running -= 1

    def _in_threads(self, fill: Fill, inputs: Sequence[np.ndarray], shape: tuple[int, ...], parts: Sequence[Any],
                    deadline: Deadline, dtype: type) -> np.ndarray:
        if len(parts) == 1:
            return fill_here(fill, inputs, shape, parts, deadline, dtype)
        out = np.empty(shape, dtype=dtype)
        list(self.threads.map(lambda part: fill(inputs, out, part, deadline.expired), parts))
        deadline.check()
        return out

    def _in_processes(self, executor: ProcessPoolExecutor, fill: Fill, inputs: Sequence[np.ndarray],
                      shape: tuple[int, ...], parts: Sequence[Any], deadline: Deadline, dtype: type) -> np.ndarray:
        source = SharedBlock.create([((1,), np.uint8)] + [(a.shape, a.dtype) for a in inputs], self.directory)
        try:
            target = SharedBlock.create([(shape, dtype)], self.directory)
        except BaseException:
            source.unlink()
            raise
        flag = source.arrays[0]
        try:
            for array, shared in zip(inputs, source.arrays[1:]):
                np.copyto(shared, array)
            timeout = deadline.timeout()
            end = time.monotonic() + (timeout if timeout is not None else 365 * 86400.0)
            futures = [executor.submit(_run_part, fill, source.handle, target.handle, part, end) for part in parts]
            if not _wait(futures, deadline):
                flag[0] = 1  # parts running stop at their next frame; those not started do nothing
                for future in futures:
                    future.cancel()
                raise deadline.error()
            for future in futures:
                future.result()  # a part's error (BrokenProcessPool where its process died)
        finally:
            source.unlink()
            target.unlink()
        return target.arrays[0]

    def _replace_pool(self, broken: ProcessPoolExecutor) -> None:
        """Drop `broken` (a worker of it died) so that the next job starts a new pool; another job that met the
        same death may have done so already."""
        with self._lock:
            if self._pool is not broken:
                return
            self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)


def fill_here(fill: Fill, inputs: Sequence[np.ndarray], shape: tuple[int, ...], parts: Sequence[Any],
              deadline: Deadline, dtype: type = np.float32) -> np.ndarray:
    """`PixelWorkers.fill` without workers: the parts one after the other in the calling thread."""
    out = np.empty(shape, dtype=dtype)
    for part in parts:
        fill(inputs, out, part, deadline.expired)
    deadline.check()
    return out


def _wait(futures: list[Future], deadline: Deadline) -> bool:
    """Whether every future finished before the deadline passed or was cancelled."""
    finished = threading.Event()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                finished.set()

    for future in futures:
        future.add_done_callback(one_done)
    unregister = deadline.on_cancel(finished.set)
    try:
        finished.wait(deadline.timeout())
    finally:
        unregister()
    return left[0] == 0 and not deadline.expired()
