"""What every decision-model family shares: the read contract (spec 2.5) and the answers built from it (spec 5).

A family (d1, d3) says how a question becomes a prompt and how the model's numbers become a `Read`; this module
turns reads into answers, the same way for every family.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .questions import LABELS, Question
from .request import DecisionRequest


@dataclass(frozen=True)
class Read:
    """One question's read (spec 2.5): a probability per option in option order, label mass, argmax check."""

    probs: tuple[float, ...]
    label_mass: float
    argmax_is_label: bool


def label_softmax(scores: Sequence[float]) -> list[float]:
    """Softmax as vLLM computes it (spec 2.5): subtract the max, math.exp, divide by the left-to-right sum."""
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def first_argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def build_answer(question: Question, read: Read) -> dict[str, Any]:
    """The answer object of one question (spec 5.1), keys in vLLM's order."""
    probs = list(read.probs)
    if question.type == "noul":
        yes, no = probs
        return {"type": "noul", "noul": yes, "probabilities": {"yes": yes, "no": no},
                "confidence": max(yes, no) * read.label_mass}
    top = first_argmax(probs)
    confidence = probs[top] * read.label_mass
    if question.type == "choice":
        return {"type": "choice", "choice": question.options[top].name,
                "probabilities": dict(zip(question.names, probs)), "confidence": confidence}
    labels = LABELS["score"][: len(probs)]
    return {"type": "score", "score": sum(i * p for i, p in enumerate(probs)),
            "legend": dict(zip(labels, question.names)), "probabilities": dict(zip(labels, probs)),
            "confidence": confidence}


class Family(ABC):
    """One model family's contract: limits, prompt, read. Subclasses hold every prompt string of their family and
    a `read` from what their graph computes (d1: label log-probabilities, d3: code logits) to a `Read`."""

    name: str
    modalities: frozenset[str]

    @abstractmethod
    def option_limit(self, question_type: str) -> int:
        """The most options a question of this type may have (spec 2.3)."""

    @abstractmethod
    def check_request(self, request: DecisionRequest, questions: list[Question]) -> None:
        """The family's own checks that run before any media is fetched (spec 1.3 step 8)."""

    @abstractmethod
    def render_state(self, state: Any) -> str:
        """The state as the prompt shows it."""

    @abstractmethod
    def messages(self, request: DecisionRequest, question: Question, state_text: str) -> list[dict[str, Any]]:
        """The chat messages of one question."""

    def template_kwargs(self, request: DecisionRequest) -> dict[str, Any]:
        """The chat-template variables of a request's prompts: the generation prompt on, thinking off."""
        return {"add_generation_prompt": True, "enable_thinking": False}

    def output_tokens(self, questions: Sequence[Question]) -> int:
        """Tokens generated for these questions (spec 5.3)."""
        return 0
