"""Family d1 on onnxruntime: the Liquid prompts of a request and their label reads (spec 3), run by the shared text
runner (runtime/text_runner.py): the prefix a request's questions share read once where that saves more than the
call it adds (`Engine.prefix_split`), each question's whole prompt a row otherwise.

Order of the checks, as vLLM runs them (spec 1.3 step 8): images fetched and read, then every question's prompt
rendered, tokenized and checked for length (3.9) and its generation tail (3.5), then every question's label groups
(3.6), then the reads (3.7). Each question's prompt is tokenized whole, exactly as vLLM tokenizes it; the prefix
that all of them share (state, images, system turn) is found on the token ids, so reuse never changes a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ...models.errors import DecisionError
from ...models.questions import QUESTION_TYPES, Question
from ...models.request import DecisionRequest
from ..artifact import Artifact
from ..batch import BatchBudget, MediaRows, TextRow
from ..engine import Engine, EngineOptions, Prepared
from ..media_encoder import LoadedMedia
from ..prompt import RenderedPrompt, render_texts
from ..text_runner import TextRunner
from .image_processor import Lfm2Image, Lfm2ImageConfig, placeholder_text
from .images import D1ImageEncoder, expand_images, media_rows
from .label_reads import LabelLogprobs
from .state import layout_of

if TYPE_CHECKING:
    from onnxruntime import RunOptions

# Option labels whose token ids are remembered: the same few (yes/no, digits, letters, common names) recur in almost
# every request, and each is tried in several forms (16 questions: about 400 encodings, 4 ms on two cores).
LABEL_CACHE = 4096
LABEL_CACHE_CHARS = 64  # longer labels are rare and encoded each time, so the cache stays small
PLACEHOLDER_CACHE = 64  # tile grids

TAIL_MISMATCH = "these chat options end the prompt differently, so the labels' tokens are unknown"


@dataclass(frozen=True)
class Tokenized:
    """A request's prompts rendered and tokenized, their `<image>` tokens not yet expanded (`D1Engine.draft`)."""

    texts: list[str]
    ids: list[list[int]]


