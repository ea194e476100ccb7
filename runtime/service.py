"""One request end to end: body -> checks (spec 1.3) -> family engine (prompts, graph runs) -> reads -> answers
(spec 5).

Data flows one way: the body is parsed and validated, the family's engine prepares each question's prompt and
labels (everything that can refuse the request happens here, before any graph runs), then runs its graphs and
returns one readout per question, which the family reads and the question type turns into its answer.
"""

from __future__ import annotations

import math
import secrets
import time
from typing import Any

from ..models.errors import DecisionError, ModelFault, ModelNotFound, NotSupported, TooLarge
from ..models.family import Readout
from ..models.questions import Question, parse_questions
from ..models.request import DecisionRequest, parse_request
from .artifact import Artifact
from .batch_sizing import BatchSizing, measure_batch_rows
from .deadline import Deadline
from .engine import Engine, EngineOptions, Prepared
from .media_allowance import MEDIA_WORKERS, MediaBudget, MediaLimits
from .media_encoder import LoadedMedia
from .media_pool import MediaPool
from .prompt import RenderedPrompt
from .session import resolve_device

RESPONSE_OBJECT = "structured_decision"
ID_PREFIX = "decision-"


# TypeSafe's SDK sends this name unless told otherwise, and jevcompat's MUST `request.model-alias` requires it to
# reach the served model; responses still report the served name.
DEFAULT_ALIASES = ("jev-latest",)


class TooSlow(TooLarge):
    """A request whose graph calls alone would take longer than its deadline leaves: it could never be answered."""


def new_request_id() -> str:
    return f"{secrets.randbits(64):016x}"


