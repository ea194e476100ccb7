"""What can be wrong with a request, in the domain's terms. The server maps each kind to its HTTP status
(server/errors.py); nothing here knows HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DecisionError(Exception):
    """A request the model cannot answer as sent: vLLM's message text (spec 1.4), and the field it names."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelNotFound(DecisionError):
    def __init__(self, model: str, served: list[str]):
        super().__init__(f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.", param="model")


class NotSupported(DecisionError):
    """The loaded model cannot serve decisions at all (spec 1.1: every call is refused)."""


class TooLarge(DecisionError):
    """Input over a size limit the server enforces (body, download)."""


class UnsupportedEncoding(DecisionError):
    """A body encoding the server does not decode."""


class Unreadable(DecisionError):
    """Input that is well formed but cannot be fetched or decoded (decision 1)."""


class Unavailable(DecisionError):
    """The server cannot take or finish the request now (full, or out of time); the client may retry."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelFault(DecisionError):
    """The model's graphs gave a score that is no number (NaN or infinite): a fault of the model or of its export,
    not of the request, so no retry of it helps."""


class DeviceMemoryExhausted(Unavailable):
    """A graph run needed more device memory than the graph's arena may hold (--gpu-memory) at that moment."""


class TimedOut(Unavailable):
    """The request ran past its deadline (--request-timeout) and its work was stopped."""


@dataclass
class SchemaIssue:
    """One schema problem, in FastAPI's `{"loc", "msg", "type"}` shape."""

    loc: tuple[Any, ...]
    msg: str
    type: str

    def as_dict(self) -> dict[str, Any]:
        return {"loc": ["body", *self.loc], "msg": self.msg, "type": self.type}


class SchemaError(Exception):
    """The body does not have the request's shape: every problem found is reported (decision 2)."""

    def __init__(self, issues: list[SchemaIssue]):
        super().__init__("; ".join(f"{'.'.join(map(str, i.loc))}: {i.msg}" for i in issues))
        self.issues = issues
