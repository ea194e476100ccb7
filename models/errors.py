"""Errors a request can raise, each carrying the HTTP status and body parts vLLM gives it (spec 1.4, README 2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DecisionError(Exception):
    """A semantic error: vLLM's message text, its status (400 unless said) and OpenAI-style type and param."""

    def __init__(self, message: str, status: int = 400, type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param


class ModelNotFound(DecisionError):
    def __init__(self, model: str, served: list[str]):
        super().__init__(f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
                         status=404, type="NotFoundError", param="model")


@dataclass
class SchemaIssue:
    """One schema problem, in FastAPI's `{"loc", "msg", "type"}` shape."""

    loc: tuple[Any, ...]
    msg: str
    type: str
    input: Any = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"loc": ["body", *self.loc], "msg": self.msg, "type": self.type}


class SchemaError(Exception):
    """The body does not have the request's shape: answered 422 with every problem found (README decision 2)."""

    def __init__(self, issues: list[SchemaIssue]):
        super().__init__("; ".join(f"{'.'.join(map(str, i.loc))}: {i.msg}" for i in issues))
        self.issues = issues
