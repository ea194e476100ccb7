"""Parsing admitted under a memory budget (--max-parse-bytes). Parsing runs before a request takes an inference
slot, and a parsed JSON document can take many times its bytes (a list of empty lists about 22 times, of one-key
objects about 28), so each body is charged at an upper bound of what reading it holds, computed from its bytes
before it is parsed: a body whose bound alone passes the budget is a 413, one that would take the bodies being
parsed past it a 503 + Retry-After."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..models.errors import TooLarge, Unavailable

# Bytes a JSON value may take in Python (the object and its place in its container, its key's and the reader's
# memo entries), by the byte that comes before it. Every value but the document follows one of these; a byte
# inside a string is counted too, which only raises the bound. Measured in CPython 3.11 at most 54 a string after
# a comma, 133 a key-value pair after a colon, 92 a one-item list, 273 an object of one key
# (tests/test_parse_budget.py checks the bound against the shapes that take most).
COST_AFTER = {b",": 80, b":": 128, b"[": 64, b"{": 192}
FIXED_COST = 64 << 10


def parsed_size_bound(raw: bytes) -> int:
    """An upper bound on the memory that reading `raw` holds at its peak: the bytes, their decoded text, the parsed
    document and the body check (server/body.py). A string's characters take one byte each in Python when the body
    is ASCII with no \\u escape, otherwise up to four."""
    wide = 1 if raw.isascii() and b"\\u" not in raw else 4
    return len(raw) * (1 + 2 * wide) + sum(raw.count(byte) * cost for byte, cost in COST_AFTER.items()) + FIXED_COST


class ParseBudgetFull(Unavailable):
    pass


class ParseTooLarge(TooLarge):
    pass


class ParseBudget:
    """Counted on the event loop (one thread), so no lock."""

    def __init__(self, max_bytes: int, retry_after_s: int = 1):
        self.max_bytes, self.retry_after_s = max_bytes, retry_after_s
        self.held = 0

    @contextmanager
    def hold(self, size: int) -> Iterator[None]:
        """Hold `size` bytes (a body's `parsed_size_bound`) while the body is parsed and checked."""
        if size > self.max_bytes:
            raise ParseTooLarge(f"reading this request body could take up to {size:,} bytes of memory, more than "
                                f"the {self.max_bytes:,} bytes this server parses at once (--max-parse-bytes)")
        if self.held + size > self.max_bytes:
            raise ParseBudgetFull(f"server is parsing requests that could take {self.held:,} bytes; this one's "
                                  f"{size:,} would pass the {self.max_bytes:,}-byte budget (--max-parse-bytes); "
                                  "retry later", self.retry_after_s)
        self.held += size
        try:
            yield
        finally:
            self.held -= size
