"""Family d3 on onnxruntime: a request's prompts (media read once, spec 4.8) and one padded batch of code logits.

The service hands it a validated request; it returns each question's prompt and read (spec 4.13).
"""

from __future__ import annotations

from typing import Any

from ..models.errors import DecisionError
from ..models.family import Read
from ..models.questions import Question
from ..models.request import DecisionRequest
from .artifact import Artifact
from .d3_media import D3MediaEncoder
from .media_fetch import FetchPolicy
from .media_prompt import VISION_END, expand_media, mrope_positions
from .prompt import RenderedPrompt, render_texts
from .session import GraphSession
from .text_batch import CodeLogitsRunner, Media, attention_bytes, text_positions


class D3Engine:
    unsupported: str | None = None  # d3 always serves the endpoint (spec 1.1: the classify task is there)

    def __init__(self, artifact: Artifact, device: str, max_model_len: int | None, max_batch_tokens: int,
                 threads: int | None, attention_budget: int, fetch_policy: FetchPolicy):
        self.artifact = artifact
        self.family = artifact.family
        heads = int(artifact.manifest.get("num_attention_heads", 1))
        # The graph materialises full-attention scores (O(L^2)): the longest prompt one request may hold is
        # bounded by the attention budget, so memory stays bounded and a long prompt gets a 400, never an OOM.
        memory_len = int((attention_budget / attention_bytes(1, 1, heads)) ** 0.5)
        self.max_model_len = min(max_model_len or artifact.max_model_len, memory_len)
        self.session = GraphSession(artifact.graph_path("text"), device, threads)
        self.runner = CodeLogitsRunner(self.session, max(max_batch_tokens, self.max_model_len), heads,
                                       attention_budget, int(artifact.manifest["hidden_size"]))
        self.vision_session = GraphSession(artifact.graph_path("vision"), device, threads)
        self.media = D3MediaEncoder(self.vision_session, artifact.manifest["vision"], fetch_policy)

    def prompts(self, request: DecisionRequest, questions: list[Question], run_options: Any = None
                ) -> list[RenderedPrompt]:
        return self._prompts(request, questions, run_options)[0]

    def _prompts(self, request: DecisionRequest, questions: list[Question], run_options: Any = None
                 ) -> tuple[list[RenderedPrompt], Media | None]:
        """Every question's prompt (media read once, spec 4.8) and the media rows the text graph takes."""
        media = self.media.encode(request, run_options) if request.modalities() else None
        texts = render_texts(self.artifact.template, self.family, request, questions)
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

    def reads(self, request: DecisionRequest, questions: list[Question], run_options: Any = None
              ) -> tuple[list[Read], list[RenderedPrompt]]:
        """Each question's read (spec 4.13) and prompt: media once, prompts, one batch of code logits."""
        prompts, graph_media = self._prompts(request, questions, run_options)
        logits = self.runner.run([p.token_ids for p in prompts], run_options, [p.positions for p in prompts],
                                 graph_media)
        return [self.family.read(q, row.tolist()) for q, row in zip(questions, logits)], prompts
