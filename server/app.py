"""The HTTP surface: `POST /v1/systemone`, `GET /v1/models`, `GET /health`, `GET /metrics` (spec 1, 5, 6; README).

A request flows: auth -> body (size cap, zstd/gzip, JSON) -> admission (bounded running + queue, time limit,
disconnect) -> `DecisionService.decide` in a worker thread -> JSON. Anything a client sends ends in a JSON 2xx/4xx;
5xx means our bug (500) or a full server (503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import onnxruntime as ort
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..models.errors import DecisionError, SchemaError
from ..runtime.engine import Prepared
from ..runtime.service import DecisionService
from .admission import Admission, ClientGone
from .auth import Unauthorized, check_bearer
from .body import NotJson, decode_content, parse_json, read_capped
from .errors import decision_error_response, error_response, schema_error_response
from .metrics import Metrics
from .schema import ROUTE_DOCS, document_request_body

log = logging.getLogger("systemone.server")

JSON_MEDIA_TYPE = "application/json"
UNSUPPORTED_MEDIA_MESSAGE = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": logged and counted; nobody reads it


@dataclass
class ServerOptions:
    api_key: str | None = None
    max_concurrency: int = 1
    max_queue: int = 16
    request_timeout_s: float = 60.0
    max_body_bytes: int = 64 << 20
    log_requests: bool = False


def _is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def create_app(service: DecisionService, options: ServerOptions | None = None) -> FastAPI:
    """The app for one loaded model."""
    options = options or ServerOptions()
    app = FastAPI(title="systemone-onnx", version="0.1.0")
    admission = Admission(options.max_concurrency, options.max_queue, options.request_timeout_s)
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

    @app.get("/metrics")
    async def metrics_endpoint() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(admission.running, admission.queued),
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
            response = decision_error_response(exc)
        except ClientGone:
            response = error_response(400, "Client disconnected", "BadRequestError")
            response.status_code = CLIENT_GONE_STATUS
        if request_id:
            response.headers["X-Request-Id"] = request_id
        seconds = time.monotonic() - start
        metrics.observe(response.status_code, seconds, usage, questions)
        log.info("request %s status=%s questions=%d input_tokens=%d seconds=%.3f", request_id or "-",
                 response.status_code, questions, usage, seconds)
        return response

    async def _answer(request: Request, request_id: str | None) -> dict[str, Any]:
        check_bearer(request.headers.get("authorization"), options.api_key)
        if not _is_json(request.headers.get("content-type")):
            raise NotJson(UNSUPPORTED_MEDIA_MESSAGE)
        raw = await read_capped(request.stream(), request.headers.get("content-length"), options.max_body_bytes)

        def read_and_prepare(raw: bytes) -> Prepared:
            body = parse_json(decode_content(raw, request.headers.get("content-encoding"), options.max_body_bytes))
            if options.log_requests:
                log.info("request %s body %s", request_id or "-", json.dumps(body, ensure_ascii=False)[:10000])
            return service.prepare(body)

        # Every check runs here (media read, prompts and labels included), before the request takes a slot.
        prepared = await asyncio.to_thread(read_and_prepare, raw)
        run_options = ort.RunOptions()

        def stop() -> None:
            run_options.terminate = True

        return await admission.run(
            lambda: asyncio.to_thread(service.answer, prepared, request_id, run_options),
            request.is_disconnected, stop)

    document_request_body(app)
    app.state.admission = admission
    app.state.metrics = metrics
    return app
