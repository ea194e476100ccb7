"""Parsing admitted under a byte budget: the bytes of request bodies being decoded, parsed and checked at once
(--max-parse-bytes). A parsed JSON document takes many times its bytes, and parsing runs before a request takes an
inference slot, so without this bound concurrent large bodies multiply memory; past it, 503 + Retry-After."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..models.errors import Unavailable


class ParseBudgetFull(Unavailable):
    pass


class ParseBudget:
    """Counted on the event loop (one thread), so no lock."""

    def __init__(self, max_bytes: int, retry_after_s: int = 1):
        self.max_bytes, self.retry_after_s = max_bytes, retry_after_s
        self.held = 0

    @contextmanager
    def hold(self, size: int) -> Iterator[None]:
        """Hold `size` bytes while a body is parsed and checked; one body alone is always admitted."""
        if self.held and self.held + size > self.max_bytes:
            raise ParseBudgetFull(f"server is parsing {self.held:,} bytes of requests; this one's {size:,} would pass "
                                  f"the {self.max_bytes:,}-byte budget (--max-parse-bytes); retry later",
                                  self.retry_after_s)
        self.held += size
        try:
            yield
        finally:
            self.held -= size
