"""What `create_app` takes besides the service: serve's HTTP-side settings, with their defaults written here once
(the CLI's flags take theirs from an instance; docs/cli.md is checked against the flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerOptions:
    api_key: str | None = None
    max_concurrency: int = 64  # requests admitted to the scheduler at once (their questions share batches)
    max_queue: int = 64  # requests waiting for admission; past it 503 + Retry-After
    request_timeout_s: float = 60.0
    max_body_bytes: int = 64 << 20
    log_requests: bool = False
    parse_workers: int = 4  # threads that decode bodies, check requests and tokenize (never wait on media)
    heavy_parse_workers: int = 1  # threads that render and tokenize requests of long texts (HEAVY_TEXT_BYTES)
    max_body_memory: int = 1 << 30  # what bodies may hold before admission (server/body_memory.py)
    max_batch_rows: int | None = None  # rows a text-graph call; None: measured at start-up (runtime/batch_sizing.py)
    batch_wait_ms: float = 1.0  # how long a call that could take more rows waits for them


@dataclass(frozen=True)
class ConnectionLimits:
    """The connection guard's limits (server/connections.py), with serve's defaults."""

    header_timeout_s: float = 10.0  # seconds a connection may take to send a request's headers
    max_connections: int = 1024  # open connections (kept below the descriptor limit)
    max_per_client: int = 0  # open connections from one client address; 0: no such cap
