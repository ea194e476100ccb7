"""A question's prompt as the model reads it: the rendered chat text and its token ids (media expanded)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models.questions import Question


@dataclass(frozen=True)
class RenderedPrompt:
    question: Question
    text: str
    token_ids: list[int]
    positions: np.ndarray | None = None  # d3: [3, len(token_ids)] M-RoPE positions (spec 4.11)
