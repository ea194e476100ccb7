"""A request's deadline: the time it may still take (--request-timeout), and a cancel that stops its work.

One `Deadline` is made per request and handed to every step that can block (media fetches, the media pool, the
graph runs). When it passes, or the request is abandoned (timeout, client gone), `cancel()` runs the callbacks the
steps registered (a fetch shuts its socket down), so no thread works on for a request nobody waits for.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from ..models.errors import TimedOut


class Deadline:
    def __init__(self, seconds: float = math.inf, flag: str = "--request-timeout"):
        self.seconds = seconds
        self.flag = flag
        self._end = time.monotonic() + seconds
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next = 0

    def remaining(self) -> float:
        """Seconds left (0 once cancelled or past)."""
        if self._cancelled.is_set():
            return 0.0
        return max(0.0, self._end - time.monotonic())

    def timeout(self) -> float | None:
        """`remaining()` as a wait's timeout: None where the request has no time limit."""
        remaining = self.remaining()
        return None if math.isinf(remaining) else remaining

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def error(self) -> TimedOut:
        return TimedOut(f"request did not finish within {self.seconds:g} s ({self.flag})")

    def check(self) -> None:
        """Raise `TimedOut` once the deadline has passed or the request was abandoned."""
        if self.expired():
            raise self.error()

    def bound(self, seconds: float) -> float:
        """`seconds`, or less if the deadline is nearer; at least a millisecond (a zero socket timeout means
        non-blocking)."""
        return max(0.001, min(seconds, self.remaining()))

    def child(self) -> Deadline:
        """A deadline for part of the request's work: it ends with this one (time or cancel), and cancelling it
        stops only that part (the media pool stops a request's other fetches when one of them fails)."""
        child = Deadline(self.remaining(), self.flag)
        child.seconds = self.seconds  # its error names the request's limit
        self.on_cancel(child.cancel)
        return child

    def cancel(self) -> None:
        """Abandon the request: every registered callback runs once (in this thread)."""
        with self._lock:
            if self._cancelled.is_set():
                return
            self._cancelled.set()
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        for callback in callbacks:
            try:
                callback()
            except OSError:  # a socket already closed by its own thread
                pass

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` when the request is abandoned (at once if it already is); returns the unregister."""
        with self._lock:
            if not self._cancelled.is_set():
                key = self._next
                self._next += 1
                self._callbacks[key] = callback
                return lambda: self._callbacks.pop(key, None)
        callback()
        return lambda: None
