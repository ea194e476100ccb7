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
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from ..models.errors import DecisionError, TimedOut
from ..models.request import DecisionRequest
from .blas_threads import one_blas_thread
from .deadline import Deadline
from .media_allowance import MediaAllowance, MediaBudget
from .media_encoder import LoadedMedia, MediaEncoder
from .pixel_workers import PixelWorkers

Drafted = TypeVar("Drafted")


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

    def load(self, encoder: MediaEncoder[Any], request: DecisionRequest, deadline: Deadline | None = None
             ) -> LoadedMedia[Any]:
        """A request's media, loaded in the pool; the calling thread waits (the CLI, tests)."""
        return self.begin(encoder, request, deadline).result()

    def begin(self, encoder: MediaEncoder[Any], request: DecisionRequest, deadline: Deadline | None = None
              ) -> MediaLoad:
        """A request's media jobs submitted to the pool; the caller waits for them later, in a thread or on the
        event loop, and may draft the request's prompts first."""
        deadline = deadline or Deadline()
        keys, futures, batch = self._submit(encoder, request, deadline)
        return MediaLoad(self, keys, futures, batch, deadline)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def media_error_first(draft_error: BaseException) -> bool:
    """Whether a request whose prompts failed to draft with `draft_error` waits for its media before that error is
    given. Media are read before the prompts are checked (spec 1.3 step 8), so when the draft fails on the request
    (a `DecisionError`), a media error, if any, is the one to give; a fault, or the client gone, stops the media
    instead."""
    return isinstance(draft_error, DecisionError)


class MediaLoad:
    """One request's media jobs in the pool: waited for in the calling thread (`result`) or on the event loop
    (`result_async`), or stopped (`cancel`). `with_draft` and `with_draft_async` draft the request's prompts while the
    media load, with `media_error_first` deciding what a failed draft does to them."""

    def __init__(self, pool: MediaPool, keys: list[Hashable], futures: dict[Hashable, Future], batch: Deadline,
                 deadline: Deadline):
        self._pool = pool
        self._keys = keys
        self._futures = futures
        self._batch = batch  # the jobs' own deadline: cancelled when one fails or the request stops them
        self._deadline = deadline
        self._cancelled = False

    def cancel(self) -> None:
        """Queued jobs never start and running ones stop (their fetches' sockets shut); returns at once. Only the
        first call does anything (a queued job is counted out of the pool's queue once)."""
        if not self._cancelled:
            self._cancelled = True
            self._pool._abandon(self._futures, self._batch)

    def _collect(self) -> LoadedMedia[Any]:
        """Every job done: the items, or the first error in request order (a sibling's cut-short fetch is not
        the error the client needs to see)."""
        futures = self._futures.values()
        errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
        if errors:
            real = [e for e in errors if not isinstance(e, TimedOut)]
            raise (real or errors)[0]
        if any(f.cancelled() for f in futures):
            raise self._deadline.error()
        return LoadedMedia(self._keys, {key: f.result() for key, f in self._futures.items()})

    def result(self) -> LoadedMedia[Any]:
        """The media, the calling thread waiting for them (the jobs stop at the request's deadline or the first
        failure)."""
        _, pending = wait(self._futures.values(), timeout=self._deadline.timeout(), return_when=FIRST_EXCEPTION)
        if pending:
            self.cancel()
            wait(self._futures.values())
        return self._collect()

    async def result_async(self) -> LoadedMedia[Any]:
        """The same, awaited on the event loop: no thread waits for the jobs, and a cancelled task (the client went
        away) stops them."""
        wrapped = [asyncio.wrap_future(f) for f in self._futures.values()]
        try:
            _, pending = await asyncio.wait(wrapped, timeout=self._deadline.timeout(), return_when=FIRST_EXCEPTION)
            if pending:
                self.cancel()
                await asyncio.wait(wrapped)
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            for future in wrapped:  # read in `_collect` or never (the task cancelled): asyncio must not log them
                future.add_done_callback(_retrieved)
        return self._collect()

    def with_draft(self, draft: Callable[[], Drafted]) -> tuple[Drafted, LoadedMedia[Any]]:
        """`draft()` run in the calling thread while the media load; then the draft and the media."""
        try:
            drafted = draft()
        except BaseException as error:
            if media_error_first(error):
                self.result()
            else:
                self.cancel()
            raise
        return drafted, self.result()

    async def with_draft_async(self, draft: Awaitable[Drafted]) -> tuple[Drafted, LoadedMedia[Any]]:
        """`with_draft` on the event loop: `draft` (a parsing thread's future, say) awaited while the media load."""
        try:
            drafted = await draft
        except BaseException as error:
            if media_error_first(error):
                await self.result_async()
            else:
                self.cancel()
            raise
        return drafted, await self.result_async()
