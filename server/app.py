"""The HTTP surface: `POST /v1/systemone`, `GET /v1/models`, `GET /health` (spec 1, 5, 6; README decisions).

The body is read and decoded here (so that every malformed input gets a JSON 4xx), validated and answered by the
`DecisionService`, whose inference runs in a worker thread so the event loop keeps answering.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..models.errors import DecisionError, SchemaError, SchemaIssue
from ..runtime.service import DecisionService
from .errors import decision_error_response, error_response, schema_error_response

log = logging.getLogger("systemone.server")

JSON_MEDIA_TYPE = "application/json"
UNSUPPORTED_MEDIA_MESSAGE = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"


def _is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def decode_json_body(raw: bytes) -> Any:
    """JSON text -> Python values, as FastAPI would read it; failures become a 422 schema error."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError([SchemaIssue((exc.start,), "JSON decode error", "json_invalid")]) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError([SchemaIssue((exc.pos,), "JSON decode error", "json_invalid")]) from exc
    except RecursionError as exc:
        raise SchemaError([SchemaIssue((), "JSON nested too deeply", "json_invalid")]) from exc


def create_app(service: DecisionService, max_concurrency: int = 1) -> FastAPI:
    """The app for one loaded model. `max_concurrency` bounds the requests running inference at once."""
    app = FastAPI(title="systemone-onnx", version="0.1.0")
    started = int(time.time())
    inference = asyncio.Semaphore(max_concurrency)
    release_date = str(service.artifact.manifest.get("exported_at", ""))[:10]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = service.served_model_names
        description = f"{service.family.name} decision model ({service.artifact.source}), onnxruntime " \
                      f"{service.session.provider}"
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": started, "owned_by": "systemone-onnx",
                      "max_model_len": service.max_model_len} for name in names],
            "models": [{"name": name, "description": description, "release_date": release_date} for name in names],
        }

    @app.post("/v1/systemone")
    async def systemone(request: Request) -> JSONResponse:
        request_id = request.headers.get("x-request-id")
        echo = {"X-Request-Id": request_id} if request_id else None
        if not _is_json(request.headers.get("content-type")):
            return error_response(400, UNSUPPORTED_MEDIA_MESSAGE, "Bad Request", headers=echo)
        try:
            body = decode_json_body(await request.body())
            async with inference:
                response = await asyncio.to_thread(service.decide, body, request_id)
        except SchemaError as exc:
            return schema_error_response(exc)
        except DecisionError as exc:
            return decision_error_response(exc)
        return JSONResponse(response, headers=echo)

    return app
