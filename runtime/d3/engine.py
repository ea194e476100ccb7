"""Family d3 on onnxruntime: a request's prompts (media read once, spec 4.8) and one padded batch of code logits
(spec 4.13).

In causal mode the prefix every question of a request shares (its system turn, media and state: all before the
question) is read once and the questions as suffixes on its state, where that saves more than the call it adds;
the bidirectional mode reads every whole prompt (spec 4.3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...models.errors import DecisionError
from ...models.questions import Question
from ...models.request import DecisionRequest
from ..artifact import Artifact
from ..batch import BatchBudget, MediaRows, TextRow
from ..engine import Engine, EngineOptions, Prepared
from ..media_encoder import LoadedMedia
from ..prompt import RenderedPrompt, render_texts
from ..text_runner import TextRunner
from .code_logits import CodeLogits, text_positions
from .media import D3MediaEncoder, Preprocessed
from .placeholders import VISION_END, expand_media, mrope_positions
from .state import layout_of

if TYPE_CHECKING:
    from onnxruntime import RunOptions


@dataclass(frozen=True)
class D3Media:
    """A request's media, read, and the prompt positions their vision rows fill (the same in every prompt)."""

    loaded: LoadedMedia[Preprocessed]
    positions: np.ndarray


class D3Engine(Engine):
    encodes_media_apart = True

    def __init__(self, artifact: Artifact, options: EngineOptions):
        super().__init__(artifact, options)
        fields = artifact.manifest.model
        heads = int(fields.get("num_attention_heads", 1))
        # The portable graph materialises full-attention scores (O(L^2)): the longest prompt is bounded by the
        # attention budget too, so memory stays bounded and a long prompt gets a 400, never an out-of-memory crash.
        # The CUDA form's fused attention holds no scores; the same bound keeps every form's answers alike.
        longest = BatchBudget(attention_budget=options.attention_budget, heads=heads).longest_prompt()
        self.max_model_len = min(options.max_model_len or artifact.max_model_len, longest)
        self.budget = BatchBudget(max(options.max_batch_tokens, self.max_model_len), options.attention_budget, heads,
                                  options.slice_s)
        # The state a causal graph carries; None for a bidirectional artifact, or a causal one exported before
        # prefix reuse: whole prompts only.
        self.runner = TextRunner(self.session, self.budget, CodeLogits(int(fields["hidden_size"])), layout_of(fields))
        self.media = D3MediaEncoder(self.vision_session, fields["vision"], options.fetch_policy)

    def _check_tokens(self, question: Question, n: int) -> None:
        if n > self.max_model_len:
            raise DecisionError(f"question {question.id!r}: the prompt has {n} tokens, more than "
                                f"max_model_len={self.max_model_len}; nothing is truncated")

    def _check_characters(self, question: Question, length: int) -> None:
        """A prompt with more characters than max_model_len tokens can hold (each token is at most the longest
        vocabulary entry) is refused before it is tokenized: tokenizing megabytes costs seconds and gigabytes."""
        most = self.max_model_len * self.max_chars_per_token
        if length > most:
            raise DecisionError(f"question {question.id!r}: the prompt has {length} characters, more than the "
                                f"{most} that max_model_len={self.max_model_len} tokens can hold; nothing is "
                                "truncated")

    def prepare(self, request: DecisionRequest, questions: list[Question],
                media: LoadedMedia[Preprocessed] | None = None, draft: object | None = None) -> Prepared:
        texts = render_texts(self.artifact.template, self.family, request, questions, self._check_characters,
                             self.max_model_len * self.max_chars_per_token)
        tokenizer = self.artifact.tokenizer
        # The first prompt is tokenized and checked alone: every prompt holds the state, so one too long for the
        # model is refused before the others are tokenized (spec 4.12 names the first question that fails). Every
        # prompt's characters were checked as it was rendered.
        if media is None:
            first = tokenizer.encode(texts[0], lambda count: self._check_tokens(questions[0], count))
            # Each other prompt is checked as it is tokenized, before the prompts after it are.
            rest = tokenizer.encode_checked(texts[0], first, texts[1:],
                                            lambda index, count: self._check_tokens(questions[index + 1], count))
            prompts = [RenderedPrompt(q, t, ids, text_positions(len(ids)))
                       for q, t, ids in zip(questions, texts, [first, *rest])]
            prepared_media = None
        else:
            # Spec 4.8: the first prompt is split after its last <|vision_end|>; that media prefix, tokenized
            # and expanded once, starts every question's prompt.
            split = texts[0].rindex(VISION_END) + len(VISION_END)
            if any(not t.startswith(texts[0][:split]) for t in texts):
                raise DecisionError("the questions' prompts do not share their media")
            layouts = [self.media.layout(item) for item in media.in_order()]
            prefix = expand_media(tokenizer.encode(texts[0][:split]), layouts, tokenizer.encode, tokenizer.token_id)
            first = tokenizer.encode(texts[0][split:],
                                     lambda count: self._check_tokens(questions[0], len(prefix.ids) + count))
            tails = [first, *tokenizer.encode_checked(
                texts[0][split:], first, [t[split:] for t in texts[1:]],
                lambda index, count: self._check_tokens(questions[index + 1], len(prefix.ids) + count))]
            prompts = []
            for question, text, tail in zip(questions, texts, tails):
                ids = prefix.ids + tail
                prompts.append(RenderedPrompt(question, text, ids, mrope_positions(len(ids), prefix.segments)))
            prepared_media = D3Media(media, prefix.media_positions)
        for prompt in prompts:
            self._check_tokens(prompt.question, len(prompt.token_ids))
        labels = [self.family.labels(q, tokenizer.encode) for q in questions]
        return Prepared(request, questions, prompts, labels, prepared_media)

    def encode_media(self, prepared: Prepared, run_options: RunOptions | None = None) -> MediaRows | None:
        """The vision rows of the request's media at their prompt positions (the same in every question)."""
        media: D3Media | None = prepared.media
        if media is None:
            return None
        return MediaRows(self.media.encode(media.loaded, run_options), media.positions)

    def rows(self, prepared: Prepared, encoded: MediaRows | None) -> list[TextRow]:
        return [TextRow(p.token_ids, p.positions, encoded) for p in prepared.prompts]
