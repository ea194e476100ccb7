"""The question model every family shares: one registered class per question type (spec 2.1-2.5, 5.1).

A type owns how its criteria parse into options and how a read becomes its answer; a family adds only how the
type is asked and read (its prompt text and labels). Python's `str()` and `repr()` of the JSON values decide
prompt text and error messages (spec 2.6), so values are kept as `json.loads` gives them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import DecisionError

QUESTION_FIELDS = frozenset({"type", "instructions", "criteria"})
MAX_QUESTIONS = 64


@dataclass(frozen=True)
class Option:
    name: str
    description: str | None


@dataclass(frozen=True)
class Read:
    """One question's read (spec 2.5): a probability per option in option order, label mass, argmax check."""

    probs: tuple[float, ...]
    label_mass: float
    argmax_is_label: bool


def first_argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (Python's max over a list picks the first on ties)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _described(value: Any) -> str | None:
    return None if value is None else str(value)


class QuestionType(ABC):
    """One question type: its generic labels (spec 2.4), its criteria parsing (2.1) and its answer (5.1)."""

    name: ClassVar[str]
    labels: ClassVar[tuple[str, ...]]

    @abstractmethod
    def parse_options(self, qid: str, criteria: Any) -> tuple[Option, ...]:
        """Criteria -> options, with vLLM's messages."""

    @abstractmethod
    def answer(self, question: Question, read: Read) -> dict[str, Any]:
        """The answer object, keys in vLLM's order."""


QUESTION_TYPES: dict[str, QuestionType] = {}


def question_type(cls: type[QuestionType]) -> type[QuestionType]:
    """Register a question type under its name."""
    QUESTION_TYPES[cls.name] = cls()
    return cls


@question_type
class Choice(QuestionType):
    name = "choice"
    labels = tuple(chr(c) for c in range(ord("A"), ord("Z") + 1))

    def parse_options(self, qid: str, criteria: Any) -> tuple[Option, ...]:
        if not isinstance(criteria, Mapping) or not criteria:
            raise DecisionError(f"question {qid!r}: choice criteria must map option names to a description or null")
        return tuple(Option(str(name), _described(desc)) for name, desc in criteria.items())

    def answer(self, question: Question, read: Read) -> dict[str, Any]:
        probs = list(read.probs)
        top = first_argmax(probs)
        return {"type": "choice", "choice": question.options[top].name,
                "probabilities": dict(zip(question.names, probs)), "confidence": probs[top] * read.label_mass}


@question_type
class Noul(QuestionType):
    name = "noul"
    labels = ("yes", "no")

    def parse_options(self, qid: str, criteria: Any) -> tuple[Option, ...]:
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, Mapping) or not set(criteria) <= {"true", "false"}:
            raise DecisionError(f"question {qid!r}: noul criteria must be an object with true and false")
        return (Option("yes", _described(criteria.get("true"))), Option("no", _described(criteria.get("false"))))

    def answer(self, question: Question, read: Read) -> dict[str, Any]:
        yes, no = read.probs
        return {"type": "noul", "noul": yes, "probabilities": {"yes": yes, "no": no},
                "confidence": max(yes, no) * read.label_mass}


@question_type
class Score(QuestionType):
    name = "score"
    labels = tuple(str(d) for d in range(10))

    def parse_options(self, qid: str, criteria: Any) -> tuple[Option, ...]:
        if not isinstance(criteria, list):
            raise DecisionError(f"question {qid!r}: score criteria must be an ordered list of levels")
        if len(criteria) < 2:
            # vLLM repeats the message above to a client who did send a list; ours names what is wrong (400 kept).
            raise DecisionError(f"question {qid!r}: score criteria need at least 2 levels (got {len(criteria)})")
        return tuple(Option(str(level), None) for level in criteria)

    def answer(self, question: Question, read: Read) -> dict[str, Any]:
        probs = list(read.probs)
        top = first_argmax(probs)
        labels = self.labels[: len(probs)]
        return {"type": "score", "score": sum(i * p for i, p in enumerate(probs)),
                "legend": dict(zip(labels, question.names)), "probabilities": dict(zip(labels, probs)),
                "confidence": probs[top] * read.label_mass}


@dataclass(frozen=True)
class Question:
    id: str
    type: str
    options: tuple[Option, ...]
    instructions: str

    @property
    def kind(self) -> QuestionType:
        return QUESTION_TYPES[self.type]

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.options]

    def answer(self, read: Read) -> dict[str, Any]:
        return self.kind.answer(self, read)


def coerce_text(value: Any) -> str:
    """Instructions coercion (spec 2.2): strings unchanged, null -> "", anything else -> Python str()."""
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


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
        kind = QUESTION_TYPES.get(spec["type"])
        if kind is None:
            raise DecisionError(f"unknown question type {spec['type']!r}; supported: {list(QUESTION_TYPES)!r}")
        options = kind.parse_options(qid, spec.get("criteria"))
        if not options:
            raise DecisionError(f"question {qid!r}: needs at least one option")
        if len({o.name for o in options}) != len(options):
            raise DecisionError(f"question {qid!r}: duplicate option names")
        limit = option_limit(kind.name)
        if len(options) > limit:
            raise DecisionError(f"question {qid!r}: at most {limit} options for this model")
        parsed.append(Question(qid, kind.name, options, coerce_text(spec.get("instructions", ""))))
    return parsed
