"""`systemone serve --replicas N`: the server's replicas on Ray Serve, the same API (docs/operations.md, "Past one
GPU").

Two deployments. Each `Replica` is one whole `systemone serve` app, built from the same flags (its engine on one
GPU, or on CPUs; its admission, limits and auth), called with a request's method, path, headers and body. The
`Front` is the HTTP ingress and holds no model: it reads a request (bounded as serve bounds bodies), hands it to a
replica and passes the answer back, naming the replica in `x-systemone-replica`. A replica that dies with a request
in flight: the request goes to another replica (an answer is a pure function of its request), and when none is left
or the tries are spent, the client gets a 503 with Retry-After, never another 5xx or a hang. Ray starts a new
replica in the dead one's place.

`ray[serve]` is the `[ray]` extra; one-GPU serving never imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Headers, bytes]  # status, headers, body

RETRY_AFTER_S = 1
REPLICA_HEADER = b"x-systemone-replica"


@dataclass(frozen=True)
class Scaling:
    """How many replicas, and how many requests each takes at once before Ray holds the rest (`--replicas` and the
    `--min-replicas`/`--max-replicas` autoscaling bounds; `--replica-ongoing` per replica)."""

    replicas: int = 1
    min_replicas: int | None = None  # with max_replicas: autoscaled on the requests in flight
    max_replicas: int | None = None
    ongoing: int = 64  # Ray's cap on a replica's requests in flight; past it requests wait at the front
    target_ongoing: float = 16.0  # the autoscaler's aim per replica
    gpus: float = 0.0  # a replica's GPUs (1 where --device cuda)
    tries: int = 3  # replicas a request may be handed to when the one holding it dies

    def deployment_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"max_ongoing_requests": self.ongoing,
                                   "ray_actor_options": {"num_gpus": self.gpus, "num_cpus": 0}}
        if self.min_replicas is not None or self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            high = self.max_replicas if self.max_replicas is not None else max(low, self.replicas)
            if not 1 <= low <= high:
                raise ValueError(f"--min-replicas {low} and --max-replicas {high}: need 1 <= min <= max")
            options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high,
                                             "initial_replicas": min(max(self.replicas, low), high),
                                             "target_ongoing_requests": self.target_ongoing}
        else:
            options["num_replicas"] = self.replicas
        return options


async def call_app(app: Callable[..., Awaitable[None]], method: str, path: str, query: bytes, headers: Headers,
                   body: bytes, client: tuple[str, int] | None) -> Answer:
    """One HTTP request through the ASGI `app` in this process: the whole body at once, then no disconnect until
    the response has gone out (the server watches its clients)."""
    answered = asyncio.Event()
    delivered = False
    status, response_headers, chunks = 500, [], []

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, response_headers
        if message["type"] == "http.response.start":
            status, response_headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                answered.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
             "root_path": "", "headers": headers, "client": client, "server": ("replica", 0), "state": {}}
    try:
        await app(scope, receive, send)
    finally:
        answered.set()
    return status, response_headers, b"".join(chunks)


class ReplicaServer:
    """One replica: the app `systemone serve` would run with `args`, its lifespan (warm-up, scheduler) started
    before its first request."""

    def __init__(self, args: argparse.Namespace, api_key: str | None):
        from .cli import served_app

        self.service, self.app, _ = served_app(args, api_key)
        self.name = os.environ.get("RAY_SERVE_REPLICA_ID") or f"pid-{os.getpid()}"
        self._lifespan = AsyncExitStack()
        self._started: asyncio.Task | None = None

    async def started(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._lifespan.enter_async_context(
                self.app.router.lifespan_context(self.app)))
        await asyncio.shield(self._started)

    async def handle(self, method: str, path: str, query: bytes, headers: Headers, body: bytes,
                     client: tuple[str, int] | None) -> Answer:
        await self.started()
        status, response_headers, payload = await call_app(self.app, method, path, query, headers, body, client)
        return status, [*response_headers, (REPLICA_HEADER, self.name.encode())], payload

    async def healthy(self) -> None:
        await self.started()
        status, _, body = await call_app(self.app, "GET", "/health", b"", [], b"", None)
        if status != 200:
            raise RuntimeError(f"/health answered {status}: {body[:200]!r}")

    async def close(self) -> None:
        await self._lifespan.aclose()
        self.service.close()


def refusal(exc: Any) -> Answer:
    """The server's own response to a domain error (server/errors.py), answered at the front: a body over
    --max-body-bytes (413, without reading the rest), or no replica left to answer (503 + Retry-After)."""
    from .server.errors import decision_error_response

    response = decision_error_response(exc)
    return response.status_code, list(response.raw_headers), bytes(response.body)


def replica_lost(exc: BaseException) -> bool:
    """Whether `exc`, raised by a handle call, says the replica holding the request is gone (not that the request
    failed): the request may go to another."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


