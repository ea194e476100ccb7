"""Admission control: a bounded number of requests running inference, a bounded queue, a time limit per request,
and a slot freed when its client goes away. Past the bounds a request is refused at once (503 + Retry-After)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from ..models.errors import Unavailable

T = TypeVar("T")


class Overloaded(Unavailable):
    pass


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Admission:
    def __init__(self, max_running: int = 1, max_queued: int = 16, timeout_s: float = 60.0, retry_after_s: int = 1):
        if max_running < 1 or max_queued < 0:
            raise ValueError("max_running must be >= 1 and max_queued >= 0")
        self.max_running, self.max_queued = max_running, max_queued
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.running = 0
        self.queued = 0
        self._slots = asyncio.Semaphore(max_running)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one inference slot; refuse at once when every slot is taken and the queue is full."""
        if self.running >= self.max_running and self.queued >= self.max_queued:
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

    async def run(self, work: Callable[[], Awaitable[T]], disconnected: Callable[[], Awaitable[bool]],
                  on_abandon: Callable[[], None]) -> T:
        """Run `work` in a slot, within the time limit, while the client stays connected.

        When the time runs out or the client leaves, `on_abandon` is called (to stop the inference in flight)
        and the slot is given back.
        """
        async def in_slot() -> T:
            async with self.slot():
                return await work()

        task = asyncio.ensure_future(in_slot())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(0.05, max(0.0, deadline - loop.time())))
                if done:
                    return task.result()
                if await disconnected():
                    raise ClientGone()
                if loop.time() >= deadline:
                    raise Overloaded(f"request did not finish within {self.timeout_s:g} s (--request-timeout)",
                                     self.retry_after_s)
        finally:
            if not task.done():
                on_abandon()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
