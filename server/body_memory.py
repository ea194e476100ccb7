"""Memory that request bodies hold before admission, under one budget (--max-body-memory).

Bodies are received and parsed before a request takes an inference slot, so without a bound concurrent bodies
multiply memory: uploads that stall near their end each hold up to the body cap until the request's deadline, and
a parsed JSON document can take many times its bytes (a list of empty lists about 22 times, of one-key objects
about 28). A body is charged its bytes as they arrive (its declared Content-Length at once), then, before it is
parsed, an upper bound of what reading it holds, computed from its bytes, until its request is prepared. A body
over the budget alone is a 413; a body that would take the bodies held past it, a 503 + Retry-After.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    """Counted on the event loop (one thread), so no lock."""

    def __init__(self, max_bytes: int, retry_after_s: int = 1):
        self.max_bytes, self.retry_after_s = max_bytes, retry_after_s
        self.held = 0

    @contextmanager
    def charge(self) -> Iterator[BodyCharge]:
        """One body's charge, released when the block ends."""
        charge = BodyCharge(self)
        try:
            yield charge
        finally:
            self.held -= charge.size


class BodyCharge:
    def __init__(self, memory: BodyMemory):
        self.memory, self.size = memory, 0

    def set(self, size: int, parsing: bool = False) -> None:
        """Charge `size` bytes from now on (`parsing`: a bound of what reading the body takes, else bytes received):
        more than the budget alone is a 413, more than what is left of it a 503."""
        memory = self.memory
        if size > memory.max_bytes:
            what = "reading this request body could take up to" if parsing else "this request body holds"
            raise BodyMemoryTooLarge(f"{what} {size:,} bytes of memory, more than the {memory.max_bytes:,} bytes "
                                     f"request bodies may hold ({FLAG})")
        if size > self.size and memory.held - self.size + size > memory.max_bytes:
            raise BodyMemoryFull(f"request bodies being received and parsed hold {memory.held:,} bytes; this one's "
                                 f"{size:,} would pass the {memory.max_bytes:,}-byte budget ({FLAG}); retry later",
                                 memory.retry_after_s)
        memory.held += size - self.size
        self.size = size

    def at_least(self, size: int) -> None:
        """Raise the charge to `size` bytes (a body as it is received)."""
        if size > self.size:
            self.set(size)
