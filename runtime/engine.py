"""The contract every family's engine keeps, and the options every engine takes.

An engine turns a validated request into one `Readout` per question, in two steps: `prepare` does everything that
can refuse the request (prompts rendered, tokenized and checked on the media its encoder loaded, labels found)
without running a graph, so a bad request is refused before it takes an inference slot; `run` runs the graphs.

A family whose questions are rows of one text graph (d1, d3) gives the engine a `TextRunner`
(runtime/text_runner.py) and its rows; the engine then splits its graphs' work so the scheduler
(runtime/scheduler.py) can batch questions of different requests together: `encode_media` (the request's vision
graph runs), `rows` (one `TextRow` per question) and `run_rows` (one graph call over rows of any requests). Its
`run` is those steps for one request, so both paths give the same numbers; a request whose questions are read on
their shared prefix, read once (`prefix_split`), runs whole.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..models.family import Family, Labels, Readout
from ..models.questions import Question
from ..models.request import DecisionRequest
from .artifact import Artifact
from .batch import MAX_BATCH_TOKENS, UNMEASURED_COST, BatchBudget, CallCost, MediaRows, TextRow, drive
from .cuda_graphs import CaptureBuckets
from .media_encoder import LoadedMedia, MediaEncoder
from .media_fetch import FetchPolicy
from .prompt import RenderedPrompt
from .session import GraphSession
from .text_runner import TextRunner
from .tokenizer import shared_prefix

if TYPE_CHECKING:
    from onnxruntime import RunOptions


@dataclass(frozen=True)
class EngineOptions:
    device: str = "auto"
    max_model_len: int | None = None  # longest prompt; None: the model's (and the memory budget's)
    max_batch_tokens: int = MAX_BATCH_TOKENS
    threads: int | None = None
    attention_budget: int = 4 << 30  # bytes of attention scores one graph call may hold
    fetch_policy: FetchPolicy = field(default_factory=FetchPolicy)
    form: str = "auto"  # which of the artifact's forms to run (auto: the best for the device; docs/artifact.md)
    gpu_memory: int | None = None  # bytes each graph's CUDA arena may hold (--gpu-memory); None: unbounded
    cuda_graphs: bool = True  # capture small text-graph runs as CUDA graphs where the graph allows (CUDA only)
    # Read a request's shared prefix once for its questions where that saves more than the call it adds (d1,
    # causal d3); False: every question's whole prompt, as a row of its own (--no-prefix-reuse).
    prefix_reuse: bool = True
    # The longest a call of several rows, or a chunk of a long prefix, should take by the measured call cost, so
    # that a large request's work is split into parts and other requests' calls run between them (BatchBudget).
    slice_s: float | None = 0.1


@dataclass(frozen=True)
class Prepared:
    """A request ready to run: each question's prompt and labels, and the family's media (read, not encoded)."""

    request: DecisionRequest
    questions: list[Question]
    prompts: list[RenderedPrompt]
    labels: list[Labels]
    media: Any = None


def open_graph(artifact: Artifact, name: str, options: EngineOptions, capture: bool = False) -> GraphSession:
    """Graph `name` of the artifact's form on `options.device`; with `capture`, its small runs as CUDA graphs where
    `options.cuda_graphs` and the form allow."""
    return GraphSession(artifact.graph_path(name), options.device, options.threads, options.gpu_memory,
                        CaptureBuckets() if capture and options.cuda_graphs else None,
                        in_graph_order=artifact.casts_weights_per_run(name))


class Engine(ABC):
    artifact: Artifact
    family: Family
    max_model_len: int
    session: GraphSession  # the text graph's
    vision_session: GraphSession
    unsupported: str | None = None  # why the model cannot serve decisions at all, if it cannot
    media: MediaEncoder[Any] | None = None  # how its images and videos are loaded and encoded, if it takes any
    # Its text graph's calls (d1, d3): its questions are rows that may share a call with other requests' rows. An
    # engine without one runs each request whole, with its own `run`.
    runner: TextRunner | None = None
    # Whether a request's vision graph can run as a job of its own (`encode_media`: the media lane's work) before
    # its rows join calls or, for a request run whole, before its `run`.
    encodes_media_apart: bool = False
    budget: BatchBudget | None = None  # the budget every text-graph call stays within (engines with a runner)
    call_cost: CallCost | None = None  # measured at start-up (`use_call_cost`)

    @abstractmethod
    def __init__(self, artifact: Artifact, options: EngineOptions):
        """Open the artifact's graphs on `options.device`: here its text graph (small runs captured as CUDA graphs
        where the form allows) and its vision graph; a family's engine adds its runner and media encoder."""
        self.artifact = artifact
        self.family = artifact.family
        self.prefix_reuse = options.prefix_reuse
        self.max_chars_per_token = artifact.max_token_chars
        self.session = open_graph(artifact, "text", options, capture=True)
        self.vision_session = open_graph(artifact, "vision", options)

    @property
    def shares_batches(self) -> bool:
        """Whether its questions' rows may share a graph call with other requests' rows."""
        return self.runner is not None

    @property
    def reads_prefixes(self) -> bool:
        """Whether its text graph carries state, so that a request's shared prefix can be read once."""
        return self.runner is not None and self.runner.layout is not None

    def draft(self, request: DecisionRequest, questions: list[Question]) -> object | None:
        """The part of `prepare` that needs no media (prompts rendered and tokenized), which the caller runs while
        the request's media load and hands to `prepare`; None where the family does it all in `prepare`. Raises
        only the `DecisionError`s that `prepare` would raise before it reads the media."""
        return None

    @abstractmethod
    def prepare(self, request: DecisionRequest, questions: list[Question], media: LoadedMedia[Any] | None = None,
                draft: object | None = None) -> Prepared:
        """Prompts and labels on the request's `media` (loaded by `self.media` in the media pool; None when the
        request has none) and on `draft` (this engine's `draft` of the request, or None: made here); raises
        `DecisionError` for anything the model cannot answer."""

    def run(self, prepared: Prepared, run_options: RunOptions | None = None, encoded: MediaRows | None = None
            ) -> list[Readout]:
        """One readout per question, in question order. `run_options` lets the caller stop the graph runs in
        flight; `encoded` is the request's `encode_media` output where the media lane ran it already (None: the
        run encodes its media itself)."""
        if self.runner is None:
            raise NotImplementedError(f"{type(self).__name__} has no text runner: it runs its requests itself")
        return drive(self.run_steps(prepared, run_options, encoded))

    def run_steps(self, prepared: Prepared, run_options: RunOptions | None = None, encoded: MediaRows | None = None
                  ) -> Generator[None, None, list[Readout]]:
        """`run` as steps: a generator that yields between its graph calls (the vision graph's, a prefix chunk, a
        call of rows) and returns the readouts, so that the scheduler runs other requests' calls between the parts
        of a request run whole. The questions are read on their shared prefix, read once, where `prefix_split`
        says so; else each question's whole prompt is a row. An engine without a runner: its `run`, one step."""
        if self.runner is None:
            return self.run(prepared, run_options) if encoded is None else self.run(prepared, run_options, encoded)
        if encoded is None and prepared.media is not None:
            encoded = self.encode_media(prepared, run_options)
            yield
        rows = self.rows(prepared, encoded)
        split = self.prefix_split(prepared)
        if not split:
            return (yield from self.runner.running_rows(rows, run_options))
        media = rows[0].media
        if media is not None and len(media.positions) and media.positions[-1] >= split:
            raise RuntimeError("media rows past the shared prefix")
        past = yield from self.runner.prefilling(self.runner.start(), rows[0].part(0, split), run_options)
        yield
        return (yield from self.runner.reading_suffixes(past, [row.part(split) for row in rows], run_options))

    def prefix_split(self, prepared: Prepared) -> int:
        """The tokens of the prefix a request's questions share (its system turn, media and state) read once, the
        questions then read as suffixes on its state; 0: each question's whole prompt is a row. A prompt too long
        for one call, or slower than the time slice (`slow_row`), is read on its prefix whatever the setting, the
        prefix in chunks; otherwise a prefix is read once where reuse is on (--no-prefix-reuse), the request asks
        two questions or more, and reading it once saves more than the call it adds (`CallCost.prefix_pays`, at
        the measured cost)."""
        if not self.reads_prefixes or not prepared.prompts:
            return 0
        ids = [p.token_ids for p in prepared.prompts]
        if self.slow_row([len(i) for i in ids]) or not all(self.budget.fits(1, len(i)) for i in ids):
            return shared_prefix(ids)
        if len(ids) < 2 or not self.prefix_reuse:
            return 0
        split = shared_prefix(ids)
        return split if (self.runner.cost or UNMEASURED_COST).prefix_pays(len(ids), split) else 0

    def runs_whole(self, prepared: Prepared) -> bool:
        """Whether the scheduler runs this request with `run_steps`, on its own, rather than as rows sharing
        calls: an engine without a runner, or questions read on their prefix."""
        return not self.shares_batches or bool(self.prefix_split(prepared))

    def seconds(self, prepared: Prepared) -> float | None:
        """About how long the request's graph calls take on their own, by the call cost measured at start-up
        (None before it is measured): its prefix prefilled and questions read on it where it is read once, else
        each question's whole prompt. Its vision graph is not counted."""
        cost = self.call_cost
        if cost is None or self.budget is None or not prepared.prompts:
            return None
        lengths = [len(p.token_ids) for p in prepared.prompts]
        split = self.prefix_split(prepared)
        seconds, past = 0.0, 0
        while past < split:
            chunk = min(self.budget.chunk_length(past, cost), split - past)
            seconds += cost.seconds(1, chunk, past)
            past += chunk
        return seconds + sum(cost.seconds(1, n - split, split) for n in lengths)

    def slow_row(self, lengths: Sequence[int]) -> bool:
        """Whether a prompt of one of `lengths` would take one call longer than the time slice, by the measured
        cost: an engine whose graph carries state reads it in chunks instead (as a request run whole)."""
        cost, budget = self.call_cost, self.budget
        return (cost is not None and budget is not None and budget.slice_s is not None
                and any(cost.seconds(1, n) > budget.slice_s for n in lengths))

    def warm_up(self) -> None:
        """Start-up work that belongs to the thread that will run the graphs, called on it before any other thread
        runs one (the scheduler's engine thread; a direct caller's own): the runner's CUDA graphs captured here
        (runtime/cuda_graphs.py)."""
        if self.runner is not None:
            self.runner.capture()

    def use_call_cost(self, cost: CallCost) -> None:
        """The text graph's call cost measured at start-up (runtime/batch_sizing.py), by which the runner groups
        rows of different lengths into calls and `seconds` weighs a request."""
        self.call_cost = cost
        if self.runner is not None:
            self.runner.cost = cost

    # -- rows that share calls across requests (engines with a runner) ----------------------------------------
    def encode_media(self, prepared: Prepared, run_options: RunOptions | None = None) -> MediaRows | None:
        """The vision graph's rows for the request's media at their prompt positions (None when it has none): one
        job per request, run before its rows join a call."""
        raise NotImplementedError(f"{type(self).__name__} runs each request whole")

    def encode_media_many(self, prepared: list[Prepared], run_options: RunOptions | None = None
                          ) -> list[MediaRows | None]:
        """`encode_media` of several requests in one job (the scheduler's media batch), in order; an engine whose
        encoder shares vision runs among requests shares them here."""
        return [self.encode_media(p, run_options) for p in prepared]

    def rows(self, prepared: Prepared, encoded: MediaRows | None) -> list[TextRow]:
        """One row per question, in question order, on the request's encoded media; no graph runs."""
        raise NotImplementedError(f"{type(self).__name__} runs each request whole")

    def run_rows(self, rows: list[TextRow], run_options: RunOptions | None = None) -> list[Readout]:
        """One text-graph call over `rows` (of any requests, within `budget`); one readout per row, in order."""
        if self.runner is None:
            raise NotImplementedError(f"{type(self).__name__} runs each request whole")
        return self.runner.run_batch(rows, run_options)

    @property
    def captured_rows(self) -> int | None:
        """The most rows a text-graph call replays as a CUDA graph (None: no call is captured)."""
        return self.session.captured_rows

    def probe_row(self, length: int) -> TextRow:
        """A text-only row of `length` tokens, to time the text graph at start-up."""
        if self.runner is None:
            raise NotImplementedError(f"{type(self).__name__} runs each request whole")
        return self.runner.reads.probe_row(length)
