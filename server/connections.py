"""Connection guards uvicorn does not have: a deadline for a request's headers, a cap on open connections (and,
optionally, on one client address's), and one log line (not one per accept) when the process runs out of file
descriptors.

At the cap, a new connection takes the place of the open one that has waited longest for its next request's
headers (a client sending them slowly, or an idle keep-alive one); only when every open connection has a request in
flight is the new one closed. So connections from many addresses that hold the cap by sending nothing (each within
the header deadline) cannot keep out a client that sends its request at once: it displaces the oldest of them.

uvicorn's own limits are used where they suffice (README "Bounds"): `limit_concurrency` answers 503 once that many
connections or tasks are open, and `timeout_keep_alive` closes idle keep-alive connections. None of them closes a
connection that sends its headers a byte at a time, refuses connections past a count before their headers arrive, or
(with httptools, which has no cap of its own) bounds a request's header bytes, so the protocol class below does. The
body is under the request's own deadline (server/app.py).

The guard wraps uvicorn's httptools protocol where httptools is installed (a C parser; README "Clients and the
server's guard rails" says what it saves) and its pure-Python h11 protocol otherwise; both keep a connection's
request cycle, connection set, loop and transport under the same names.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import resource
import time
from collections import Counter
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

ACCEPT_FAILURE = "socket.accept() out of system resource"
MAX_HEADER_BYTES = 16 * 1024  # a request line and headers, as h11's own default cap
# h11 counts what it has buffered and answers 400 past its cap; set above ours plus one read (256 KiB), so that the
# guard's 431 is what a client gets whichever parser runs.
H11_BUFFER_BYTES = MAX_HEADER_BYTES + 1024 * 1024


def http_protocol(parser: str = "auto") -> tuple[str, type[asyncio.Protocol]]:
    """The parser's name and uvicorn's protocol on it: `auto` takes httptools' C parser where httptools is installed
    and h11's otherwise."""
    if parser in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        except ImportError:
            if parser == "httptools":
                raise ImportError("--http httptools: httptools is not installed") from None
        else:
            return "httptools", HttpToolsProtocol
    return "h11", H11Protocol


def event_loop(loop: str = "auto") -> str:
    """The event loop uvicorn is to run, by the name its `loop` setting takes: `auto` takes uvloop where it is
    installed (its loop costs a request less time than asyncio's) and asyncio otherwise."""
    installed = importlib.util.find_spec("uvloop") is not None
    if loop == "uvloop" and not installed:
        raise ImportError("--loop uvloop: uvloop is not installed")
    return ("uvloop" if installed else "asyncio") if loop == "auto" else loop


def guarded_protocol(header_timeout_s: float, max_connections: int, max_per_client: int = 0,
                     max_header_bytes: int = MAX_HEADER_BYTES, base: type[asyncio.Protocol] | None = None) -> type:
    """`base` (uvicorn's protocol on `http_protocol()`'s parser by default), closing connections whose next request's
    headers take longer than `header_timeout_s` (from connect, or from the previous response), connections past
    `max_connections`, and with `max_per_client` (0: no such cap) a client address's connections past that many;
    a request line and headers over `max_header_bytes` are answered 431 and the connection closed."""
    base = base or http_protocol()[1]
    refusal = _header_refusal(max_header_bytes)
    open_by_client: Counter[str] = Counter()  # this server's connections by client address
    # Connections by when they began waiting for a request's headers, oldest first. One whose request has since
    # arrived is dropped when met here (and put back at the end when its response is done): each new connection
    # at the cap costs a few steps, not a pass over every connection.
    waiting: dict[asyncio.Protocol, None] = {}

    class GuardedProtocol(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0  # received since the connection began waiting for a request's headers
        _client: str | None = None  # counted in open_by_client while the connection is open
        _waiting_after: object = None  # the request cycle after which it waits for headers (None: the first)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            client = None
            if max_per_client:
                peer = transport.get_extra_info("peername")
                client = peer[0] if isinstance(peer, tuple) else str(peer)
                if open_by_client[client] >= max_per_client:
                    transport.abort()  # one address may not hold every connection the server has
                    return
            if len(self.connections) > max_connections and not self._make_room():
                transport.abort()  # past the cap, every other request in flight: closed, nothing logged
                return
            if client is not None:
                open_by_client[client] += 1
                self._client = client
            self._arm()

        def _waiting_for_headers(self) -> bool:
            return self.cycle is self._waiting_after and not self.transport.is_closing()

        def data_received(self, data: bytes) -> None:
            waiting = self._waiting_for_headers()
            if waiting:
                self._header_bytes += len(data)
            super().data_received(data)
            # Checked after the parser has read the data: headers that end within it have begun a request cycle,
            # so a body in the same read cannot trip the cap.
            if waiting and self._header_bytes > max_header_bytes and self._waiting_for_headers():
                self.transport.write(refusal)
                self.transport.close()

        def _make_room(self) -> bool:
            """Close the other connection that has waited longest for its next request's headers; False if none
            is waiting."""
            while waiting:
                oldest = next(iter(waiting))
                del waiting[oldest]
                if oldest is not self and oldest._waiting_for_headers():
                    oldest.transport.abort()
                    # Out of uvicorn's count now, not at its connection_lost a loop turn later: a request that
                    # comes with the new connection would otherwise meet `limit_concurrency` and get a 503.
                    self.connections.discard(oldest)
                    return True
            return False

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._waiting_after = self.cycle
            self._header_bytes = 0
            waiting.pop(self, None)
            waiting[self] = None  # the newest wait
            self._header_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _expire(self) -> None:
            if self._waiting_for_headers():
                self.transport.abort()  # no new request's headers arrived in time

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            waiting.pop(self, None)
            if self._client is not None:
                open_by_client[self._client] -= 1
                if not open_by_client[self._client]:
                    del open_by_client[self._client]
                self._client = None
            super().connection_lost(exc)

    return GuardedProtocol


def guarded_http_settings(header_timeout_s: float, max_connections: int, max_per_client: int = 0,
                          base: type[asyncio.Protocol] | None = None) -> dict[str, Any]:
    """uvicorn's settings for `guarded_protocol` on `base`: the protocol, and h11's own header buffer set above the
    guard's cap, so that a client gets the guard's 431 on either parser."""
    return {"http": guarded_protocol(header_timeout_s, max_connections, max_per_client, base=base),
            "h11_max_incomplete_event_size": H11_BUFFER_BYTES}


def _header_refusal(max_header_bytes: int) -> bytes:
    """The whole 431 response, written on the transport before it closes (no request cycle exists yet)."""
    message = f"request line and headers over the server's limit of {max_header_bytes} bytes"
    body = json.dumps(error_body(431, message, "RequestHeaderFieldsTooLarge")).encode()
    head = ("HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class AcceptFailureFilter(logging.Filter):
    """asyncio logs every failed accept() with a traceback; out of descriptors that is a flood. One line in
    `every_s` seconds, counting the ones left out."""

    def __init__(self, every_s: float = 10.0):
        super().__init__()
        self.every_s = every_s
        self._last = -float("inf")
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if ACCEPT_FAILURE not in str(record.msg):
            return True
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._dropped += 1
            return False
        record.msg = f"{ACCEPT_FAILURE} (file descriptors exhausted; {self._dropped} more since the last line)"
        record.args, record.exc_info, record.exc_text = (), None, None
        self._last, self._dropped = now, 0
        return True


def raise_descriptor_limit() -> int:
    """The soft open-file limit raised to the hard one; returns it (the connection cap should stay below)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft
