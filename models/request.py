"""The request body: its schema (spec 1.2, decisions 2-3) and the family-independent checks of spec 1.3.

Schema problems (wrong JSON types, missing `state` or `questions`) are collected and answered 422 in FastAPI's
shape; unknown top-level fields are ignored (decision 3); semantic problems raise `DecisionError` (400).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import DecisionError, SchemaError, SchemaIssue

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")
MODALITY_FIELDS = (("images", "image"), ("audio", "audio"), ("videos", "video"))


@dataclass
class DecisionRequest:
    state: Any
    questions: dict[str, dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    images: list[str] | None = None
    audio: list[str] | None = None
    videos: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    joint: bool = False
    request_id: str | None = None

    def modalities(self) -> set[str]:
        """Modalities with a non-empty list (null and [] are ignored, spec 1.3 step 5)."""
        return {name for attr, name in MODALITY_FIELDS if getattr(self, attr)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_cache_salt(body: Mapping[str, Any]) -> None:
    if "cache_salt" not in body or body["cache_salt"] is None:
        return
    salt = body["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise DecisionError("Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
                            param="cache_salt")
    if len(salt) > 128 or any(c in salt for c in CACHE_SALT_FORBIDDEN):
        raise DecisionError("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                            "'@', '/', '\\\\', or NUL. (parameter=cache_salt)", param="cache_salt")


def parse_request(body: Any) -> DecisionRequest:
    """Validate a decoded JSON body into a `DecisionRequest` (spec 1.3 step 1)."""
    if not isinstance(body, Mapping):
        raise SchemaError([SchemaIssue((), "Input should be a valid dictionary or object to extract fields from",
                                       "model_attributes_type")])
    _check_cache_salt(body)
    issues: list[SchemaIssue] = []

    def optional(name: str, ok, msg: str, kind: str) -> None:
        if name in body and body[name] is not None and not ok(body[name]):
            issues.append(SchemaIssue((name,), msg, kind))

    for name in ("state", "questions"):
        if name not in body:
            issues.append(SchemaIssue((name,), "Field required", "missing"))
    questions = body.get("questions")
    if "questions" in body:
        if not isinstance(questions, Mapping):
            issues.append(SchemaIssue(("questions",), "Input should be a valid dictionary", "dict_type"))
        else:
            for qid, spec in questions.items():
                if not isinstance(spec, Mapping):
                    issues.append(SchemaIssue(("questions", qid), "Input should be a valid dictionary or object to "
                                              "extract fields from", "model_attributes_type"))
                elif "type" not in spec:
                    issues.append(SchemaIssue(("questions", qid, "type"), "Field required", "missing"))
                elif not isinstance(spec["type"], str):
                    issues.append(SchemaIssue(("questions", qid, "type"), "Input should be a valid string",
                                              "string_type"))
    for name in ("model", "instructions", "request_id"):
        optional(name, lambda v: isinstance(v, str), "Input should be a valid string", "string_type")
    if "request_id" in body and body["request_id"] is None:
        issues.append(SchemaIssue(("request_id",), "Input should be a valid string", "string_type"))
    for name, _ in MODALITY_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, list):
            issues.append(SchemaIssue((name,), "Input should be a valid list", "list_type"))
            continue
        for index, item in enumerate(value):
            if not isinstance(item, str):
                issues.append(SchemaIssue((name, index), "Input should be a valid string", "string_type"))
    optional("chat_template_kwargs", lambda v: isinstance(v, Mapping), "Input should be a valid dictionary",
             "dict_type")
    if "joint" in body and not isinstance(body["joint"], bool):
        issues.append(SchemaIssue(("joint",), "Input should be a valid boolean", "bool_type"))
    if "priority" in body:
        priority = body["priority"]
        if not _is_int(priority):
            issues.append(SchemaIssue(("priority",), "Input should be a valid integer", "int_type"))
        elif not INT64_MIN <= priority <= INT64_MAX:
            issues.append(SchemaIssue(("priority",), "Input should be a valid 64-bit integer", "int_type"))
    if issues:
        raise SchemaError(issues)

    # `cache_salt` and `priority` are validated as vLLM validates them, then dropped: this server keeps no prefix
    # cache across requests to salt, and serves in arrival order. Unknown fields are ignored (decision 3).
    return DecisionRequest(
        state=body["state"],
        questions=dict(questions),
        model=body.get("model"),
        instructions=body.get("instructions"),
        images=body.get("images"),
        audio=body.get("audio"),
        videos=body.get("videos"),
        chat_template_kwargs=body.get("chat_template_kwargs"),
        joint=body.get("joint", False),
        request_id=body.get("request_id"),
    )
