"""Memory that request bodies hold before admission, under one budget (--max-body-memory).

Bodies are received and parsed before a request takes an inference slot, so without a bound concurrent bodies
multiply memory, and a parsed JSON document can take many times its bytes (a list of empty lists about 22 times, of
one-key objects about 28). A body is charged its bytes as they arrive, never what it declares (headers that declare
64 MiB and send nothing hold nothing); then, before it is parsed, an upper bound of what reading it holds, computed
from its bytes, until its request is prepared. A body over the budget alone is a 413 (a declared length over it, at
once). When a body needs room the others hold, bodies still arriving are cut off (503 + Retry-After), the one
arriving longest first, so uploads that stall near their end cannot hold the budget until their deadline; only
when none has been arriving for `MIN_ARRIVING_S` is the body asking a 503 itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..models.errors import TooLarge, Unavailable

FLAG = "--max-body-memory"
# Bytes a JSON value may take in Python (the object and its place in its container, its key's and the reader's
# memo entries), by the byte that comes before it. Every value but the document follows one of these; a byte
# inside a string is counted too, which only raises the bound. Measured in CPython 3.11 at most 54 a string after
# a comma, 133 a key-value pair after a colon, 92 a one-item list, 273 an object of one key
# (tests/test_body_memory.py checks the bound against the shapes that take most).
COST_AFTER = {b",": 80, b":": 128, b"[": 64, b"{": 192}
FIXED_COST = 64 << 10
# A body arriving for at least this long may be cut off (503) when another needs its room: bodies sent at once are
# never, bodies held open are, the one arriving longest first.
MIN_ARRIVING_S = 1.0


def parsed_size_bound(raw: bytes) -> int:
    """An upper bound on the memory that reading `raw` holds at its peak: the bytes, their decoded text, the parsed
    document and the body check (server/body.py). A string's characters take one byte each in Python when the body
    is ASCII with no \\u escape, otherwise up to four."""
    # No backslash, no \u escape: one byte is found by memchr (searching the two took 2.9 ms on a 3.2 MB data URL).
    wide = 1 if raw.isascii() and (b"\\" not in raw or b"\\u" not in raw) else 4
    return len(raw) * (1 + 2 * wide) + sum(raw.count(byte) * cost for byte, cost in COST_AFTER.items()) + FIXED_COST


class BodyMemoryFull(Unavailable):
    pass


class BodyMemoryTooLarge(TooLarge):
    pass


class BodyMemory:
    """Counted on the event loop (one thread), so no lock. Bodies still arriving are kept in the order they began
    (`_arriving`), so the one arriving longest is found first when room is needed."""

    def __init__(self, max_bytes: int, retry_after_s: int = 1, min_arriving_s: float = MIN_ARRIVING_S,
                 clock: Callable[[], float] = time.monotonic):
        self.max_bytes, self.retry_after_s = max_bytes, retry_after_s
        self.min_arriving_s, self.clock = min_arriving_s, clock
        self.held = 0
        self._arriving: dict[BodyCharge, None] = {}

    @contextmanager
    def charge(self, on_cut_off: Callable[[BodyMemoryFull], None] | None = None) -> Iterator[BodyCharge]:
        """One body's charge, released when the block ends. `on_cut_off` is told when the body, still arriving, is
        cut off to make room for another (its charge already released)."""
        charge = BodyCharge(self, on_cut_off)
        self._arriving[charge] = None
        try:
            yield charge
        finally:
            self._arriving.pop(charge, None)
            self.held -= charge.size
            charge.size = 0

    def _can_cut(self, charge: BodyCharge, now: float) -> bool:
        return now - charge.started >= self.min_arriving_s

    def room(self) -> int:
        """Bytes a new body could be charged now: what is free, and what the bodies that may be cut off hold."""
        now = self.clock()
        return self.max_bytes - self.held + sum(c.size for c in self._arriving if self._can_cut(c, now))

    def _make_room(self, needed: int, asking: BodyCharge) -> None:
        """Cut off bodies still arriving, the one arriving longest first, until `needed` more bytes fit; only a
        body arriving for at least `min_arriving_s` is cut off (a body sent at once is never)."""
        now = self.clock()
        for charge in list(self._arriving):
            if self.held + needed <= self.max_bytes:
                return
            if charge is asking or not charge.size:
                continue
            if not self._can_cut(charge, now):
                return  # the rest began later still
            charge.cut_off(now)


class BodyCharge:
    def __init__(self, memory: BodyMemory, on_cut_off: Callable[[BodyMemoryFull], None] | None = None):
        self.memory, self.size = memory, 0
        self.started = memory.clock()
        self.on_cut_off = on_cut_off
        self.cut: BodyMemoryFull | None = None

    def fits_alone(self, size: int) -> None:
        """A 413 at once for a body whose declared length is over the whole budget (nothing is charged)."""
        if size > self.memory.max_bytes:
            raise BodyMemoryTooLarge(f"this request body declares {size:,} bytes, more than the "
                                     f"{self.memory.max_bytes:,} bytes request bodies may hold ({FLAG})")

    def set(self, size: int, parsing: bool = False) -> None:
        """Charge `size` bytes from now on (`parsing`: a bound of what reading the body takes, else bytes received):
        more than the budget alone is a 413; more than what is left of it cuts off bodies that have been arriving
        longest to make room, else is a 503."""
        memory = self.memory
        if self.cut is not None:
            raise self.cut
        if size > memory.max_bytes:
            what = "reading this request body could take up to" if parsing else "this request body holds"
            raise BodyMemoryTooLarge(f"{what} {size:,} bytes of memory, more than the {memory.max_bytes:,} bytes "
                                     f"request bodies may hold ({FLAG})")
        if size > self.size and memory.held - self.size + size > memory.max_bytes:
            memory._make_room(size - self.size, self)
            if memory.held - self.size + size > memory.max_bytes:
                raise BodyMemoryFull(f"request bodies being received and parsed hold {memory.held:,} bytes; this "
                                     f"one's {size:,} would pass the {memory.max_bytes:,}-byte budget ({FLAG}); "
                                     "retry later", memory.retry_after_s)
        memory.held += size - self.size
        self.size = size

    def at_least(self, size: int) -> None:
        """Raise the charge to `size` bytes (a body as it is received)."""
        if size > self.size:
            self.set(size)

    def received(self) -> None:
        """The whole body has arrived: it is no longer cut off to make room."""
        self.memory._arriving.pop(self, None)

    def cut_off(self, now: float) -> None:
        """Release the charge of a body still arriving and tell its reader (503 + Retry-After)."""
        memory = self.memory
        memory._arriving.pop(self, None)
        self.cut = BodyMemoryFull(f"this request body, still arriving after {now - self.started:.1f} s with "
                                  f"{self.size:,} bytes received, was cut off to make room for others under the "
                                  f"{memory.max_bytes:,}-byte budget of request bodies ({FLAG}); retry later",
                                  memory.retry_after_s)
        memory.held -= self.size
        self.size = 0
        if self.on_cut_off is not None:
            self.on_cut_off(self.cut)
