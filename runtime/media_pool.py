"""The threads that load media (fetch, decode, preprocess), shared by every request (--media-workers) and apart
from the threads that parse requests, so slow media servers can only make media wait. Media fetched over the
network have a lane of their own, beside the lane for inline (`data:`) and local media: fetches that wait on slow or
failing servers (and their retries' pauses) never hold back the media that need no network. One request runs at
most half a lane's threads at once, its other items waiting their turn, so no single request holds a lane. Their
pixel work (resizes, pixel rows) goes on to the pool's pixel workers: worker processes (--media-processes), which
the GIL does not hold back (runtime/pixel_workers.py). What the items being loaded hold is bounded per request
(`MediaAllowance`) and for the server (`ServerMedia`).

Each distinct input of a request is one job (decision 6: the same URL twice is loaded once), run within the
request's deadline. When the deadline passes, or a job fails, the request's media batch is cancelled: fetches in
flight stop at once (their sockets are shut down) and queued jobs do nothing, so no media thread works on for a
request that has already been answered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..models.errors import DecisionError, TimedOut
from ..models.request import DecisionRequest
from .blas_threads import one_blas_thread
from .deadline import Deadline
from .media_allowance import JobAllowance, MediaAllowance, MediaBudget, ServerMedia
from .media_encoder import LoadedMedia, MediaEncoder
from .pixel_workers import PixelWorkers

Drafted = TypeVar("Drafted")


@dataclass(eq=False)
class _Batch:
    """One request's media jobs: those not started yet (in request order), and how many run now."""

    encoder: MediaEncoder[Any]
    deadline: Deadline  # the jobs' own: cancelled when one fails or the request stops them
    allowance: MediaAllowance
    pending: deque[tuple[Hashable, str, Future]] = field(default_factory=deque)
    running: int = 0


class MediaPool:
    def __init__(self, workers: int = 8, budget: MediaBudget | None = None, processes: int = 0,
                 per_request: int | None = None):
        if workers < 1:
            raise ValueError("the media pool needs at least one worker")
        self.workers = workers
        # One request's jobs running at once: half the threads of a lane, so no one request holds a lane whole.
        self.per_request = per_request or max(1, workers // 2)
        self.budget = budget or MediaBudget()
        self.server = ServerMedia(self.budget)
        # Media fetched over the network wait on other servers (slow ones, failing ones and their retries' pauses):
        # they have threads of their own, so that inline and local media never queue behind them.
        self._remote = ThreadPoolExecutor(workers, thread_name_prefix="systemone-media-fetch",
                                          initializer=one_blas_thread)
        self._local = ThreadPoolExecutor(workers, thread_name_prefix="systemone-media", initializer=one_blas_thread)
        self.pixels = PixelWorkers(processes)
        self._lock = threading.Lock()
        self.running = 0  # jobs loading now (shown in /metrics; 0 once every abandoned request's jobs stopped)
        self.queued = 0
        self.running_by_lane = {"remote": 0, "local": 0}
        self.queued_by_lane = {"remote": 0, "local": 0}
        self.load_s = 0.0  # seconds spent in jobs, all threads together (/metrics)

    @property
    def saturated(self) -> bool:
        """Whether either lane has every thread busy and more jobs waiting (/ready)."""
        with self._lock:
            return any(self.running_by_lane[lane] >= self.workers and self.queued_by_lane[lane] > 0
                       for lane in self.running_by_lane)

    def _job(self, batch: _Batch, key: Hashable, where: str, future: Future, lane: str) -> None:
        if not future.set_running_or_notify_cancel():  # stopped while it waited (counted out of the queue then)
            self._next(batch)
            return
        with self._lock:
            self.queued -= 1
            self.queued_by_lane[lane] -= 1
            self.running += 1
            self.running_by_lane[lane] += 1
        start = time.monotonic()
        account = JobAllowance(batch.allowance, self.server)
        try:
            batch.deadline.check()  # the request was abandoned while this job waited for a thread
            future.set_result(batch.encoder.load_one(key, where, batch.deadline, account, self.pixels))
        except BaseException as exc:  # noqa: BLE001 - the request's waiter gets it
            future.set_exception(exc)
        finally:
            account.close()
            with self._lock:
                self.running -= 1
                self.running_by_lane[lane] -= 1
                self.load_s += time.monotonic() - start
            self._next(batch)

    def _next(self, batch: _Batch) -> None:
        """A job of `batch` ended: start its next ones, up to `per_request` running."""
        with self._lock:
            batch.running -= 1
        self._start(batch)

    def _start(self, batch: _Batch) -> None:
        starting = []
        with self._lock:
            while batch.pending and batch.running < self.per_request:
                key, where, future = batch.pending.popleft()
                if future.cancelled():
                    continue
                batch.running += 1
                starting.append((key, where, future))
        for key, where, future in starting:
            lane = "remote" if batch.encoder.remote(key) else "local"
            executor = self._remote if lane == "remote" else self._local
            executor.submit(self._job, batch, key, where, future, lane)

    def describe(self) -> str:
        pixels = (f"{self.pixels.processes} processes" if self.pixels.processes
                  else f"{self.pixels.thread_count} threads of this process")
        return (f"{self.workers} threads fetch over the network and {self.workers} decode the rest, {pixels} make "
                "pixel rows")

    def start(self) -> None:
        """The worker processes started now rather than at the first media request."""
        self.pixels.start()

    def close(self) -> None:
        """Stop the threads and processes once their jobs are done (a server shutting down)."""
        self._remote.shutdown(wait=True)
        self._local.shutdown(wait=True)
        self.pixels.close()

    def _submit(self, encoder: MediaEncoder[Any], request: DecisionRequest, deadline: Deadline
                ) -> tuple[list[Hashable], dict[Hashable, Future], Deadline]:
        jobs = encoder.jobs(request)
        first: dict[Hashable, str] = {}
        for key, where in jobs:
            first.setdefault(key, where)
        # One account per request; the batch's deadline is cancelled when a job fails: the others stop, and the
        # request goes on to answer.
        batch = _Batch(encoder, deadline.child(), MediaAllowance(self.budget))
        futures: dict[Hashable, Future] = {}
        with self._lock:
            for key, where in first.items():
                futures[key] = Future()
                batch.pending.append((key, where, futures[key]))
                lane = "remote" if encoder.remote(key) else "local"
                self.queued += 1
                self.queued_by_lane[lane] += 1
        self._start(batch)
        return [key for key, _ in jobs], futures, batch.deadline

    def _abandon(self, futures: dict[Hashable, Future], deadline: Deadline, encoder: MediaEncoder[Any]) -> None:
        for key, future in futures.items():
            if future.cancel():  # never started: its job will not run to count itself out
                lane = "remote" if encoder.remote(key) else "local"
                with self._lock:
                    self.queued -= 1
                    self.queued_by_lane[lane] -= 1
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
        return MediaLoad(self, keys, futures, batch, deadline, encoder)


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
                 deadline: Deadline, encoder: MediaEncoder[Any]):
        self._pool = pool
        self._encoder = encoder
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
            self._pool._abandon(self._futures, self._batch, self._encoder)

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
