"""How `systemone serve` listens and stops: the socket is bound before the model loads (a busy port is one line at
once, not an error after minutes of loading), and a second Ctrl-C answers the requests in flight with 503 before
the process ends (uvicorn's own second Ctrl-C cancels them: a 500 each and a traceback of CancelledError)."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("systemone.server")

# After a second Ctrl-C, how long the answered requests' responses get to go out before the process stops anyway.
STOP_GRACE_S = 5.0


class PortUnavailable(OSError):
    """The address could not be bound; the message says why and what to do."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: any free port), not yet listening: connections are refused, not
    left waiting, until the server accepts them. uvicorn's own bind, with SO_REUSEADDR."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortUnavailable(f"port {port} on {host} is in use: stop what holds it, or pick another with --port "
                                  "(--port 0: any free port)") from None
        raise PortUnavailable(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class StoppableServer(uvicorn.Server):
    """uvicorn's server, where the second Ctrl-C (while the first one's graceful stop waits for requests in flight)
    calls `stop_in_flight`, which answers them with 503, and the stop goes on; a third one stops at once."""

    def __init__(self, config: uvicorn.Config, stop_in_flight: Callable[[], int]):
        super().__init__(config)
        self._stop_in_flight = stop_in_flight
        self._loop: asyncio.AbstractEventLoop | None = None
        self._abandoned = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        second = sig == signal.SIGINT and self.should_exit and not self._abandoned
        super().handle_exit(sig, frame)
        if second and self._loop is not None:
            self.force_exit = False  # not yet: the requests in flight are answered first
            self._abandoned = True
            self._loop.call_soon_threadsafe(self._abandon)

    def _abandon(self) -> None:
        answered = self._stop_in_flight()
        log.warning("second Ctrl-C: %d request(s) in flight answered 503; stopping", answered)
        assert self._loop is not None
        self._loop.call_later(STOP_GRACE_S, setattr, self, "force_exit", True)


def run_server(app: Any, listener: socket.socket, stop_in_flight: Callable[[], int], **settings: Any) -> None:
    """Serve `app` on the bound `listener` with uvicorn's `settings` (Config's keyword arguments) until stopped."""
    host, port = listener.getsockname()[:2]
    server = StoppableServer(uvicorn.Config(app, host=host, port=port, **settings), stop_in_flight)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # the Ctrl-C that stopped it, raised again once the server is down
        pass
