"""What export shows while it runs: numbered steps with the time since it began, and, while a graph's weights are
written, the bytes written, the rate and the time left: one redrawn line on a terminal, a plain line every few
seconds in a log."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_LOG_EVERY_S = 10.0
_DRAW_EVERY_S = 0.2


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class Progress:
    def __init__(self, total: int, stream: TextIO = sys.stderr):
        self.total, self.step, self.stream, self.start = total, 0, stream, time.monotonic()
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._writing: tuple[str, int, float] | None = None  # file, bytes expected, start
        self._done = 0
        self._shown = 0.0

    def __call__(self, message: str) -> None:
        self.step += 1
        self.total = max(self.total, self.step)
        self._line(f"[{self.step}/{self.total} {time.monotonic() - self.start:6.1f}s] {message}")

    def detail(self, message: str) -> None:
        """A line under the current step (how long a part of it took)."""
        self._line(f"    {message}")

    def writing(self, file: str, expected: int) -> None:
        """A graph's weights begin: `expected` bytes into `file`."""
        self._writing, self._done, self._shown = (file, expected, time.monotonic()), 0, time.monotonic()

    def wrote(self, count: int) -> None:
        """`count` more bytes of the current file written."""
        if self._writing is None:
            return
        self._done += count
        file, expected, began = self._writing
        now = time.monotonic()
        finished = self._done >= expected
        if not finished and now - self._shown < (_DRAW_EVERY_S if self.tty else _LOG_EVERY_S):
            return
        self._shown = now
        rate = self._done / max(now - began, 1e-6)
        left = (expected - self._done) / rate if rate > 0 else 0.0
        text = (f"    {file}: {_gb(self._done)} of {_gb(expected)} written, {rate / 1e6:.0f} MB/s, "
                f"{left:.0f} s left")
        if self.tty and not finished:
            print(f"\r{text}\033[K", end="", file=self.stream, flush=True)
        else:
            print(f"\r{text}\033[K" if self.tty else text, file=self.stream, flush=True)
        if finished:
            self._writing = None

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
