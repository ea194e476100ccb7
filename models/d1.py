"""Family d1 (LiquidAI/d1-3B, an LFM2.5-VL-3B): a fixed prompt read as the reply's first token (spec 3).

Every prompt string of the family is here: the state rendering, the user text per question type, the codes and
the label forms whose next-token log-probabilities make the read (spec 3.6, 3.7).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from typing import Any

from .errors import DecisionError
from .family import Encode, Family, Labels, Readout, StateTooLong, label_softmax
from .questions import QUESTION_TYPES, Question, Read
from .request import DecisionRequest

STATE_SEPARATOR = "\n\n\nQUESTION:\n"
OPTIONS_HEADER = "\n\nOptions:\n"
CHOICE_TAIL = "\n\nReply with the option code only."
NOUL_TAIL = "\n\nReply with yes or no only."
NOUL_YES_SIDE = "\nYes: "
NOUL_NO_SIDE = "\nNo: "
NOUL_FORMS = (("yes", "Yes", "YES"), ("no", "No", "NO"))
THINKING_REFUSED = "a read is the reply's first token, so thinking must be off"
OPTION_LIMITS = {name: min(26, len(kind.labels)) for name, kind in QUESTION_TYPES.items()}  # spec 2.3


def score_tail(levels: int) -> str:
    return f"\n\nReply with a single digit 0-{levels - 1} only."


def codes(question: Question) -> list[str]:
    """Choice codes (spec 3.6): the stripped names when all are one alphabetic character, else A, B, ..."""
    stripped = [o.name.strip() for o in question.options]
    if all(len(s) == 1 and s.isalpha() for s in stripped):
        return stripped
    return list(QUESTION_TYPES["choice"].labels[: len(stripped)])


class AskedAs:
    """How d1 asks one question type: the text after the state (spec 3.2) and each option's label forms, its
    label first (spec 3.6)."""

    def text(self, question: Question) -> str:
        raise NotImplementedError

    def forms(self, question: Question) -> list[tuple[str, ...]]:
        raise NotImplementedError


class ChoiceAsked(AskedAs):
    def text(self, question: Question) -> str:
        lines = [f"{code} {o.description if o.description else o.name.replace('_', ' ')}"
                 for code, o in zip(codes(question), question.options)]
        return question.instructions + OPTIONS_HEADER + "\n".join(lines) + CHOICE_TAIL

    def forms(self, question: Question) -> list[tuple[str, ...]]:
        return [(code, " " + code) for code in codes(question)]


class NoulAsked(AskedAs):
    def text(self, question: Question) -> str:
        yes, no = (o.description for o in question.options)
        sides = f"{NOUL_YES_SIDE}{yes}{NOUL_NO_SIDE}{no}" if (yes or no) else ""
        return question.instructions + sides + NOUL_TAIL

    def forms(self, question: Question) -> list[tuple[str, ...]]:
        return list(NOUL_FORMS)


class ScoreAsked(AskedAs):
    def text(self, question: Question) -> str:
        lines = [f"{i} {o.name}" for i, o in enumerate(question.options)]
        return question.instructions + "\n\n" + "\n".join(lines) + score_tail(len(question.options))

    def forms(self, question: Question) -> list[tuple[str, ...]]:
        return [(str(i),) for i in range(len(question.options))]


ASKED = {"choice": ChoiceAsked(), "noul": NoulAsked(), "score": ScoreAsked()}


def indented_json_length(value: Any) -> int:
    """len(json.dumps(value, ensure_ascii=False, indent=2)), without making the text. Two spaces a nesting level
    make it up to about two characters a level for each value: 200,000 one-item lists 250 levels down, an 800 KB
    body, render as 302 million characters. It is the compact text's length plus, for each non-empty container,
    a line break and its depth's indent before each item and before its closing bracket."""
    length = len(json.dumps(value, ensure_ascii=False, separators=(",", ": ")))
    containers = (dict, list, tuple)
    if not isinstance(value, containers) or not value:
        return length
    length += _indents(len(value), 0)
    open_items = [iter(value.values() if isinstance(value, dict) else value)]
    while open_items:  # depth first, one iterator an open container: memory for the depth alone
        for item in open_items[-1]:
            if isinstance(item, containers) and item:
                length += _indents(len(item), len(open_items))
                open_items.append(iter(item.values() if isinstance(item, dict) else item))
                break
        else:
            open_items.pop()
    return length


