"""Error bodies that serve both client families (decision 2, spec 1.4).

Semantic errors: vLLM's status and message, in `{"error": {...}, "detail": {"error_type", "message"}}`.
Schema errors: 422 in FastAPI's `{"detail": [{"loc", "msg", "type"}]}` shape.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse

from ..models.errors import (DecisionError, ModelFault, ModelNotFound, NotSupported, SchemaError, TooLarge,
                             Unavailable, UnsupportedEncoding, Unreadable)
from .body import BodyTimeout, NotJson

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type",
               422: "unprocessable_entity_error", 431: "request_header_fields_too_large", 500: "server_error",
               503: "overloaded_error"}

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
    """The error's JSON, its message sanitized: the server's responses and `systemone ask`'s printout alike."""
    message = sanitize(message)
    return {"error": {"message": message, "type": type, "param": param, "code": status},
            "detail": {"error_type": ERROR_TYPES.get(status, "error"), "message": message}}


def error_response(status: int, message: str, type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type, param), status_code=status, headers=headers)


# Each domain error's HTTP status and OpenAI-style type; the first class of the error's MRO listed here wins.
STATUSES: dict[type[DecisionError], tuple[int, str]] = {
    ModelNotFound: (404, "NotFoundError"),
    ModelFault: (500, "InternalServerError"),
    NotSupported: (501, "NotImplementedError"),
    TooLarge: (413, "RequestEntityTooLarge"),
    UnsupportedEncoding: (415, "UnsupportedMediaType"),
    Unreadable: (422, "UnprocessableEntityError"),
    Unavailable: (503, "ServiceUnavailableError"),
    NotJson: (400, "Bad Request"),
    BodyTimeout: (408, "RequestTimeout"),
    DecisionError: (400, "BadRequestError"),
}


def http_status(exc: DecisionError) -> tuple[int, str]:
    """The status and type a domain error is answered with."""
    return next(STATUSES[cls] for cls in type(exc).__mro__ if cls in STATUSES)


def decision_error_response(exc: DecisionError) -> JSONResponse:
    status, kind = http_status(exc)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Unavailable) else None
    return error_response(status, exc.message, kind, exc.param, headers=headers)


def schema_error_response(exc: SchemaError) -> JSONResponse:
    return JSONResponse({"detail": [issue.as_dict() for issue in exc.issues]}, status_code=422)
