"""A question's prompt as the model reads it: the rendered chat text and its token ids (media expanded)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..models.errors import DecisionError
from ..models.family import Family, StateTooLong
from ..models.questions import Question
from ..models.request import DecisionRequest
from .chat_template import ChatTemplate, ChatTemplateError


@dataclass(frozen=True)
class RenderedPrompt:
    question: Question
    text: str
    token_ids: list[int]
    positions: np.ndarray | None = None  # d3: [3, len(token_ids)] M-RoPE positions (spec 4.11)


STATE_MARK = "\x00state\x00"  # holds the state's place when a prompt's length is measured without its text


def render_texts(template: ChatTemplate, family: Family, request: DecisionRequest, questions: list[Question],
                 check_characters: Callable[[Question, int], None] | None = None, max_chars: int | None = None,
                 check_first: Callable[[Question, str], None] | None = None) -> list[str]:
    """Each question's chat text: the family's messages rendered with its template variables; a template that
    refuses the conversation is the client's 400 with the template's own message (spec 3.3).

    Every prompt's length is checked as it is rendered (`check_characters`, which refuses more than `max_chars`),
    so a prompt too long is refused before any after it is rendered, and before the caller tokenizes any but the
    first. The first is also checked on its text (`check_first`, which tokenizes it) before any other is rendered:
    every prompt holds the state, so a state too long for the model is refused after one copy of it, not one per
    question. A state whose text the family would not make within `max_chars` is refused on its length alone."""
    kwargs = family.template_kwargs(request)

    def render(question: Question, state_text: str) -> str:
        try:
            return template.render(family.messages(request, question, state_text), **kwargs)
        except ChatTemplateError as exc:
            raise DecisionError(str(exc)) from exc

    try:
        state_text = family.render_state(request.state, max_chars)
    except StateTooLong as exc:
        marked = render(questions[0], STATE_MARK)
        if check_characters is not None and marked.count(STATE_MARK) == 1:  # the template shows the state verbatim
            check_characters(questions[0], len(marked) - len(STATE_MARK) + exc.length)
        state_text = family.render_state(request.state)  # not refused after all: made, and checked as any other
    texts = []
    for question in questions:
        texts.append(render(question, state_text))
        if check_characters is not None:
            check_characters(question, len(texts[-1]))
        if len(texts) == 1 and check_first is not None:
            check_first(question, texts[0])
    return texts