def _indents(items: int, depth: int) -> int:
    """The characters indent=2 adds to a container of `items` at `depth`: a line break and 2 x (depth + 1) spaces
    before each item, a line break and 2 x depth spaces before the closing bracket."""
    return items * (1 + 2 * (depth + 1)) + 1 + 2 * depth


class D1Family(Family):
    name = "d1"
    modalities = frozenset({"image"})
    most_options = max(OPTION_LIMITS.values())

    def option_limit(self, question_type: str) -> int:
        return OPTION_LIMITS[question_type]

    # -- checks (spec 3.3, 6.3) ------------------------------------------------------------------------------
    def check_request(self, request: DecisionRequest, questions: list[Question]) -> None:
        kwargs = request.chat_template_kwargs or {}
        if kwargs.get("enable_thinking"):
            raise DecisionError(THINKING_REFUSED)
        if "chat_template" in kwargs:
            # Spec 8 Q16: vLLM would render with a template the request brings; we keep the checkpoint's own.
            raise DecisionError("chat_template_kwargs.chat_template: this server renders with the model's own "
                                "chat template; a request cannot replace it", param="chat_template_kwargs")

    def template_kwargs(self, request: DecisionRequest) -> dict[str, Any]:
        """The chat-template variables a request may set (spec 3.3): its kwargs without null/"auto" values, with
        thinking off, the generation prompt on and no continued final message forced."""
        kwargs = {k: v for k, v in (request.chat_template_kwargs or {}).items()
                  if v is not None and v != "auto" and k not in ("tokenize", "chat_template", "messages")}
        kwargs.update(enable_thinking=False, add_generation_prompt=True, continue_final_message=False)
        return kwargs

    # -- prompt (spec 3.1-3.3) -------------------------------------------------------------------------------
    def render_state(self, state: Any, max_chars: int | None = None) -> str:
        if state is None:
            return ""
        if isinstance(state, str):
            return state
        if max_chars is not None:
            length = indented_json_length(state)
            if length > max_chars:
                raise StateTooLong(length)
        # json.dumps with an indent runs the pure-Python encoder and joins a list of every chunk (an object per
        # value: 200 MB for a state of 3 million numbers); writing the chunks as they come keeps only the text.
        text = io.StringIO()
        for chunk in json.JSONEncoder(ensure_ascii=False, indent=2).iterencode(state):
            text.write(chunk)
        return text.getvalue()

    def user_text(self, question: Question, state_text: str) -> str:
        ask = ASKED[question.type].text(question)
        return state_text + STATE_SEPARATOR + ask if state_text else ask

    def messages(self, request: DecisionRequest, question: Question, state_text: str) -> list[dict[str, Any]]:
        text = self.user_text(question, state_text)
        images = request.images or []
        content: str | list[dict[str, Any]] = (
            [*({"type": "image"} for _ in images), {"type": "text", "text": text}] if images else text)
        system = ([{"role": "system", "content": request.instructions}]
                  if isinstance(request.instructions, str) and request.instructions else [])
        return [*system, {"role": "user", "content": content}]

    # -- labels (spec 3.6) -----------------------------------------------------------------------------------
    def labels(self, question: Question, encode: Encode) -> Labels:
        """Each option's distinct single-token forms, encoded standalone; 400 when an option's label is not one
        token of its own (spec 3.6)."""
        groups: list[tuple[int, ...]] = []
        seen: set[int] = set()
        for forms in ASKED[question.type].forms(question):
            group: list[int] = []
            for form in forms:
                ids = encode(form)
                if len(ids) == 1 and ids[0] not in group:
                    group.append(ids[0])
            label_ids = encode(forms[0])
            if (not group or len(label_ids) != 1 or label_ids[0] != group[0]
                    or any(i in seen for i in group)):
                raise DecisionError(f"question {question.id!r}: label {forms[0]!r} is not one distinct token for "
                                    "this model")
            seen.update(group)
            groups.append(tuple(group))
        return Labels(tuple(groups))

    # -- read (spec 3.7) -------------------------------------------------------------------------------------
    def read(self, question: Question, labels: Labels, readout: Readout) -> Read:
        """The read from the float32 full-vocabulary log-softmax at the label ids and the greedy token."""
        logprobs = readout.scores
        scores = [max(float(logprobs[i]) for i in group) for group in labels.groups]
        mass = sum(math.exp(float(logprobs[i])) for i in labels.ids)
        return Read(tuple(label_softmax(scores)), mass, readout.greedy in set(labels.ids))

    def output_tokens(self, questions: Sequence[Question]) -> int:
        return len(questions)  # one generated token per question (spec 5.3)
