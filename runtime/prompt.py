"""A question's prompt as the model reads it: the rendered chat text and its token ids (media expanded)."""

from __future__ import annotations

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


def render_texts(template: ChatTemplate, family: Family, request: DecisionRequest, questions: list[Question]
                 ) -> list[str]:
    """Each question's chat text: the family's messages rendered with its template variables; a template that
    refuses the conversation is the client's 400 with the template's own message (spec 3.3)."""
    state_text = family.render_state(request.state)
    kwargs = family.template_kwargs(request)
    texts = []
    for question in questions:
        try:
            texts.append(template.render(family.messages(request, question, state_text), **kwargs))
        except ChatTemplateError as exc:
            raise DecisionError(str(exc)) from exc
    return texts
