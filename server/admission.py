"""Admission control: a bounded number of requests admitted to the scheduler at once (their questions share its
batches), a bounded queue in front of it, and the request's deadline and client watched while it waits or runs
(`watch`): past the deadline, or with the client gone, the request's deadline is cancelled, so everything it holds
stops (fetches, its rows in the scheduler) and its slot is given back. Past the bounds a request is refused at once
(503 + Retry-After)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from ..models.errors import Unavailable
from ..runtime.deadline import Deadline

T = TypeVar("T")


class Overloaded(Unavailable):
    pass


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class ServerStopping(Unavailable):
    """The server was told to stop at once (a second Ctrl-C) while the request was in flight."""


class InFlight:
    """What the requests in flight watch besides their deadline and client: `stop()` ends each of them with
    `ServerStopping` (503). One future a running event loop, made when a request first asks for it."""

    def __init__(self) -> None:
        self._stopping: asyncio.Future[object] | None = None
        self.watching = 0  # requests waiting on it now

    def stopping(self) -> asyncio.Future[object]:
        loop = asyncio.get_running_loop()
        if self._stopping is None or self._stopping.get_loop() is not loop:
            self._stopping = loop.create_future()
        return self._stopping

    def stop(self) -> int:
        """End every request in flight with 503 (call on the event loop); how many there were."""
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)
        return self.watching


async def watch(work: Awaitable[T], deadline: Deadline, gone: asyncio.Future[object],
                in_flight: InFlight | None = None) -> T:
    """`work`'s result, unless the deadline passes (`TimedOut`), `gone` completes (the client left: `ClientGone`)
    or the server stops at once (`in_flight`'s stop: `ServerStopping`) first; then the deadline is cancelled (what
    the request holds stops) and `work` is cancelled. All are awaited, not polled, so a waiting request costs the
    event loop nothing until one of them happens."""
    task = asyncio.ensure_future(work)
    stopping = in_flight.stopping() if in_flight is not None else None
    if in_flight is not None:
        in_flight.watching += 1
    try:
        done, _ = await asyncio.wait({task, gone} if stopping is None else {task, gone, stopping},
                                     timeout=deadline.timeout(), return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        if gone in done:
            raise ClientGone()
        if stopping is not None and stopping in done:
            raise ServerStopping("the server is stopping (Ctrl-C twice) and answers no more requests; retry once it "
                                 "is back, or on another server")
        raise deadline.error()
    finally:
        if in_flight is not None:
            in_flight.watching -= 1
        if not task.done():
            deadline.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class Admission:
    def __init__(self, max_running: int = 64, max_queued: int = 64, retry_after_s: int = 1):
        if max_running < 1 or max_queued < 0:
            raise ValueError("max_running must be >= 1 and max_queued >= 0")
        self.max_running, self.max_queued = max_running, max_queued
        self.retry_after_s = retry_after_s
        self.running = 0
        self.queued = 0
        self._slots = asyncio.Semaphore(max_running)

    @property
    def full(self) -> bool:
        """Every slot taken and the queue full: a new request would be refused."""
        return self.running >= self.max_running and self.queued >= self.max_queued

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one inference slot; refuse at once when every slot is taken and the queue is full."""
        if self.full:
            raise Overloaded(f"server is at capacity ({self.max_running} running, {self.max_queued} queued; "
                             "--max-concurrency, --max-queue); retry later", self.retry_after_s)
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()

    async def run(self, work: Callable[[], Awaitable[T]], deadline: Deadline, gone: asyncio.Future[object],
                  in_flight: InFlight | None = None) -> T:
        """Run `work` in a slot within the request's deadline while the client stays connected; when either
        ends first, the deadline is cancelled (the scheduler drops the request's rows and stops a graph call that
        served only it) and the slot is given back."""
        async def in_slot() -> T:
            async with self.slot():
                return await work()

        return await watch(in_slot(), deadline, gone, in_flight)
