"""The question model shared by every family (spec 2.1-2.4, 1.3 step 4).

Python's `str()` and `repr()` of the JSON values decide prompt text and error messages (spec 2.6), so values are
kept as `json.loads` gives them and formatted with the builtins.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import DecisionError

QUESTION_TYPES = ("choice", "noul", "score")
QUESTION_FIELDS = frozenset({"type", "instructions", "criteria"})
MAX_QUESTIONS = 64

# Generic label sets (spec 2.4): a question's labels are the first N of its type's set.
LABELS = {
    "choice": tuple(chr(c) for c in range(ord("A"), ord("Z") + 1)),
    "noul": ("yes", "no"),
    "score": tuple(str(d) for d in range(10)),
}


@dataclass(frozen=True)
class Option:
    name: str
    description: str | None


@dataclass(frozen=True)
class Question:
    id: str
    type: str
    options: tuple[Option, ...]
    instructions: str

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.options]


def coerce_text(value: Any) -> str:
    """Instructions coercion (spec 2.2): strings unchanged, null -> "", anything else -> Python str()."""
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def _described(value: Any) -> str | None:
    return None if value is None else str(value)


def parse_options(qid: str, qtype: str, criteria: Any) -> tuple[Option, ...]:
    """Criteria -> options, with vLLM's messages (spec 2.1)."""
    if qtype == "choice":
        if not isinstance(criteria, Mapping) or not criteria:
            raise DecisionError(f"question {qid!r}: choice criteria must map option names to a description or null")
        return tuple(Option(str(name), _described(desc)) for name, desc in criteria.items())
    if qtype == "noul":
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, Mapping) or not set(criteria) <= {"true", "false"}:
            raise DecisionError(f"question {qid!r}: noul criteria must be an object with true and false")
        return (Option("yes", _described(criteria.get("true"))), Option("no", _described(criteria.get("false"))))
    if not isinstance(criteria, list) or len(criteria) < 2:
        raise DecisionError(f"question {qid!r}: score criteria must be an ordered list of levels")
    return tuple(Option(str(level), None) for level in criteria)


def parse_questions(questions: Mapping[str, Mapping[str, Any]],
                    option_limit: Callable[[str], int]) -> list[Question]:
    """Step 4 of the validation pipeline (spec 1.3): first failure wins, questions in request order.

    `option_limit(type)` is the family's limit (spec 2.3). The mapping's values have already passed the schema
    (each an object with a string `type`).
    """
    if not questions:
        raise DecisionError("questions: needs at least one question")
    if len(questions) > MAX_QUESTIONS:
        raise DecisionError(f"questions: at most {MAX_QUESTIONS} for this model")
    parsed = []
    for qid, spec in questions.items():
        unknown = sorted(set(spec) - QUESTION_FIELDS)
        if unknown:
            raise DecisionError(f"question {qid!r}: unknown field(s) {unknown!r}")
        if qid == "":
            raise DecisionError("question ids must be non-empty")
        qtype = spec["type"]
        if qtype not in QUESTION_TYPES:
            raise DecisionError(f"unknown question type {qtype!r}; supported: {list(QUESTION_TYPES)!r}")
        options = parse_options(qid, qtype, spec.get("criteria"))
        if not options:
            raise DecisionError(f"question {qid!r}: needs at least one option")
        if len({o.name for o in options}) != len(options):
            raise DecisionError(f"question {qid!r}: duplicate option names")
        limit = option_limit(qtype)
        if len(options) > limit:
            raise DecisionError(f"question {qid!r}: at most {limit} options for this model")
        parsed.append(Question(qid, qtype, options, coerce_text(spec.get("instructions", ""))))
    return parsed
