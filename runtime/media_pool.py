"""The threads that load media (fetch, decode, preprocess): a fixed number shared by every request
(--media-workers), apart from the threads that parse requests, so slow media servers can only make media wait.
Their pixel work (resizes, pixel rows) goes on to the pool's pixel workers: worker processes (--media-processes),
which the GIL does not hold back (runtime/pixel_workers.py).

Each distinct input of a request is one job (decision 6: the same URL twice is loaded once), run within the
request's deadline. When the deadline passes, or a job fails, the request's media batch is cancelled: fetches in
flight stop at once (their sockets are shut down) and queued jobs do nothing, so no media thread works on for a
request that has already been answered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from ..models.errors import TimedOut
from ..models.request import DecisionRequest
from .blas_threads import one_blas_thread
from .deadline import Deadline
from .media_allowance import MediaAllowance, MediaBudget
from .media_encoder import LoadedMedia, MediaEncoder
from .pixel_workers import PixelWorkers


class MediaPool:
    def __init__(self, workers: int = 8, budget: MediaBudget | None = None, processes: int = 0):
        if workers < 1:
            raise ValueError("the media pool needs at least one worker")
        self.workers = workers
        self.budget = budget or MediaBudget()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="systemone-media", initializer=one_blas_thread)
        self.pixels = PixelWorkers(processes)
        self._lock = threading.Lock()
        self.running = 0  # jobs loading now (shown in /metrics; 0 once every abandoned request's jobs stopped)
        self.queued = 0
        self.load_s = 0.0  # seconds spent in jobs, all threads together (/metrics)

    def _job(self, encoder: MediaEncoder[Any], key: Hashable, where: str, deadline: Deadline,
             allowance: MediaAllowance) -> Any:
        with self._lock:
            self.queued -= 1
            self.running += 1
        start = time.monotonic()
        try:
            deadline.check()  # the request was abandoned while this job waited for a thread
            return encoder.load_one(key, where, deadline, allowance, self.pixels)
        finally:
            with self._lock:
                self.running -= 1
                self.load_s += time.monotonic() - start

    def describe(self) -> str:
        pixels = (f"{self.pixels.processes} processes" if self.pixels.processes
                  else f"{self.pixels.thread_count} threads of this process")
        return f"{self.workers} threads fetch and decode, {pixels} make pixel rows"

    def start(self) -> None:
        """The worker processes started now rather than at the first media request."""
        self.pixels.start()

    def close(self) -> None:
        """Stop the threads and processes once their jobs are done (a server shutting down)."""
        self._executor.shutdown(wait=True)
        self.pixels.close()

    def _submit(self, encoder: MediaEncoder[Any], request: DecisionRequest, deadline: Deadline
                ) -> tuple[list[Hashable], dict[Hashable, Future], Deadline]:
        jobs = encoder.jobs(request)
        first: dict[Hashable, str] = {}
        for key, where in jobs:
            first.setdefault(key, where)
        futures = {}
        allowance = MediaAllowance(self.budget)  # one account per request
        batch = deadline.child()  # cancelled when a job fails: the others stop, the request goes on to answer
        for key, where in first.items():
            with self._lock:
                self.queued += 1
            futures[key] = self._executor.submit(self._job, encoder, key, where, batch, allowance)
        return [key for key, _ in jobs], futures, batch

    def _abandon(self, futures: dict[Hashable, Future], deadline: Deadline) -> None:
        for future in futures.values():
            if future.cancel():  # never started: its job will not run to count itself out
                with self._lock:
                    self.queued -= 1
        deadline.cancel()

    @staticmethod
    def _collect(keys: list[Hashable], futures: dict[Hashable, Future], deadline: Deadline) -> LoadedMedia[Any]:
        """Every job done: the items, or the first error in request order (a sibling's cut-short fetch is not
        the error the client needs to see)."""
        errors = [e for f in futures.values() if not f.cancelled() and (e := f.exception()) is not None]
        if errors:
            real = [e for e in errors if not isinstance(e, TimedOut)]
            raise (real or errors)[0]
        if any(f.cancelled() for f in futures.values()):
            raise deadline.error()
        return LoadedMedia(keys, {key: f.result() for key, f in futures.items()})

    def load(self, encoder: MediaEncoder[Any], request: DecisionRequest, deadline: Deadline | None = None
             ) -> LoadedMedia[Any]:
        """A request's media, loaded in the pool; the calling thread waits (the CLI, tests)."""
        return self.begin(encoder, request, deadline)()

    def begin(self, encoder: MediaEncoder[Any], request: DecisionRequest, deadline: Deadline | None = None
              ) -> Callable[[], LoadedMedia[Any]]:
        """A request's media jobs submitted to the pool; the function returned waits for them in the calling thread,
        which may do other work first."""
        deadline = deadline or Deadline()
        keys, futures, batch = self._submit(encoder, request, deadline)

        def result() -> LoadedMedia[Any]:
            _, pending = wait(futures.values(), timeout=deadline.timeout(), return_when=FIRST_EXCEPTION)
            if pending:
                self._abandon(futures, batch)
                wait(futures.values())
            return self._collect(keys, futures, deadline)

        return result

    async def load_async(self, encoder: MediaEncoder[Any], request: DecisionRequest, deadline: Deadline
                         ) -> LoadedMedia[Any]:
        """The same, awaited on the event loop: no thread waits for the jobs, and a cancelled task (the client
        went away) abandons them."""
        keys, futures, batch = self._submit(encoder, request, deadline)
        wrapped = [asyncio.wrap_future(f) for f in futures.values()]
        try:
            _, pending = await asyncio.wait(wrapped, timeout=deadline.timeout(), return_when=FIRST_EXCEPTION)
            if pending:
                self._abandon(futures, batch)
                await asyncio.wait(wrapped)
        except asyncio.CancelledError:
            self._abandon(futures, batch)
            raise
        finally:
            for future in wrapped:  # read here through `futures`; marked retrieved so asyncio does not log them
                if future.done() and not future.cancelled():
                    future.exception()
        return self._collect(keys, futures, deadline)
