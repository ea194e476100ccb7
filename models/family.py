"""A model family's contract: its limits, its prompt, its labels and its read (spec 2.3, 2.5).

A family (d1, d3) says how a question becomes chat messages, which output slots carry each option (its labels),
and how the numbers its graph gives at those slots become a `Read`. The same `read` signature serves every
family: the engine hands over a `Readout` (the scores at the requested slots, and the greedy slot where the
graph has one), and the question type turns the read into the answer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .questions import Question, Read
from .request import DecisionRequest

Encode = Callable[[str], Sequence[int]]


class StateTooLong(Exception):
    """The state's text would have `length` characters, more than the prompt can hold: it was not made."""

    def __init__(self, length: int):
        super().__init__(length)
        self.length = length


@dataclass(frozen=True)
class Labels:
    """One question's output slots per option, in option order (d1: label token ids, several forms an option;
    d3: answer-code indices of the readout)."""

    groups: tuple[tuple[int, ...], ...]

    @property
    def ids(self) -> list[int]:
        return [i for group in self.groups for i in group]


@dataclass(frozen=True)
class Readout:
    """What the graph gave for one question: a score per requested slot and, where the graph picks one, the
    greedy slot (d1's next token); d3's readout has no greedy pick outside its codes."""

    scores: Mapping[int, float]
    greedy: int | None = None


def label_softmax(scores: Sequence[float]) -> list[float]:
    """Softmax as vLLM computes it (spec 2.5): subtract the max, math.exp, divide by the left-to-right sum."""
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


class Family(ABC):
    """One model family: every prompt string it uses, its labels and its read."""

    name: str
    modalities: frozenset[str]
    most_options: int | None = None  # a bound on options every checkpoint of the family keeps (None: its config's)

    @classmethod
    def load(cls, root: Path) -> Family:
        """The family's contract for the checkpoint or artifact files under `root`."""
        return cls()

    @abstractmethod
    def option_limit(self, question_type: str) -> int:
        """The most options a question of this type may have (spec 2.3)."""

    @abstractmethod
    def check_request(self, request: DecisionRequest, questions: list[Question]) -> None:
        """The family's own checks that run before any media is fetched (spec 1.3 step 8)."""

    @abstractmethod
    def render_state(self, state: Any, max_chars: int | None = None) -> str:
        """The state as the prompt shows it. A family whose text can be much longer than the request's own bytes
        raises StateTooLong, with the length, rather than making a text of more than `max_chars` characters."""

    @abstractmethod
    def messages(self, request: DecisionRequest, question: Question, state_text: str) -> list[dict[str, Any]]:
        """The chat messages of one question."""

    def template_kwargs(self, request: DecisionRequest) -> dict[str, Any]:
        """The chat-template variables of a request's prompts: the generation prompt on, thinking off."""
        return {"add_generation_prompt": True, "enable_thinking": False}

    @abstractmethod
    def labels(self, question: Question, encode: Encode) -> Labels:
        """The output slots of each option of `question`; a `DecisionError` when the model cannot read them."""

    @abstractmethod
    def read(self, question: Question, labels: Labels, readout: Readout) -> Read:
        """The question's probabilities from its graph readout."""

    def output_tokens(self, questions: Sequence[Question]) -> int:
        """Tokens generated for these questions (spec 5.3)."""
        return 0