class D1Engine(Engine):
    encodes_media_apart = True

    def __init__(self, artifact: Artifact, options: EngineOptions):
        super().__init__(artifact, options)
        fields = artifact.manifest.model
        self.tokenizer = artifact.tokenizer
        # The graph reads a prefix chunk by chunk and its KV cache grows linearly: the context is the model's.
        self.max_model_len = options.max_model_len or artifact.max_model_len
        self.budget = BatchBudget(options.max_batch_tokens, options.attention_budget,
                                  int(fields["num_attention_heads"]), options.slice_s)
        self.runner = TextRunner(self.session, self.budget, LabelLogprobs(int(fields["hidden_size"])),
                                 layout_of(fields))
        vision = fields["vision"]
        self.media = D1ImageEncoder(self.vision_session, Lfm2ImageConfig.from_processor_config(vision),
                                    np.load(artifact.root / vision["positions_file"]), options.fetch_policy)
        self.image_token_id = int(fields["image_token_id"])
        self.tail = self._generation_tail()
        self._cached_label_ids = lru_cache(maxsize=LABEL_CACHE)(lambda text: tuple(self.tokenizer.encode(text)))
        # An image's placeholder depends only on its tile grid: images of one size, as a camera or the bench sends
        # them, are tokenized once (1,280 <image> tokens and their markers took 1.3 ms on two cores).
        self._placeholder_ids = lru_cache(maxsize=PLACEHOLDER_CACHE)(lambda text: tuple(self.tokenizer.encode(text)))
        self.unsupported = self._generic_labels_problem()

    # -- startup checks (spec 3.5) ---------------------------------------------------------------------------
    def _generation_tail(self) -> list[int]:
        """The ids after the last added-vocabulary token of a probe conversation (LFM2: "assistant\\n")."""
        probe = self.artifact.template.render([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                              enable_thinking=False)
        ids = self.tokenizer.encode(probe)
        added = self.tokenizer.added_ids()
        last = max((i for i, token in enumerate(ids) if token in added), default=-1)
        return ids[last + 1:]

    def _generic_labels_problem(self) -> str | None:
        """vLLM disables the endpoint (501) unless every generic label is one distinct token after the tail."""
        text = self.tokenizer.decode(self.tail)
        for labels in (kind.labels for kind in QUESTION_TYPES.values()):
            seen: set[int] = set()
            for label in labels:
                ids = self.tokenizer.encode(text + label)
                if ids[:-1] != self.tail or len(ids) != len(self.tail) + 1 or ids[-1] in seen:
                    return f"label {label!r} is not one distinct token after the generation prompt"
                seen.add(ids[-1])
        return None

    # -- prompts (spec 3.3, 3.4, 3.8, 3.9, 3.5) --------------------------------------------------------------

    def _check_characters(self, length: int) -> None:
        m = self.max_model_len
        if length > m * self.max_chars_per_token:
            raise DecisionError(
                f"This model's maximum context length is {m} tokens. However, your prompt contains {length} "
                f"characters (more than {m * self.max_chars_per_token} characters, which is the upper bound for {m} "
                f"input tokens). Please reduce the length of the input prompt. (parameter=input_text, "
                f"value={length})", param="input_text")

    def _check_tokens(self, count: int) -> None:
        m = self.max_model_len
        if count > m:
            n = min(count, m + 1)  # vLLM's tokenizer stops at max_model_len + 1
            at_least = "at least " if n == m + 1 else ""
            raise DecisionError(
                f"This model's maximum context length is {m} tokens. However, your prompt contains {at_least}{n} "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                f"of the input prompt. (parameter=input_tokens, value={n})", param="input_tokens")

    def _check_length(self, question: Question, text: str, ids: list[int], expanded: int) -> None:
        """Spec 3.9: characters, then text tokens, then the prompt with its images expanded."""
        self._check_characters(len(text))
        self._check_tokens(len(ids))
        m = self.max_model_len
        if expanded > m:
            raise DecisionError(
                f"The decoder prompt (length {expanded}) is longer than the maximum model length of {m}. Make sure "
                "that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens. For "
                "image inputs, the number of image tokens depends on the number of images, and possibly their "
                "aspect ratios as well.")
        if expanded == m:
            raise DecisionError(
                f"The decoder prompt (length {expanded}) plus the number of requested output tokens (at least 1) is "
                f"longer than the maximum model length of {m}. Make sure that `max_model_len` is no smaller than "
                "the number of text tokens (prompt + requested output tokens).")

    def draft(self, request: DecisionRequest, questions: list[Question]) -> Tokenized:
        """Every prompt rendered and tokenized with its `<image>` tokens unexpanded: all of `prepare` that needs no
        image, run while the images load (the bench's 16-question image request: 10 ms of the 40 that loading its image
        and preparing its prompts took one after the other on two cores)."""
        first: list[int] = []

        def check_first(question: Question, text: str) -> None:
            # Spec 3.9's second rule on the first prompt alone (render_texts checked its characters), before any
            # other is rendered or tokenized: a state too long for the model costs one copy and one tokenization.
            first.extend(self.tokenizer.encode(text, self._check_tokens))

        texts = render_texts(self.artifact.template, self.family, request, questions,
                             lambda question, length: self._check_characters(length),
                             self.max_model_len * self.max_chars_per_token, check_first)
        # Every other prompt's characters were checked as it was rendered; its tokens are checked as it is
        # tokenized, before the prompts after it are (a short first question and long others cost one of them).
        rest = self.tokenizer.encode_checked(texts[0], first, texts[1:],
                                             lambda index, count: self._check_tokens(count))
        return Tokenized(texts, [first, *rest])

    def prepare(self, request: DecisionRequest, questions: list[Question],
                images: LoadedMedia[Lfm2Image] | None = None, draft: Tokenized | None = None) -> Prepared:
        """On the images read (media pool) and the prompts tokenized (`draft`), every prompt's images expanded and
        checked, then every question's labels."""
        tokenized = draft if draft is not None else self.draft(request, questions)
        placeholders = ([self._placeholder_ids(placeholder_text(image)) for image in images.in_order()]
                        if images is not None else [])
        prompts = []
        count = len(request.images or ())
        for question, text, ids in zip(questions, tokenized.texts, tokenized.ids, strict=True):
            found = ids.count(self.image_token_id)
            if found != count:
                # Spec 8 Q7: `<image>` written in the state, instructions or options would take an image's place.
                raise DecisionError(f"question {question.id!r}: the prompt holds {found} <image> tokens for {count} "
                                    "image(s); the state, instructions and options may not contain <image>")
            expanded = expand_images(ids, self.image_token_id, placeholders) if images is not None else ids
            self._check_length(question, text, ids, len(expanded))
            if expanded[len(expanded) - len(self.tail):] != self.tail:
                raise DecisionError(TAIL_MISMATCH)
            prompts.append(RenderedPrompt(question, text, expanded))
        labels = [self.family.labels(q, self._label_ids) for q in questions]
        return Prepared(request, questions, prompts, labels, images)

    def _label_ids(self, text: str) -> Sequence[int]:
        return self._cached_label_ids(text) if len(text) <= LABEL_CACHE_CHARS else self.tokenizer.encode(text)

    # -- work the scheduler splits (runtime/scheduler.py) -----------------------------------------------------
    def encode_media(self, prepared: Prepared, run_options: RunOptions | None = None) -> MediaRows | None:
        """The vision rows of the request's images at their prompt positions (the same in every question)."""
        images: LoadedMedia[Lfm2Image] | None = prepared.media
        if images is None:
            return None
        return media_rows(prepared.prompts[0].token_ids, self.image_token_id, self.media.encode(images, run_options))

    def encode_media_many(self, prepared: list[Prepared], run_options: RunOptions | None = None
                          ) -> list[MediaRows | None]:
        # Crops of one grid from every request share vision runs (D1ImageEncoder.rows_many).
        with_media = [p for p in prepared if p.media is not None]
        encoded = iter(self.media.encode_many([p.media for p in with_media], run_options))
        return [media_rows(p.prompts[0].token_ids, self.image_token_id, next(encoded)) if p.media is not None
                else None for p in prepared]

    def rows(self, prepared: Prepared, encoded: MediaRows | None) -> list[TextRow]:
        return [TextRow(prompt.token_ids, media=encoded, label_ids=tuple(labels.ids))
                for prompt, labels in zip(prepared.prompts, prepared.labels, strict=True)]