def build_application(args: argparse.Namespace, api_key: str | None, scaling: Scaling) -> Any:
    """The Ray Serve application: `Front` over `Replica`s of the app `args` make."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    from .models.errors import Unavailable
    from .server.body import BodyTooLarge

    @serve.deployment(**scaling.deployment_options())
    class Replica:
        def __init__(self) -> None:
            self.server = ReplicaServer(args, api_key)

        async def handle(self, *request: Any) -> Answer:
            return await self.server.handle(*request)

        async def check_health(self) -> None:  # Ray replaces a replica whose app stops answering /health
            await self.server.healthy()

        async def __del__(self) -> None:
            await self.server.close()

    @serve.deployment(max_ongoing_requests=max(1024, 4 * scaling.ongoing), ray_actor_options={"num_cpus": 0})
    class Front:
        def __init__(self, replicas: Any) -> None:
            self.replicas = replicas

        async def __call__(self, request: Request) -> Response:
            status, headers, body = await self.answer(request)
            response = Response(body, status_code=status)
            response.raw_headers = [h for h in headers if h[0].lower() != b"content-length"] + [
                (b"content-length", str(len(body)).encode())]
            return response

        async def answer(self, request: Request) -> Answer:
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > args.max_body_bytes:
                return refusal(BodyTooLarge(args.max_body_bytes))
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > args.max_body_bytes:
                    return refusal(BodyTooLarge(args.max_body_bytes))
            client = (request.client.host, request.client.port) if request.client else None
            call = (request.method, request.url.path, request.url.query.encode(), list(request.headers.raw),
                    bytes(body), client)
            for _ in range(scaling.tries):
                try:
                    return await self.replicas.handle.remote(*call)
                except Exception as exc:  # noqa: BLE001 - only a lost replica is tried again; the rest is ours
                    if not replica_lost(exc):
                        raise
            return refusal(Unavailable(f"no replica could answer: the {scaling.tries} tried were lost with the "
                                       "request in flight; try again", RETRY_AFTER_S))

    return Front.bind(Replica.bind())


def serve_on_ray(args: argparse.Namespace, api_key: str | None) -> int:
    """`systemone serve ... --replicas N`: the application on Ray Serve at --host/--port until interrupted."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("systemone serve: --replicas needs Ray Serve: pip install 'systemone-onnx[ray]'", file=sys.stderr)
        return 2
    from .cli import _served_artifact

    _served_artifact(args)  # a checkpoint exported once here, not once a replica
    scaling = Scaling(replicas=args.replicas or args.min_replicas or 1, min_replicas=args.min_replicas,
                      max_replicas=args.max_replicas, ongoing=args.replica_ongoing,
                      gpus=1.0 if args.device == "cuda" else 0.0)
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
    # Ctrl-C (SIGINT) stops it whatever this process inherited, as serve without replicas stops (uvicorn sets its
    # own handler): a process started in the background of a script inherits SIGINT ignored, and would run on.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args, api_key, scaling), name="systemone", route_prefix="/")
        print(f"systemone serve: replicas      {scaling.deployment_options()} on Ray {ray.__version__} "
              f"(cluster {ray.get_runtime_context().gcs_address})", flush=True)
        print(f"systemone serve: address       http://{args.host}:{args.port}/v1/systemone", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
