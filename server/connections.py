"""Connection guards uvicorn does not have: a deadline for a request's headers, a cap on open connections (and,
optionally, on one client address's), and one log line (not one per accept) when the process runs out of file
descriptors.

At the cap, a new connection takes the place of the open one that has waited longest for its next request's
headers (a client sending them slowly, or an idle keep-alive one); only when every open connection has a request in
flight is the new one closed. So connections from many addresses that hold the cap by sending nothing (each within
the header deadline) cannot keep out a client that sends its request at once: it displaces the oldest of them.

uvicorn's own limits are used where they suffice (docs/operations.md, "Bounds under hostile load"):
`limit_concurrency` answers 503 once that many connections or tasks are open, and `timeout_keep_alive` closes idle
keep-alive connections. None of them closes a
connection that sends its headers a byte at a time, refuses connections past a count before their headers arrive, or
(with httptools, which has no cap of its own) bounds a request's header bytes, so the protocol class below does. The
body is under the request's own deadline (server/app.py).

The guard wraps uvicorn's httptools protocol where httptools is installed (a C parser; docs/decisions/http-stack.md
says what it saves) and its pure-Python h11 protocol otherwise; both keep a connection's request cycle, connection
set, loop and transport under the same names.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import resource
import time
from collections import Counter, deque
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

ACCEPT_FAILURE = "socket.accept() out of system resource"
MAX_HEADER_BYTES = 16 * 1024  # a request line and headers, as h11's own default cap
# h11 counts what it has buffered and answers 400 past its cap; set above ours plus one read (256 KiB), so that the
# guard's 431 is what a client gets whichever parser runs.
H11_BUFFER_BYTES = MAX_HEADER_BYTES + 1024 * 1024
REFUSAL_LINGER_S = 2.0  # after a 431, how long the rest of the client's bytes are read and dropped


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


def head_size(scope: dict[str, Any]) -> int:
    """The bytes of a parsed request line and headers, as a client sent them (give or take optional spaces)."""
    query = scope.get("query_string") or b""
    line = len(scope["method"]) + len(scope.get("raw_path") or b"") + (len(query) + 1 if query else 0) + 11
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + 2


def guarded_protocol(header_timeout_s: float, max_connections: int, max_per_client: int = 0,
                     max_header_bytes: int = MAX_HEADER_BYTES, base: type[asyncio.Protocol] | None = None) -> type:
    """`base` (uvicorn's protocol on `http_protocol()`'s parser by default), closing connections whose next request's
    headers take longer than `header_timeout_s` (from connect, or from the previous response), connections past
    `max_connections`, and with `max_per_client` (0: no such cap) a client address's connections past that many;
    a request line and headers over `max_header_bytes` are answered 431 and the connection closed."""
    base = base or http_protocol()[1]
    on_h11 = issubclass(base, H11Protocol)
    refusal = _header_refusal(max_header_bytes)
    open_by_client: Counter[str] = Counter()  # this server's connections by client address
    # Connections by when they last received a byte (or began waiting for a request), the longest idle first. One
    # found busy when met here (a request being answered) is dropped, and put back at the end when its response is
    # done or a byte arrives: each new connection at the cap costs a few steps, not a pass over every connection.
    idle: dict[asyncio.Protocol, None] = {}

    class GuardedProtocol(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0  # received of the request line and headers being read
        _reading_head = True  # httptools: between a message's end (or the connection's start) and its headers' end
        _refusing = False  # headers over the cap were received: a 431, then the connection closed
        _refusal_sent = False
        _client: str | None = None  # counted in open_by_client while the connection is open

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

        def _in_head(self) -> bool:
            """Whether the parser is reading (or waiting for) a request's line and headers."""
            return self.conn.their_state is h11.IDLE if on_h11 else self._reading_head

        def _answering(self) -> bool:
            """Whether a request of this connection is in flight: its headers read, its response not done."""
            return self.cycle is not None and not self.cycle.response_complete

        def _displaceable(self) -> bool:
            """Waiting for a request's headers, or for the rest of a body that stopped coming (the app asks for it
            and nothing else of the connection is in flight): such a connection holds a place and does nothing."""
            if self.transport.is_closing():
                return False
            if not self._answering():
                return True
            cycle = self.cycle
            return cycle.more_body and not self.flow.read_paused and not getattr(self, "pipeline", None)

        def _seen(self) -> None:
            idle.pop(self, None)
            idle[self] = None  # the most recently active

        def data_received(self, data: bytes) -> None:
            if self._refusing:
                return  # a 431 waits for the response in flight: nothing more is read
            self._seen()
            head, cycle = self._in_head(), self.cycle
            if head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self.cycle is not cycle:
                self._head_bytes = 0  # a request's headers ended in this read (another's may have begun)
                if on_h11 and head_size(self.cycle.scope) > max_header_bytes:
                    self._refuse_request(self.cycle)  # (httptools' callback judges each request itself)
            # Headers that end within a read are judged by their parsed size; headers still arriving, by the bytes
            # received since they began, whatever else the connection is doing.
            if not self._refusing and head and self._in_head() and self._head_bytes > max_header_bytes:
                self._refusing = True
            if self._refusing and not self.transport.is_closing():
                if self._earlier_in_flight():
                    self.flow.pause_reading()  # the 431 follows that response (on_response_complete)
                else:
                    self._send_refusal()

        def on_headers_complete(self) -> None:  # httptools only
            cycle = self.cycle
            super().on_headers_complete()
            self._reading_head = False
            if self.cycle is not cycle and head_size(self.cycle.scope) > max_header_bytes:
                self._refuse_request(self.cycle)

        def on_message_complete(self) -> None:  # httptools only
            super().on_message_complete()
            self._reading_head = True

        def _refuse_request(self, cycle: Any) -> None:
            """A request whose headers are over the cap is never answered (its task sees its client gone); the
            connection's 431 is sent once the responses before it are."""
            cycle.disconnected = True
            cycle.message_event.set()
            self._refusing = True

        def _earlier_in_flight(self) -> bool:
            """Whether a request read before the refused one is still being answered (pipelined requests are
            answered in order: the 431 must come after its response)."""
            if getattr(self, "pipeline", None):
                return True  # (httptools) requests wait there only behind one in flight
            return self._answering() and not self.cycle.disconnected

        def _send_refusal(self) -> None:
            """The 431, then the connection's end for writing; what the client still sends is read and dropped
            for up to REFUSAL_LINGER_S, since closing with bytes unread would reset the connection and could lose
            the 431 (and a response before it) on the client's side."""
            if self._refusal_sent:
                return
            self._refusal_sent = True
            getattr(self, "pipeline", deque()).clear()  # (httptools) refused requests never start
            self.transport.write(refusal)
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.flow.resume_reading()
                self.loop.call_later(REFUSAL_LINGER_S, self.transport.abort)
            else:
                self.transport.close()

        def _make_room(self) -> bool:
            """Close the other connection idle longest that holds a place and does nothing (waiting for headers, or
            for a body that stopped coming); False if none does."""
            while idle:
                oldest = next(iter(idle))
                del idle[oldest]
                if oldest is not self and oldest._displaceable():
                    oldest.transport.abort()
                    # Out of uvicorn's count now, not at its connection_lost a loop turn later: a request that
                    # comes with the new connection would otherwise meet `limit_concurrency` and get a 503.
                    self.connections.discard(oldest)
                    return True
            return False

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._head_bytes = 0
            self._seen()
            self._header_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _expire(self) -> None:
            if not self._answering() and not self.transport.is_closing():
                self.transport.abort()  # no new request's headers arrived in time

        def on_response_complete(self) -> None:
            if self._refusing:
                self._send_refusal()  # before uvicorn would start a pipelined request
            super().on_response_complete()
            if not self._answering():  # else a pipelined request has begun: armed again at its response
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            idle.pop(self, None)
            if self._client is not None:
                open_by_client[self._client] -= 1
                if not open_by_client[self._client]:
                    del open_by_client[self._client]
                self._client = None
            super().connection_lost(exc)

    if on_h11:  # h11 makes no parser callbacks: its connection's state says what it reads
        del GuardedProtocol.on_headers_complete, GuardedProtocol.on_message_complete
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
