"""One request end to end: body -> checks (spec 1.3) -> family prompts -> one graph batch -> answers (spec 5).

Data flows one way: the request is parsed and validated, each question becomes its family's chat messages,
rendered with the artifact's template and tokenized, the prompts run as one padded batch, and each question's
read becomes its answer.
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
from .chat_template import ChatTemplateError
from .session import GraphSession
from .text_batch import CodeLogitsRunner, attention_bytes

RESPONSE_OBJECT = "structured_decision"
ID_PREFIX = "decision-"


@dataclass(frozen=True)
class RenderedPrompt:
    question: Question
    text: str
    token_ids: list[int]


def new_request_id() -> str:
    return f"{secrets.randbits(64):016x}"


class DecisionService:
    """Answers `/v1/systemone` bodies for one artifact on one device."""

    def __init__(self, artifact: Artifact, device: str = "auto", served_model_names: list[str] | None = None,
                 max_model_len: int | None = None, max_batch_tokens: int = 32768, threads: int | None = None,
                 attention_budget: int = 4 << 30):
        self.artifact = artifact
        self.family = artifact.family
        self.served_model_names = served_model_names or [artifact.source]
        heads = int(artifact.manifest.get("num_attention_heads", 1))
        # The graph materialises full-attention scores (O(L^2)): the longest prompt one request may hold is
        # bounded by the attention budget, so memory stays bounded and a long prompt gets a 400, never an OOM.
        memory_len = int((attention_budget / attention_bytes(1, 1, heads)) ** 0.5)
        self.max_model_len = min(max_model_len or artifact.max_model_len, memory_len)
        if max_model_len and max_model_len > artifact.max_model_len:
            raise ValueError(f"max_model_len={max_model_len} is more than the model's "
                             f"{artifact.max_model_len} positions")
        self.session = GraphSession(artifact.graph_path("text"), device, threads)
        self.runner = CodeLogitsRunner(self.session, max(max_batch_tokens, self.max_model_len), heads,
                                       attention_budget, int(artifact.manifest["hidden_size"]))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    # -- validation (spec 1.3 steps 1-8) ---------------------------------------------------------------------
    def validate(self, body: Any) -> tuple[DecisionRequest, list[Question]]:
        request = parse_request(body)
        if request.model and request.model not in self.served_model_names:
            raise ModelNotFound(request.model, self.served_model_names)
        questions = parse_questions(request.questions, self.family.option_limit)
        unsupported = sorted(request.modalities() - self.family.modalities)
        if unsupported:
            raise DecisionError(f"this model does not take {', '.join(unsupported)} inputs")
        if request.joint:
            raise DecisionError("joint: this model reads each question on its own; joint reads need DiffusionGemma")
        self.family.check_request(request, questions)
        if request.modalities():
            counts = ", ".join(f"{name}: {len(getattr(request, name))}" for name in ("images", "videos")
                               if getattr(request, name))
            raise DecisionError(f"media: this build does not read images or videos yet ({counts}); "
                                "send text or JSON states only")
        return request, questions

    # -- prompts (spec 4.4-4.7, 4.12) ------------------------------------------------------------------------
    def render(self, body: Any) -> list[RenderedPrompt]:
        request, questions = self.validate(body)
        return self._prompts(request, questions)

    def _prompts(self, request: DecisionRequest, questions: list[Question]) -> list[RenderedPrompt]:
        state_text = self.family.render_state(request.state)
        texts = []
        for question in questions:
            messages = self.family.messages(request, question, state_text)
            try:
                texts.append(self.artifact.template.render(messages, add_generation_prompt=True,
                                                           enable_thinking=False))
            except ChatTemplateError as exc:
                raise DecisionError(str(exc)) from exc
        prompts = [RenderedPrompt(q, t, ids)
                   for q, t, ids in zip(questions, texts, self.artifact.tokenizer.encode_batch(texts))]
        for prompt in prompts:
            n = len(prompt.token_ids)
            if n > self.max_model_len:
                raise DecisionError(f"question {prompt.question.id!r}: the prompt has {n} tokens, more than "
                                    f"max_model_len={self.max_model_len}; nothing is truncated")
        return prompts

    # -- the whole request (spec 5) --------------------------------------------------------------------------
    def decide(self, body: Any, header_request_id: str | None = None, run_options: Any = None) -> dict[str, Any]:
        """Answer one body; `run_options` (onnxruntime RunOptions) lets the caller stop the run in flight."""
        request, questions = self.validate(body)
        return self.answer(request, questions, header_request_id, run_options)

    def answer(self, request: DecisionRequest, questions: list[Question], header_request_id: str | None = None,
               run_options: Any = None) -> dict[str, Any]:
        """Answer a request that `validate` accepted: prompts, one batch, answers."""
        prompts = self._prompts(request, questions)
        logits = self.runner.run([p.token_ids for p in prompts], run_options)
        answers, diagnostics = {}, {}
        for question, row in zip(questions, logits):
            read = self.family.read(question, row.tolist())
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
