"""The HTTP surface: `POST /v1/systemone`, `GET /v1/models`, `GET /health`, `GET /ready`, `GET /metrics` (spec 1,
5, 6; docs/api.md).

A request flows: auth -> body (size cap, zstd/gzip, JSON) and checks in the parsing pool -> media in the media
pool (runtime/media_pool.py) -> prompts in the parsing pool -> admission (bounded running + queue) -> the
scheduler's engine thread (runtime/scheduler.py: its questions batched with other requests') -> reads and answers
-> JSON. One deadline (--request-timeout) covers every step from the body's first byte; the
request's client is watched throughout. Anything a client sends ends in a JSON 2xx/4xx; 5xx means our bug (500) or a full
or late server (503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..models.errors import DecisionError, ModelFault, SchemaError
from ..runtime.batch_sizing import BatchSizing
from ..runtime.deadline import Deadline
from ..runtime.devices import CPU
from ..runtime.engine import Prepared
from ..runtime.scheduler import Scheduler
from ..runtime.service import DecisionService
from .admission import Admission, ClientGone, InFlight, watch
from .auth import Unauthorized, check_bearer
from .body import BodyTimeout, NotJson, decode_content, parse_json, read_capped
from .errors import decision_error_response, error_response, schema_error_response
from .metrics import Metrics
from .options import ServerOptions
from .schema import ROUTE_DOCS, document_request_body
from .body_memory import BodyCharge, BodyMemory, BodyMemoryFull, parsed_size_bound
from .docs_pages import add_docs_pages

log = logging.getLogger("systemone.server")

JSON_MEDIA_TYPE = "application/json"
UNSUPPORTED_MEDIA_MESSAGE = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": logged and counted; nobody reads it


INLINE_BOUND_BYTES = 64 << 10  # bodies whose parsed-size bound the event loop counts itself (about 0.15 ms)
READY_BODY_ROOM = 1 << 20  # /ready says busy while less of the body budget than this could be charged
# A body with more than this outside its media URLs is prepared in the long-text lane: its rendering and tokenizing
# may take seconds (a state of a million CJK characters: 2.2 s to tokenize on two cores).
HEAVY_TEXT_BYTES = 128 << 10


def text_bytes(raw: bytes, request: Any) -> int:
    """A body's bytes outside its media URLs: about the text its prompts are made of."""
    return len(raw) - sum(len(url) for url in (*(request.images or ()), *(request.videos or ())))


