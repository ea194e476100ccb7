"""The request and response bodies of `POST /v1/systemone` as typed models, for the OpenAPI schema (`/docs`) only.

Bodies are never parsed through these: models/request.py does that, so its statuses and messages (spec 1.3-1.5,
decisions 2-3) stay exactly as they are. These models say the same in the form OpenAPI tools read; a test holds them
to the fields the parser takes (docs/api.md is the prose version)."""

from __future__ import annotations

from typing import Any, Literal, Union

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

REF = "#/components/schemas/{model}"
ROUTE = "/v1/systemone"


class NoulQuestion(BaseModel):
    """A yes-or-no question: the answer is P(yes)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "example": {"type": "noul", "instructions": "Does this need a reply today?"}})
    type: Literal["noul"]
    instructions: Any = Field("", description="the question's text; null is \"\", other JSON values are str()'d")
    criteria: dict[Literal["true", "false"], str | None] | None = Field(
        None, description="optional descriptions of the yes (`true`) and no (`false`) sides")


class ChoiceQuestion(BaseModel):
    """Pick one option: the answer is the most probable option name."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"example": {
        "type": "choice", "instructions": "Which team should handle it?",
        "criteria": {"billing": "payments and refunds", "shipping": "deliveries", "other": None}}})
    type: Literal["choice"]
    instructions: Any = Field("", description="the question's text")
    criteria: dict[str, str | None] = Field(
        description="option name -> description or null, in order; at least 1, at most 26 (d1) or the "
                    "checkpoint's code count (d3, 255 for the released models)")


class ScoreQuestion(BaseModel):
    """Rate on ordered levels: the answer is the expected level index."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"example": {
        "type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]}})
    type: Literal["score"]
    instructions: Any = Field("", description="the question's text")
    criteria: list[str | int | float] = Field(min_length=2, max_length=10,
                                              description="the levels, lowest first (level i is index i); 2 to 10")


Question = Union[NoulQuestion, ChoiceQuestion, ScoreQuestion]


class DecisionRequest(BaseModel):
    """One state and the questions asked about it."""

    model_config = ConfigDict(json_schema_extra={"example": {
        "model": "d3-tiny",
        "state": {"ticket": "I was charged twice for order 1234 and nobody answers my emails.", "tier": "gold"},
        "questions": {"urgent": {"type": "noul", "instructions": "Does this need a reply today?"},
                      "anger": {"type": "score", "instructions": "How angry is the customer?",
                                "criteria": ["calm", "annoyed", "furious"]}}}})
    model: str | None = Field(None, description="a served name or `jev-latest`; null or \"\" skips the check (404 "
                                                "otherwise)")
    state: Any = Field(description="what the questions are about: any JSON value (null allowed), required")
    questions: dict[str, Question] = Field(
        description="question id -> question, 1 to 64; answers come back in this order")
    instructions: str | None = Field(None, description="d1: a system turn; d3: must be empty (400)")
    images: list[str] | None = Field(None, description="http(s), data: or allowed file:// URLs (d1, d3)")
    videos: list[str] | None = Field(None, description="video URLs (d3 only)")
    audio: list[str] | None = Field(None, description="no family takes audio (400 when non-empty)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="d1 only, e.g. enable_thinking: false")
    joint: bool = Field(False, description="true is a 400: d1 and d3 read each question on its own")
    cache_salt: str | None = Field(None, description="non-empty, at most 128 characters, no @ / \\ or NUL")
    priority: int = Field(0, description="accepted for compatibility; requests run in arrival order")
    request_id: str | None = Field(None, description="becomes the response id (after X-Request-Id)")


class NoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(description="P(yes)")
    probabilities: dict[Literal["yes", "no"], float]
    confidence: float = Field(description="max(P(yes), P(no)) x label_mass")


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str = Field(description="the most probable option (the first on a tie)")
    probabilities: dict[str, float] = Field(description="option name -> probability, in option order")
    confidence: float = Field(description="top probability x label_mass")


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="expected level index, sum of i x p_i, not rounded")
    legend: dict[str, str] = Field(description="\"0\", \"1\", ... -> the level it stands for")
    probabilities: dict[str, float] = Field(description="\"0\", \"1\", ... -> probability")
    confidence: float = Field(description="top probability x label_mass")


class Usage(BaseModel):
    input_tokens: int = Field(description="the questions' prompt lengths, summed")
    output_tokens: int = Field(description="d1: one per question; d3: 0")


class Diagnostic(BaseModel):
    label_mass: float = Field(description="d1: probability of all label tokens together; d3: always 1.0")
    argmax_is_label: bool = Field(description="d1: whether the greedy token was a label; d3: always true")


class DecisionResponse(BaseModel):
    id: str = Field(description="\"decision-\" + X-Request-Id, request_id, or 16 random hex digits")
    object: Literal["structured_decision"]
    created: int = Field(description="unix time")
    model: str = Field(description="the served name (the first one), whatever name the request used")
    answers: dict[str, Union[NoulAnswer, ChoiceAnswer, ScoreAnswer]]
    usage: Usage
    diagnostics: dict[str, Diagnostic]
    joint: None


class ErrorPart(BaseModel):
    message: str
    type: str = Field(description="e.g. BadRequestError, NotFoundError, UnprocessableEntityError")
    param: str | None
    code: int = Field(description="the HTTP status")


class ErrorDetail(BaseModel):
    error_type: str = Field(description="the status's kind, e.g. invalid_request_error, not_found_error")
    message: str


class ErrorBody(BaseModel):
    """Every error but a schema error: vLLM's `error` part and FastAPI's `detail` part (decision 2)."""

    error: ErrorPart
    detail: ErrorDetail


class SchemaIssue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class SchemaErrorBody(BaseModel):
    """A body of the wrong shape: FastAPI's 422."""

    detail: list[SchemaIssue]


ROUTE_DOCS: dict[str, Any] = {
    "summary": "Answer questions about a state",
    "responses": {
        200: {"model": DecisionResponse, "description": "one answer per question, in request order"},
        400: {"model": ErrorBody, "description": "a semantic error (vLLM's message), or a non-JSON Content-Type"},
        401: {"model": ErrorBody, "description": "missing or wrong API key (only with --api-key)"},
        404: {"model": ErrorBody, "description": "unknown model name"},
        413: {"model": ErrorBody, "description": "body or media download over its cap"},
        415: {"model": ErrorBody, "description": "a Content-Encoding other than zstd or gzip"},
        422: {"model": Union[SchemaErrorBody, ErrorBody],
              "description": "schema error (FastAPI's shape), or a media URL that cannot be fetched or decoded"},
        503: {"model": ErrorBody, "description": "server full or request timed out; see Retry-After"},
    },
}


def document_request_body(app: FastAPI) -> None:
    """Add the request body to the route's OpenAPI operation (the route reads its body itself, so FastAPI cannot
    see it)."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = plain()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        request = DecisionRequest.model_json_schema(ref_template=REF)
        components.update(request.pop("$defs", {}))
        components["DecisionRequest"] = request
        schema["paths"][ROUTE]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model="DecisionRequest")}}}}
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
