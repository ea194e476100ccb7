"""Family d1 on onnxruntime: the Liquid prompts of a request, its shared prefix prefilled once, the questions read
as suffixes on its state (spec 3).

Order of the checks, as vLLM runs them (spec 1.3 step 8): images fetched and read, then every question's prompt
rendered, tokenized and checked for length (3.9) and its generation tail (3.5), then every question's label groups
(3.6), then the reads (3.7). Each question's prompt is tokenized whole, exactly as vLLM tokenizes it; the prefix
that all of them share (state, images, system turn) is found on the token ids, so reuse never changes a token.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from ...models.errors import DecisionError
from ...models.family import Readout
from ...models.questions import QUESTION_TYPES, Question
from ...models.request import DecisionRequest
from ..artifact import Artifact
from ..batch import UNMEASURED_COST, BatchBudget, CallCost, TextRow, drive
from ..engine import Engine, EngineOptions, Prepared
from ..media_encoder import LoadedMedia
from ..prompt import RenderedPrompt, render_texts
from ..tokenizer import shared_prefix
from .image_processor import Lfm2Image, Lfm2ImageConfig, placeholder_text
from .images import D1ImageEncoder, expand_images, media_rows
from .state import D1TextRunner, layout_of

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


def readouts(label_ids: list[int], logprobs: np.ndarray, argmax: np.ndarray) -> list[Readout]:
    """One readout per row of a read: its log-probabilities at `label_ids` and its greedy token."""
    return [Readout(dict(zip(label_ids, row.tolist())), int(top)) for row, top in zip(logprobs, argmax, strict=True)]


class D1Engine(Engine):
    # A one-question text request is one row (its whole prompt from an empty state) and shares calls with other
    # requests' rows; a request with images, or several questions on a prefix worth prefilling once (`runs_whole`),
    # runs whole (on a GPU its images encoded first, in the media lane, beside other requests' text calls).
    shares_batches = True
    encodes_media_apart = True
    reads_prefixes = True

    def __init__(self, artifact: Artifact, options: EngineOptions):
        super().__init__(artifact, options)
        fields = artifact.manifest.model
        self.tokenizer = artifact.tokenizer
        # The graph reads a prefix chunk by chunk and its KV cache grows linearly: the context is the model's.
        self.max_model_len = options.max_model_len or artifact.max_model_len
        self.budget = BatchBudget(options.max_batch_tokens, options.attention_budget,
                                  int(fields["num_attention_heads"]), options.slice_s)
        self.runner = D1TextRunner(self.session, self.budget, int(fields["hidden_size"]), layout_of(fields))
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

    def warm_up(self) -> None:
        self.runner.capture()

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

    # -- reads (spec 3.6, 3.7) -------------------------------------------------------------------------------
    def run(self, prepared: Prepared, run_options: Any = None, encoded: np.ndarray | None = None,
            reuse_prefix: bool = True) -> list[Readout]:
        """Each question's label log-probabilities and greedy token. With `reuse_prefix` (the default) the shared
        prefix runs once and the questions run as suffixes on its state; without, or with reuse turned off, every
        whole prompt runs (the baseline the prefix saving is measured against)."""
        return drive(self.run_steps(prepared, run_options, encoded, reuse_prefix))

    def run_steps(self, prepared: Prepared, run_options: Any = None, encoded: np.ndarray | None = None,
                  reuse_prefix: bool = True) -> Generator[None, None, list[Readout]]:
        """`run` as steps, one graph call (a prefix chunk, a batch of reads) a step."""
        label_ids = sorted({i for g in prepared.labels for i in g.ids})
        ids = [p.token_ids for p in prepared.prompts]
        # A prompt longer than one call is still read in parts, each on the state the last left, whatever the flag.
        slow = self.slow_row([len(i) for i in ids])  # read in chunks, whatever the reuse setting
        reuse_prefix = reuse_prefix and (self.prefix_reuse or slow or not self._each_fits_one_call(ids))
        media = None
        if prepared.media is not None:
            if encoded is None:
                encoded = self.encode_media(prepared, run_options)
                yield
            media = media_rows(ids[0], self.image_token_id, encoded)
        if reuse_prefix and len(ids) == 1 and media is None and self._each_fits_one_call(ids) and not slow:
            # One question without images has nothing to share: its whole prompt is one call from an empty state,
            # as its row in a shared call would be (a captured bucket's replay where it fits one), not a prefill
            # and a one-token read (two launch-bound calls on a GPU).
            logprobs, argmax = self.runner.read_prompts(ids, label_ids, run_options)
        elif reuse_prefix:
            # Images stay in the prefix, where their rows go; a prompt too long for one call is prefilled first.
            split = shared_prefix(ids) if len(ids) > 1 or media is not None or slow else 0
            if media is not None and len(media.positions) and media.positions[-1] >= split:
                raise RuntimeError("image rows past the shared prefix")
            past = yield from self.runner.prefilling(self.runner.start(), ids[0][:split], media, run_options)
            yield
            logprobs, argmax = yield from self.runner.reading_suffixes(past, [p[split:] for p in ids], label_ids,
                                                                       run_options)
        else:
            logprobs, argmax = yield from self.runner.reading_wholes(ids, label_ids, media, run_options)
        return readouts(label_ids, logprobs, argmax)

    # -- work the scheduler splits (runtime/scheduler.py) -----------------------------------------------------
    def encode_media(self, prepared: Prepared, run_options: Any = None) -> np.ndarray | None:
        """The vision rows of the request's images, in prompt order (on a GPU the media lane runs this beside the
        text calls, then the request runs whole on them)."""
        images: LoadedMedia[Lfm2Image] | None = prepared.media
        return None if images is None else self.media.encode(images, run_options)

    def encode_media_many(self, prepared: list[Prepared], run_options: Any = None) -> list[np.ndarray | None]:
        # Crops of one grid from every request share vision runs (D1ImageEncoder.rows_many).
        with_media = [p for p in prepared if p.media is not None]
        encoded = iter(self.media.encode_many([p.media for p in with_media], run_options))
        return [next(encoded) if p.media is not None else None for p in prepared]

    def use_call_cost(self, cost: CallCost) -> None:
        super().use_call_cost(cost)
        self.runner.cost = cost

    def runs_whole(self, prepared: Prepared) -> bool:
        """A request with images runs whole (their rows are in its prefix), as does a prompt too long for one call.
        Several questions run whole only where prefilling their shared prefix once saves more than the call it
        adds: otherwise each question is a row of its own (its whole prompt, exact), in calls shared with other
        requests. With a GPU's launch-bound calls (d1-3B on an H200: 6.8 ms a call, 12.4 us a token), two or three
        short questions were a prefill and a read of their own: two calls where one shared call does. The call
        added is weighed at its fixed part, or at the cost model's floor where that is more. With reuse turned
        off, only images and prompts too long for one call keep a request whole."""
        ids = [p.token_ids for p in prepared.prompts]
        if prepared.media is not None or not self._each_fits_one_call(ids) or self.slow_row([len(i) for i in ids]):
            return True
        if len(ids) == 1 or not self.prefix_reuse:
            return False
        cost = self.runner.cost or UNMEASURED_COST
        return cost.prefix_pays(len(ids), shared_prefix(ids))

    def _each_fits_one_call(self, ids: Sequence[Sequence[int]]) -> bool:
        """Whether every prompt can be read whole in one call (a longer one is read in parts on its state)."""
        return all(self.budget.fits(1, len(i)) for i in ids)

    def rows(self, prepared: Prepared, encoded: Any) -> list[TextRow]:
        return [TextRow(prompt.token_ids, label_ids=tuple(labels.ids))
                for prompt, labels in zip(prepared.prompts, prepared.labels, strict=True)]

    def run_rows(self, rows: list[TextRow], run_options: Any = None) -> list[Readout]:
        # One call reads every row's labels: each row's read picks its own from the union.
        label_ids = sorted({i for row in rows for i in row.label_ids})
        logprobs, argmax = self.runner.read_prompts([row.token_ids for row in rows], label_ids, run_options)
        return readouts(label_ids, logprobs, argmax)

    def probe_row(self, length: int) -> TextRow:
        return TextRow([0] * length, label_ids=(0,))