async def client_gone(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Returns once the client has left. After a request's body, the next ASGI message is `http.disconnect`, which
    the server sends when the connection is lost (or the response has gone out): awaited once a request, where
    asking for it without waiting (Starlette's `is_disconnected`) every 50 ms took a tenth of the event loop's time
    under text-only load (docs/decisions/http-stack.md)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # a receive channel that fails has no client behind it either
        return


def _is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def create_app(service: DecisionService, options: ServerOptions | None = None) -> FastAPI:
    """The app for one loaded model."""
    options = options or ServerOptions()
    # With an API key the interactive docs are off (they would describe the API to anyone); /metrics needs the key.
    # FastAPI's own /docs and /redoc load their assets from a CDN: ours are served here (server/docs_pages.py).
    docs = {"docs_url": None, "redoc_url": None, **({} if options.api_key is None else {"openapi_url": None})}
    sizing = (service.batch_sizing() if options.max_batch_rows is None else BatchSizing(options.max_batch_rows))
    # On a GPU the vision graph runs beside the text calls (its launches overlap theirs); on the CPU both would
    # share the same few cores.
    scheduler = Scheduler(service.engine, sizing.rows, options.batch_wait_ms / 1000,
                          media_lane=service.provider != CPU, cost=sizing.cost)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The engine warms up on the scheduler's engine thread before the first request (d3 on CUDA: every bucket's
        # CUDA graph captured there, where it is replayed).
        started_at = time.monotonic()
        await asyncio.gather(asyncio.to_thread(scheduler.start), asyncio.to_thread(service.media_pool.start))
        if service.captures:
            log.info("cuda graphs %s in %.1f s on the engine thread", service.cuda_graphs,
                        time.monotonic() - started_at)
        # What start-up made (tokenizer, sessions, warm-up) lives as long as the server: frozen out of the garbage
        # collector, its full passes scan only what requests leave behind. Under text load on the tiny d3 model
        # (two cores, scripts/gc_pauses.py) each had held the GIL for up to 69-80 ms, four or five times in 20 s;
        # frozen, at most 1-7 ms, and the p99 fell by 16-30 ms in each of three paired runs.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()  # an app in a longer-lived process (tests, embedding) gives the objects back
        # uvicorn has let the requests in flight finish (their answers came from the scheduler); anything still
        # queued finishes before the process ends.
        await asyncio.to_thread(scheduler.close)

    app = FastAPI(title="systemone-onnx", version="0.1.0", lifespan=lifespan, **docs)
    admission = Admission(options.max_concurrency, options.max_queue)
    in_flight = InFlight()  # a second Ctrl-C answers what is in flight with 503 (server/lifecycle.py)
    parsing = ThreadPoolExecutor(options.parse_workers, thread_name_prefix="systemone-parse")
    heavy_lane = ThreadPoolExecutor(options.heavy_parse_workers, thread_name_prefix="systemone-parse-long")
    body_memory = BodyMemory(options.max_body_memory)
    metrics = Metrics()
    started = int(time.time())
    release_date = service.artifact.manifest.exported_at[:10]

    def unauthorized(exc: Unauthorized) -> JSONResponse:
        return error_response(401, str(exc), "AuthenticationError", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "HTTPError", headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "InternalServerError")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """503 while a new request could not be taken: every slot and queue place held, every media worker busy
        with more media waiting, or too little of the body budget free for a small body (after cutting off the
        bodies that may be)."""
        pool = service.media_pool
        media_full = pool.saturated
        bodies_full = body_memory.room() < READY_BODY_ROOM
        busy = admission.full or media_full or bodies_full
        body = {"status": "busy" if busy else "ready", "running": admission.running,
                "queued": admission.queued, "media_running": pool.running, "media_queued": pool.queued,
                "body_memory_free": body_memory.room()}
        return JSONResponse(body, status_code=503 if busy else 200)

    @app.get("/metrics", response_model=None)
    async def metrics_endpoint(request: Request) -> PlainTextResponse | JSONResponse:
        try:
            check_bearer(request.headers.get("authorization"), options.api_key)
        except Unauthorized as exc:
            return unauthorized(exc)
        pool = service.media_pool
        return PlainTextResponse(metrics.render(admission.running, admission.queued, pool.running, scheduler.work(),
                                                pool.load_s, pool.pixels.fallbacks, pool.pixels.in_processes),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            check_bearer(request.headers.get("authorization"), options.api_key)
        except Unauthorized as exc:
            return unauthorized(exc)
        names = service.served_model_names
        description = (f"{service.family.name} decision model ({service.artifact.source}) on onnxruntime "
                       f"{service.provider}")
        return JSONResponse({
            "object": "list",
            "data": [{"id": name, "object": "model", "created": started, "owned_by": "systemone-onnx",
                      "max_model_len": service.max_model_len} for name in names],
            "models": [{"name": name, "description": description, "release_date": release_date} for name in names],
        })

    @app.post("/v1/systemone", **ROUTE_DOCS)
    async def systemone(request: Request) -> JSONResponse:
        start = time.monotonic()
        request_id = request.headers.get("x-request-id")
        usage, questions = 0, 0
        try:
            answer = await _answer(request, request_id)
            usage, questions = answer["usage"]["input_tokens"], len(answer["answers"])
            response = JSONResponse(answer)
        except Unauthorized as exc:
            response = unauthorized(exc)
        except SchemaError as exc:
            response = schema_error_response(exc)
        except DecisionError as exc:
            if isinstance(exc, ModelFault):  # the server's fault, not the client's: the operator hears of it
                log.error("request %s: %s", request_id or "-", exc.message)
            response = decision_error_response(exc)
        except (ClientGone, ClientDisconnect) as exc:
            # Not our error: the client left (mid-upload, or while waiting); counted, logged in one line.
            response = error_response(400, "Client disconnected", "BadRequestError")
            response.status_code = CLIENT_GONE_STATUS
            if isinstance(exc, ClientDisconnect):
                metrics.client_aborted_upload()
        if request_id:
            response.headers["X-Request-Id"] = request_id
        seconds = time.monotonic() - start
        metrics.observe(response.status_code, seconds, usage, questions)
        log.info("request %s status=%s questions=%d input_tokens=%d seconds=%.3f", request_id or "-",
                 response.status_code, questions, usage, seconds)
        return response

    async def _receive(request: Request, charge: BodyCharge, cut_off: asyncio.Future[BodyMemoryFull],
                       deadline: Deadline) -> bytes:
        """The body, charged as it arrives; under the request's deadline too (a client that drips its body is cut
        off: 408), and ended at once when the body memory cuts it off to make room for others (503)."""
        reading = asyncio.ensure_future(read_capped(request.stream(), request.headers.get("content-length"),
                                                    options.max_body_bytes, charge))
        try:
            done, _ = await asyncio.wait((reading, cut_off), timeout=deadline.timeout(),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not reading.done():
                reading.cancel()
                await asyncio.gather(reading, return_exceptions=True)
        if reading in done:
            raw = reading.result()
            charge.received()
            return raw
        if cut_off.done():
            raise cut_off.result()
        raise BodyTimeout(f"request body not received within {options.request_timeout_s:g} s (--request-timeout)")

    async def _answer(request: Request, request_id: str | None) -> dict[str, Any]:
        check_bearer(request.headers.get("authorization"), options.api_key)
        if not _is_json(request.headers.get("content-type")):
            raise NotJson(UNSUPPORTED_MEDIA_MESSAGE)
        if "content-length" in request.headers and "transfer-encoding" in request.headers:
            raise DecisionError("a request may not carry both Content-Length and Transfer-Encoding")
        deadline = Deadline(options.request_timeout_s)
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[object] | None = None  # done when the client leaves, once its body is read

        def parse(raw: bytes):
            body = parse_json(raw)
            if options.log_requests:
                log.info("request %s body %s", request_id or "-", json.dumps(body, ensure_ascii=False)[:10000])
            return service.validate(body)

        def parse_text(raw: bytes) -> tuple[Any, list[Any], bool, Prepared | None]:
            # A light request without media is parsed and prepared in one trip to a parsing thread (each trip is
            # event loop work: a future, a wake-up and its callbacks).
            checked, questions = parse(raw)
            heavy = text_bytes(raw, checked) > HEAVY_TEXT_BYTES
            if heavy or service.has_media(checked):
                return checked, questions, heavy, None
            return checked, questions, heavy, service.prepare_loaded(checked, questions, None, None, deadline)

        async def prepare(raw: bytes) -> Prepared:
            # Every check runs here (media read, prompts and labels included), before the request takes a slot.
            # Parsing threads never wait on media: the media pool's jobs are awaited on the event loop.
            checked, questions, heavy, prepared = await loop.run_in_executor(parsing, parse_text, raw)
            if prepared is not None:
                return prepared
            # Long texts are rendered and tokenized in their own lane, so that requests of ordinary size never
            # queue behind them for a parsing thread.
            lane = heavy_lane if heavy else parsing
            if not service.has_media(checked):
                return await loop.run_in_executor(lane, service.prepare_loaded, checked, questions, None, None,
                                                  deadline)
            # The prompts are drafted in a parsing thread while the media load (runtime/media_pool.py, MediaLoad).
            loading = service.media_pool.begin(service.engine.media, checked, deadline)
            draft, media = await loading.with_draft_async(
                loop.run_in_executor(lane, service.engine.draft, checked, questions))
            deadline.check()
            return await loop.run_in_executor(lane, service.prepare_loaded, checked, questions, media, draft,
                                              deadline)

        try:
            cut_off: asyncio.Future[BodyMemoryFull] = loop.create_future()  # the body cut off to make room
            # What the body holds, from its first byte until it is prepared.
            with body_memory.charge(lambda error: cut_off.done() or cut_off.set_result(error)) as charge:
                raw = await _receive(request, charge, cut_off, deadline)
                encoding = request.headers.get("content-encoding")
                if encoding:  # inflated first (at most the body cap), so the body is charged at its real size
                    charge.at_least(len(raw) + options.max_body_bytes)
                    raw = await loop.run_in_executor(parsing, decode_content, raw, encoding, options.max_body_bytes)
                # The bound takes ~0.15 s for 64 MiB: a small body's is counted here, a large one's in a thread.
                bound = (parsed_size_bound(raw) if len(raw) <= INLINE_BOUND_BYTES
                         else await loop.run_in_executor(parsing, parsed_size_bound, raw))
                charge.set(bound, parsing=True)
                gone = asyncio.ensure_future(client_gone(request.receive))
                prepared = await watch(prepare(raw), deadline, gone, in_flight)

            async def answer() -> dict[str, Any]:
                readouts = await asyncio.wrap_future(scheduler.submit(prepared, deadline))
                return service.respond(prepared, readouts, request_id)

            return await admission.run(answer, deadline, gone, in_flight)
        finally:
            deadline.cancel()  # whatever still runs for this request stops
            if gone is not None:
                gone.cancel()

    document_request_body(app)
    if options.api_key is None:
        add_docs_pages(app)
    app.state.admission = admission
    app.state.in_flight = in_flight
    app.state.scheduler = scheduler
    app.state.batch_sizing = sizing
    app.state.metrics = metrics
    return app
