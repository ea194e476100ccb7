"""One request end to end: body -> checks (spec 1.3) -> family engine (prompts, graph runs, reads) -> answers (5).

Data flows one way: the request is parsed and validated, the family's engine renders each question's prompt with
the artifact's template and tokenizer, runs the graphs and returns one read per question, and each read becomes
its answer.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from ..models.errors import DecisionError, ModelNotFound
from ..models.family import build_answer
from ..models.questions import Question, parse_questions
from ..models.request import DecisionRequest, parse_request
from .artifact import Artifact
from .media_fetch import FetchPolicy
from .prompt import RenderedPrompt

RESPONSE_OBJECT = "structured_decision"
ID_PREFIX = "decision-"


@dataclass(frozen=True)
class MediaLimits:
    """Most images and videos one request may carry (vLLM's --limit-mm-per-prompt)."""

    images: int = 16
    videos: int = 4


def new_request_id() -> str:
    return f"{secrets.randbits(64):016x}"


class DecisionService:
    """Answers `/v1/systemone` bodies for one artifact on one device."""

    def __init__(self, artifact: Artifact, device: str = "auto", served_model_names: list[str] | None = None,
                 max_model_len: int | None = None, max_batch_tokens: int = 32768, threads: int | None = None,
                 attention_budget: int = 4 << 30, fetch_policy: FetchPolicy | None = None,
                 media_limits: MediaLimits | None = None):
        from .d1_engine import D1Engine
        from .d3_engine import D3Engine

        self.artifact = artifact
        self.family = artifact.family
        self.served_model_names = served_model_names or [artifact.source]
        if max_model_len and max_model_len > artifact.max_model_len:
            raise ValueError(f"max_model_len={max_model_len} is more than the model's "
                             f"{artifact.max_model_len} positions")
        engine = {"d1": D1Engine, "d3": D3Engine}[self.family.name]
        self.engine = engine(artifact, device, max_model_len, max_batch_tokens, threads, attention_budget,
                             fetch_policy or FetchPolicy())
        self.media_limits = media_limits or MediaLimits()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def provider(self) -> str:
        return self.engine.session.provider

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    # -- validation (spec 1.3 steps 1-8) ---------------------------------------------------------------------
    def validate(self, body: Any) -> tuple[DecisionRequest, list[Question]]:
        if self.engine.unsupported:
            # Spec 1.1: a model whose read cannot work answers 501 on every call.
            raise DecisionError("The model does not support the structured decision API", status=501,
                                type="NotImplementedError")
        request = parse_request(body)
        if request.model and request.model not in self.served_model_names:
            raise ModelNotFound(request.model, self.served_model_names)
        questions = parse_questions(request.questions, self.family.option_limit)
        unsupported = sorted(request.modalities() - self.family.modalities)
        if unsupported:
            raise DecisionError(f"this model does not take {', '.join(unsupported)} inputs")
        if request.joint:
            raise DecisionError("joint: this model reads each question on its own; joint reads need DiffusionGemma")
        for field, kind, limit in (("images", "image", self.media_limits.images),
                                   ("videos", "video", self.media_limits.videos)):
            if len(getattr(request, field) or ()) > limit:
                raise DecisionError(f"At most {limit} {kind}(s) may be provided in one prompt. (parameter={kind})",
                                    param=kind)
        self.family.check_request(request, questions)
        return request, questions

    # -- prompts ----------------------------------------------------------------------------------------------
    def render(self, body: Any) -> list[RenderedPrompt]:
        """Every question's prompt as the model would read it (media fetched and expanded)."""
        request, questions = self.validate(body)
        return self.engine.prompts(request, questions)

    # -- the whole request (spec 5) --------------------------------------------------------------------------
    def decide(self, body: Any, header_request_id: str | None = None, run_options: Any = None) -> dict[str, Any]:
        """Answer one body; `run_options` (onnxruntime RunOptions) lets the caller stop the run in flight."""
        request, questions = self.validate(body)
        return self.answer(request, questions, header_request_id, run_options)

    def answer(self, request: DecisionRequest, questions: list[Question], header_request_id: str | None = None,
               run_options: Any = None) -> dict[str, Any]:
        """Answer a request that `validate` accepted: the family engine's reads, then the answers."""
        reads, prompts = self.engine.reads(request, questions, run_options)
        answers, diagnostics = {}, {}
        for question, read in zip(questions, reads):
            answers[question.id] = build_answer(question, read)
            diagnostics[question.id] = {"label_mass": read.label_mass, "argmax_is_label": read.argmax_is_label}
        request_id = header_request_id or request.request_id or new_request_id()
        return {
            "id": ID_PREFIX + request_id,
            "object": RESPONSE_OBJECT,
            "created": int(time.time()),
            "model": self.model_name,
            "answers": answers,
            "usage": {"input_tokens": sum(len(p.token_ids) for p in prompts),
                      "output_tokens": self.family.output_tokens(questions)},
            "diagnostics": diagnostics,
            "joint": None,
        }
