"""A question's prompt as the model reads it: the rendered chat text and its token ids (media expanded)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..models.errors import DecisionError
from ..models.family import Family
from ..models.questions import Question
from ..models.request import DecisionRequest
from .chat_template import ChatTemplate, ChatTemplateError


@dataclass(frozen=True)
class RenderedPrompt:
    question: Question
    text: str
    token_ids: list[int]
    positions: np.ndarray | None = None  # d3: [3, len(token_ids)] M-RoPE positions (spec 4.11)


def render_texts(template: ChatTemplate, family: Family, request: DecisionRequest, questions: list[Question],
                 check_first: Callable[[Question, str], None] | None = None) -> list[str]:
    """Each question's chat text: the family's messages rendered with its template variables; a template that
    refuses the conversation is the client's 400 with the template's own message (spec 3.3).

    `check_first` sees the first question's text before any other is rendered: every prompt holds the state, so
    a state too long for the model is refused after one copy of it, not one per question."""
    state_text = family.render_state(request.state)
    kwargs = family.template_kwargs(request)
    texts = []
    for question in questions:
        try:
            texts.append(template.render(family.messages(request, question, state_text), **kwargs))
        except ChatTemplateError as exc:
            raise DecisionError(str(exc)) from exc
        if check_first is not None and len(texts) == 1:
            check_first(question, texts[0])
    return texts
