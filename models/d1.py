"""Family d1 (LiquidAI/d1-3B, an LFM2.5-VL-3B): a fixed prompt read as the reply's first token (spec 3).

Every prompt string of the family is here: the state rendering, the user text per question type, the codes and
the label forms whose next-token log-probabilities make the read (spec 3.6, 3.7).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import DecisionError
from .family import Family, Read, label_softmax
from .questions import LABELS, Question
from .request import DecisionRequest

STATE_SEPARATOR = "\n\n\nQUESTION:\n"
OPTIONS_HEADER = "\n\nOptions:\n"
CHOICE_TAIL = "\n\nReply with the option code only."
NOUL_TAIL = "\n\nReply with yes or no only."
NOUL_YES_SIDE = "\nYes: "
NOUL_NO_SIDE = "\nNo: "
NOUL_FORMS = (("yes", "Yes", "YES"), ("no", "No", "NO"))
THINKING_REFUSED = "a read is the reply's first token, so thinking must be off"
OPTION_LIMITS = {qtype: min(26, len(labels)) for qtype, labels in LABELS.items()}  # spec 2.3


def score_tail(levels: int) -> str:
    return f"\n\nReply with a single digit 0-{levels - 1} only."


@dataclass(frozen=True)
class LabelGroups:
    """One question's label token ids per option (spec 3.6), in option order then form order."""

    groups: tuple[tuple[int, ...], ...]

    @property
    def ids(self) -> list[int]:
        return [i for group in self.groups for i in group]


class D1Family(Family):
    name = "d1"
    modalities = frozenset({"image"})

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
    def render_state(self, state: Any) -> str:
        if state is None:
            return ""
        if isinstance(state, str):
            return state
        return json.dumps(state, ensure_ascii=False, indent=2)

    @staticmethod
    def codes(question: Question) -> list[str]:
        """Choice codes (spec 3.6): the stripped names when all are one alphabetic character, else A, B, ..."""
        stripped = [o.name.strip() for o in question.options]
        if all(len(s) == 1 and s.isalpha() for s in stripped):
            return stripped
        return list(LABELS["choice"][: len(stripped)])

    def ask(self, question: Question) -> str:
        """The question's text after the state (spec 3.2)."""
        instructions = question.instructions
        if question.type == "choice":
            lines = [f"{code} {o.description if o.description else o.name.replace('_', ' ')}"
                     for code, o in zip(self.codes(question), question.options)]
            return instructions + OPTIONS_HEADER + "\n".join(lines) + CHOICE_TAIL
        if question.type == "noul":
            yes, no = (o.description for o in question.options)
            sides = f"{NOUL_YES_SIDE}{yes}{NOUL_NO_SIDE}{no}" if (yes or no) else ""
            return instructions + sides + NOUL_TAIL
        lines = [f"{i} {o.name}" for i, o in enumerate(question.options)]
        return instructions + "\n\n" + "\n".join(lines) + score_tail(len(question.options))

    def user_text(self, question: Question, state_text: str) -> str:
        ask = self.ask(question)
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
    def forms(self, question: Question) -> list[tuple[str, ...]]:
        """Each option's label forms, its label (the first form) first."""
        if question.type == "noul":
            return list(NOUL_FORMS)
        if question.type == "choice":
            return [(code, " " + code) for code in self.codes(question)]
        return [(str(i),) for i in range(len(question.options))]

    def label_groups(self, question: Question, encode: Callable[[str], list[int]]) -> LabelGroups:
        """Each option's distinct single-token forms, encoded standalone; 400 when an option's label is not one
        token of its own (spec 3.6)."""
        groups: list[tuple[int, ...]] = []
        seen: set[int] = set()
        for forms in self.forms(question):
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
        return LabelGroups(tuple(groups))

    # -- read (spec 3.7) -------------------------------------------------------------------------------------
    def read(self, question: Question, labels: LabelGroups, logprobs: Mapping[int, float], argmax_id: int) -> Read:
        """The read from the float32 full-vocabulary log-softmax at the label ids and the greedy token."""
        scores = [max(float(logprobs[i]) for i in group) for group in labels.groups]
        mass = sum(math.exp(float(logprobs[i])) for i in labels.ids)
        return Read(tuple(label_softmax(scores)), mass, int(argmax_id) in set(labels.ids))

    def output_tokens(self, questions: Sequence[Question]) -> int:
        return len(questions)  # one generated token per question (spec 5.3)