class DecisionService:
    """Answers `/v1/systemone` bodies for one artifact on one device."""

    def __init__(self, artifact: Artifact, options: EngineOptions | None = None,
                 served_model_names: list[str] | None = None, media_limits: MediaLimits | None = None,
                 aliases: tuple[str, ...] = DEFAULT_ALIASES, media_workers: int = MEDIA_WORKERS,
                 media_budget: MediaBudget | None = None, media_processes: int = 0):
        options = options or EngineOptions()
        if options.max_model_len and options.max_model_len > artifact.max_model_len:
            raise ValueError(f"max_model_len={options.max_model_len} is more than the model's "
                             f"{artifact.max_model_len} positions")
        # The form for the device: the half-precision CUDA form where export wrote one, else the portable graphs.
        artifact = artifact.with_form(options.form, resolve_device(options.device))
        self.artifact = artifact
        self.family = artifact.family
        self.served_model_names = served_model_names or [artifact.source]
        self.aliases = aliases
        self.engine: Engine = artifact.entry.load_engine()(artifact, options)
        self.media_limits = media_limits or MediaLimits()
        self.media_pool = MediaPool(media_workers, media_budget, media_processes)
        self._batch_sizing: BatchSizing | None = None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def provider(self) -> str:
        return self.engine.session.provider

    @property
    def form(self) -> str:
        return self.artifact.form

    def warm_up(self) -> None:
        """The engine's start-up work on this thread (d3: its CUDA graphs captured), for callers that run the
        service directly rather than through the server's scheduler, which warms up on its own engine thread."""
        self.engine.warm_up()

    def close(self) -> None:
        """Stop the media threads and processes (the engine's sessions go with the object)."""
        self.media_pool.close()

    @property
    def captures(self) -> bool:
        """Whether the text graph's small runs replay captured CUDA graphs."""
        return self.engine.session.captured is not None

    @property
    def cuda_graphs(self) -> str:
        """What the text graph captured, or why it did not (`serve` prints it)."""
        return self.engine.session.describe_capture()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def batch_sizing(self) -> BatchSizing:
        """How many rows a text-graph call takes on this device, measured once (runtime/batch_sizing.py) unless
        one was adopted."""
        if self._batch_sizing is None:
            self.adopt_batch_sizing(measure_batch_rows(self.engine))
        assert self._batch_sizing is not None
        return self._batch_sizing

    def adopt_batch_sizing(self, sizing: BatchSizing) -> None:
        """Take `sizing` (a measurement kept from an earlier start on this machine) as this service's: its rows a
        call and its call cost."""
        self._batch_sizing = sizing
        if sizing.cost is not None:
            self.engine.use_call_cost(sizing.cost)

    # -- validation (spec 1.3 steps 1-8) ---------------------------------------------------------------------
    def validate(self, body: Any) -> tuple[DecisionRequest, list[Question]]:
        if self.engine.unsupported:
            # Spec 1.1: a model whose read cannot work refuses every call.
            raise NotSupported("The model does not support the structured decision API")
        request = parse_request(body)
        if request.model and request.model not in self.served_model_names and request.model not in self.aliases:
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

    def has_media(self, request: DecisionRequest) -> bool:
        return self.engine.media is not None and bool(self.engine.media.jobs(request))

    def load_media(self, request: DecisionRequest, deadline: Deadline | None = None) -> LoadedMedia[Any] | None:
        """The request's media fetched, decoded and preprocessed in the media pool (the server awaits them on its
        event loop instead, so no parsing thread waits on a fetch)."""
        if not self.has_media(request):
            return None
        return self.media_pool.load(self.engine.media, request, deadline)

    def prepare_loaded(self, request: DecisionRequest, questions: list[Question],
                       media: LoadedMedia[Any] | None, draft: Any = None, deadline: Deadline | None = None
                       ) -> Prepared:
        """Prompts and labels on the loaded media (and the engine's `draft` of the request, if made); no graph has
        run. With a `deadline`, a request whose graph calls alone would take longer than it has left, at the rate
        measured at start-up, is refused (`TooSlow`) rather than run until its deadline."""
        prepared = self.engine.prepare(request, questions, media, draft)
        if deadline is not None:
            self.check_time(prepared, deadline)
        return prepared

    def check_time(self, prepared: Prepared, deadline: Deadline) -> None:
        seconds = self.engine.seconds(prepared)
        left = deadline.remaining()
        if seconds is not None and seconds > left:
            tokens = sum(len(p.token_ids) for p in prepared.prompts)
            raise TooSlow(f"this request's {tokens:,} prompt tokens would take the model about {seconds:.1f} s at "
                          f"the rate measured at start-up, more than the {left:.1f} s left of its "
                          f"{deadline.seconds:g} s (--request-timeout); send a shorter state or fewer questions")

    def prepare(self, body: Any, deadline: Deadline | None = None) -> Prepared:
        """Every check the request must pass, media read, prompts and labels ready; no graph has run. The prompts
        are drafted while the media load."""
        request, questions = self.validate(body)
        if not self.has_media(request):
            return self.prepare_loaded(request, questions, None)
        loading = self.media_pool.begin(self.engine.media, request, deadline)
        draft, media = loading.with_draft(lambda: self.engine.draft(request, questions))
        return self.prepare_loaded(request, questions, media, draft)

    # -- prompts ----------------------------------------------------------------------------------------------
    def render(self, body: Any) -> list[RenderedPrompt]:
        """Every question's prompt as the model would read it (media fetched and expanded). The request's model name
        plays no part in a prompt, so it is not checked: a request written for another served name renders too."""
        if isinstance(body, dict) and body.get("model"):
            body = {**body, "model": None}
        return self.prepare(body).prompts

    # -- the whole request (spec 5) --------------------------------------------------------------------------
    def decide(self, body: Any, header_request_id: str | None = None, run_options: Any = None) -> dict[str, Any]:
        """Answer one body; `run_options` (onnxruntime RunOptions) lets the caller stop the run in flight."""
        return self.answer(self.prepare(body), header_request_id, run_options)

    def answer(self, prepared: Prepared, header_request_id: str | None = None,
               run_options: Any = None) -> dict[str, Any]:
        """Run a prepared request's graphs on their own; its response."""
        return self.respond(prepared, self.engine.run(prepared, run_options), header_request_id)

    def respond(self, prepared: Prepared, readouts: list[Readout], header_request_id: str | None = None
                ) -> dict[str, Any]:
        """The response from the graphs' readouts (one per question, in order, however they were batched): each
        question's read through its family, then its answer through its question type."""
        answers, diagnostics = {}, {}
        for question, labels, readout in zip(prepared.questions, prepared.labels, readouts, strict=True):
            read = self.family.read(question, labels, readout)
            if not all(math.isfinite(p) for p in (*read.probs, read.label_mass)):
                raise ModelFault(f"the model's scores for question {question.id!r} are not all finite numbers; "
                                 "the model or its export is at fault, not the request")
            answers[question.id] = question.answer(read)
            diagnostics[question.id] = {"label_mass": read.label_mass, "argmax_is_label": read.argmax_is_label}
        request_id = header_request_id or prepared.request.request_id or new_request_id()
        return {
            "id": ID_PREFIX + request_id,
            "object": RESPONSE_OBJECT,
            "created": int(time.time()),
            "model": self.model_name,
            "answers": answers,
            "usage": {"input_tokens": sum(len(p.token_ids) for p in prepared.prompts),
                      "output_tokens": self.family.output_tokens(prepared.questions)},
            "diagnostics": diagnostics,
            "joint": None,
        }
