"""Error bodies that serve both client families (README decision 2, spec 1.4).

Semantic errors: vLLM's status and message, in `{"error": {...}, "detail": {"error_type", "message"}}`.
Schema errors: 422 in FastAPI's `{"detail": [{"loc", "msg", "type"}]}` shape.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

from ..models.errors import DecisionError, SchemaError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 415: "unsupported_media_type", 422: "unprocessable_entity_error",
               500: "server_error", 503: "overloaded_error"}

_OBJECT_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[^\s'\"`,;)]*)?")
_RELATIVE_PATH = re.compile(r"(?<![\w:])[\w.-]+(?:/[\w.-]+)*/[\w-]+\.[A-Za-z0-9]+")


def sanitize(message: str) -> str:
    """Spec 1.4: object addresses dropped, file paths (and URL paths) replaced by `<path>`, ends stripped."""
    message = _OBJECT_ADDRESS.sub(">", message)
    message = _ABSOLUTE_PATH.sub("<path>", message)
    message = _RELATIVE_PATH.sub("<path>", message)
    return message.strip()


def error_body(status: int, message: str, type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": status},
            "detail": {"error_type": ERROR_TYPES.get(status, "error"), "message": message}}


def error_response(status: int, message: str, type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, sanitize(message), type, param), status_code=status, headers=headers)


def decision_error_response(exc: DecisionError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param)


def schema_error_response(exc: SchemaError) -> JSONResponse:
    return JSONResponse({"detail": [issue.as_dict() for issue in exc.issues]}, status_code=422)
