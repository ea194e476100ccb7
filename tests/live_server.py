"""A real uvicorn server on a loopback port, in a background thread of the test process."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import uvicorn

from systemone.local_server import free_port
from systemone.runtime.service import DecisionService
from systemone.server.app import ServerOptions, create_app


def port_of(base: str) -> int:
    """The port of a base URL such as `live_server` yields."""
    return int(base.rsplit(":", 1)[1])


@contextmanager
def live_server(service: DecisionService, options: ServerOptions | None = None, **uvicorn_options):
    """Yield the base URL of a server answering with `service`; stop it (gracefully) on exit. Its rows a call are
    measured once per graph in the run (tests/conftest.py)."""
    with serving(create_app(service, options), **uvicorn_options) as base:
        yield base


@contextmanager
def serving(app, **uvicorn_options):
    """Yield the base URL of uvicorn serving the ASGI `app` on a loopback port; stop it (gracefully) on exit."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=30, **uvicorn_options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
