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

import numpy as np

from ..models.errors import DecisionError, ModelNotFound
from ..models.family import build_answer
from ..models.questions import Question, parse_questions
from ..models.request import DecisionRequest, parse_request
from .artifact import Artifact
from .chat_template import ChatTemplateError
from .d3_media import D3MediaEncoder
from .media_fetch import FetchPolicy
from .media_prompt import VISION_END, expand_media, mrope_positions
from .session import GraphSession
from .text_batch import CodeLogitsRunner, Media, attention_bytes, text_positions

RESPONSE_OBJECT = "structured_decision"
ID_PREFIX = "decision-"


@dataclass(frozen=True)
class RenderedPrompt:
    question: Question
    text: str
    token_ids: list[int]
    positions: np.ndarray  # [3, len(token_ids)] M-RoPE positions (spec 4.11)


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
        self.vision_session = GraphSession(artifact.graph_path("vision"), device, threads)
        self.media = D3MediaEncoder(self.vision_session, artifact.manifest["vision"], fetch_policy or FetchPolicy())
        self.media_limits = media_limits or MediaLimits()

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
        for field, kind, limit in (("images", "image", self.media_limits.images),
                                   ("videos", "video", self.media_limits.videos)):
            if len(getattr(request, field) or ()) > limit:
                raise DecisionError(f"At most {limit} {kind}(s) may be provided in one prompt. (parameter={kind})",
                                    param=kind)
        self.family.check_request(request, questions)
        return request, questions

    # -- prompts (spec 4.4-4.7, 4.12) ------------------------------------------------------------------------
    def render(self, body: Any) -> list[RenderedPrompt]:
        request, questions = self.validate(body)
        return self._prompts(request, questions)[0]

    def _prompts(self, request: DecisionRequest, questions: list[Question], run_options: Any = None
                 ) -> tuple[list[RenderedPrompt], Media | None]:
        """Every question's prompt (media read once, spec 4.8) and the media rows the text graph takes."""
        media = self.media.encode(request, run_options) if request.modalities() else None
        state_text = self.family.render_state(request.state)
        texts = []
        for question in questions:
            messages = self.family.messages(request, question, state_text)
            try:
                texts.append(self.artifact.template.render(messages, add_generation_prompt=True,
                                                           enable_thinking=False))
            except ChatTemplateError as exc:
                raise DecisionError(str(exc)) from exc
        tokenizer = self.artifact.tokenizer
        if media is None:
            prompts = [RenderedPrompt(q, t, ids, text_positions(len(ids)))
                       for q, t, ids in zip(questions, texts, tokenizer.encode_batch(texts))]
            graph_media = None
        else:
            # Spec 4.8: the first prompt is split after its last <|vision_end|>; that media prefix, tokenized
            # and expanded once, starts every question's prompt.
            split = texts[0].rindex(VISION_END) + len(VISION_END)
            if any(not t.startswith(texts[0][:split]) for t in texts):
                raise DecisionError("the questions' prompts do not share their media")
            prefix = expand_media(tokenizer.encode(texts[0][:split]), media.layouts, tokenizer.encode,
                                  tokenizer.token_id)
            prompts = []
            for question, text, tail in zip(questions, texts, tokenizer.encode_batch([t[split:] for t in texts])):
                ids = prefix.ids + tail
                prompts.append(RenderedPrompt(question, text, ids, mrope_positions(len(ids), prefix.segments)))
            graph_media = Media(media.embeds, prefix.media_positions)
        for prompt in prompts:
            n = len(prompt.token_ids)
            if n > self.max_model_len:
                raise DecisionError(f"question {prompt.question.id!r}: the prompt has {n} tokens, more than "
                                    f"max_model_len={self.max_model_len}; nothing is truncated")
        return prompts, graph_media

    # -- the whole request (spec 5) --------------------------------------------------------------------------
    def decide(self, body: Any, header_request_id: str | None = None, run_options: Any = None) -> dict[str, Any]:
        """Answer one body; `run_options` (onnxruntime RunOptions) lets the caller stop the run in flight."""
        request, questions = self.validate(body)
        return self.answer(request, questions, header_request_id, run_options)

    def answer(self, request: DecisionRequest, questions: list[Question], header_request_id: str | None = None,
               run_options: Any = None) -> dict[str, Any]:
        """Answer a request that `validate` accepted: media once, prompts, one batch, answers."""
        prompts, graph_media = self._prompts(request, questions, run_options)
        logits = self.runner.run([p.token_ids for p in prompts], run_options, [p.positions for p in prompts],
                                 graph_media)
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
