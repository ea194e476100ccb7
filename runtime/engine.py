"""The contract every family's engine keeps, and the options every engine takes.

An engine turns a validated request into one `Readout` per question, in two steps: `prepare` does everything that
can refuse the request (prompts rendered, tokenized and checked on the media its encoder loaded, labels found)
without running a graph, so a bad request is refused before it takes an inference slot; `run` runs the graphs.

An engine whose questions are independent rows of one text graph (`shares_batches`) also splits its graphs' work
so the scheduler (runtime/scheduler.py) can batch questions of different requests together: `encode_media` (the
request's vision graph runs), `rows` (one `TextRow` per question) and `run_rows` (one graph call over rows of any
requests). Its `run` is those three steps for one request, so both paths give the same numbers. An engine may
share batches for some requests only (`runs_whole`: d1 shares its text requests' questions, each whole prompt one
row, and runs whole those with images or with a shared prefix worth prefilling once).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..models.family import Family, Labels, Readout
from ..models.questions import Question
from ..models.request import DecisionRequest
from .artifact import Artifact
from .batch import MAX_BATCH_TOKENS, BatchBudget, CallCost, TextRow
from .cuda_graphs import CaptureBuckets
from .media_encoder import LoadedMedia, MediaEncoder
from .media_fetch import FetchPolicy
from .prompt import RenderedPrompt
from .session import GraphSession
from .tokenizer import shared_prefix


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
    shares_batches: bool = False  # whether its questions' rows may share a graph call with other requests' rows
    # Whether a request's vision graph can run as a job of its own (`encode_media`: the media lane's work) before
    # its rows join calls or, for a request run whole, before its `run`.
    encodes_media_apart: bool = False
    budget: BatchBudget | None = None  # the budget every text-graph call stays within (engines that share batches)
    reads_prefixes: bool = False  # whether its text graph carries state, so a shared prefix can be read once
    call_cost: CallCost | None = None  # measured at start-up (`use_call_cost`)

    @abstractmethod
    def __init__(self, artifact: Artifact, options: EngineOptions):
        """Open the artifact's graphs on `options.device`: here its text graph (small runs captured as CUDA graphs
        where the form allows) and its vision graph; a family's engine adds its runner and media encoder."""
        self.artifact = artifact
        self.family = artifact.family
        self.prefix_reuse = options.prefix_reuse
        self.max_chars_per_token = artifact.tokenizer.max_token_chars()
        self.session = open_graph(artifact, "text", options, capture=True)
        self.vision_session = open_graph(artifact, "vision", options)

    def draft(self, request: DecisionRequest, questions: list[Question]) -> Any:
        """The part of `prepare` that needs no media (prompts rendered and tokenized), which the caller runs while
        the request's media load and hands to `prepare`; None where the family does it all in `prepare`. Raises
        only the `DecisionError`s that `prepare` would raise before it reads the media."""
        return None

    @abstractmethod
    def prepare(self, request: DecisionRequest, questions: list[Question], media: LoadedMedia[Any] | None = None,
                draft: Any = None) -> Prepared:
        """Prompts and labels on the request's `media` (loaded by `self.media` in the media pool; None when the
        request has none) and on `draft` (this engine's `draft` of the request, or None: made here); raises
        `DecisionError` for anything the model cannot answer."""

    @abstractmethod
    def run(self, prepared: Prepared, run_options: Any = None, encoded: Any = None) -> list[Readout]:
        """One readout per question, in question order. `run_options` (onnxruntime RunOptions) lets the caller
        stop the graph runs in flight; `encoded` is the request's `encode_media` output where the media lane ran
        it already (None: the run encodes its media itself; only engines with `encodes_media_apart` are given
        one)."""

    def run_steps(self, prepared: Prepared, run_options: Any = None, encoded: Any = None
                  ) -> Generator[None, None, list[Readout]]:
        """`run` as steps: a generator that yields between its graph calls and returns the readouts, so that the
        scheduler runs other requests' calls between the parts of a request run whole. One step by default."""
        return self.run(prepared, run_options) if encoded is None else self.run(prepared, run_options, encoded)
        yield  # a generator, with no step before it returns

    def seconds(self, prepared: Prepared) -> float | None:
        """About how long the request's graph calls take on their own, by the call cost measured at start-up
        (None before it is measured): its prefix prefilled and questions read on it where it runs whole with a
        prefix read once, else each question's whole prompt. Its vision graph is not counted."""
        cost = self.call_cost
        if cost is None or self.budget is None or not prepared.prompts:
            return None
        lengths = [len(p.token_ids) for p in prepared.prompts]
        split = (shared_prefix([p.token_ids for p in prepared.prompts])
                 if self.reads_prefixes and self.runs_whole(prepared) else 0)
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

    def runs_whole(self, prepared: Prepared) -> bool:
        """Whether the scheduler runs this request with `run`, on its own, rather than as rows sharing calls."""
        return not self.shares_batches

    def warm_up(self) -> None:
        """Start-up work that belongs to the thread that will run the graphs, called on it before any other thread
        runs one (the scheduler's engine thread; a direct caller's own): d1 and d3 capture their CUDA graphs here
        (runtime/cuda_graphs.py). Nothing by default."""

    def use_call_cost(self, cost: CallCost) -> None:
        """The text graph's call cost measured at start-up (runtime/batch_sizing.py), by which the engine groups
        rows of different lengths into calls and `seconds` weighs a request."""
        self.call_cost = cost

    # -- rows that share batches across requests (engines with `shares_batches`) ----------------------------
    def encode_media(self, prepared: Prepared, run_options: Any = None) -> Any:
        """The vision graph's output for the request's media (None when it has none): one job per request, run
        before its rows join a batch."""
        raise NotImplementedError(f"{type(self).__name__} runs each request whole")

    def encode_media_many(self, prepared: list[Prepared], run_options: Any = None) -> list[Any]:
        """`encode_media` of several requests in one job (the scheduler's media batch), in order; an engine whose
        encoder shares vision runs among requests shares them here."""
        return [self.encode_media(p, run_options) for p in prepared]

    def rows(self, prepared: Prepared, encoded: Any) -> list[TextRow]:
        """One row per question, in question order, on the request's encoded media; no graph runs."""
        raise NotImplementedError(f"{type(self).__name__} runs each request whole")

    def run_rows(self, rows: list[TextRow], run_options: Any = None) -> list[Readout]:
        """One text-graph call over `rows` (of any requests, within `budget`); one readout per row, in order."""
        raise NotImplementedError(f"{type(self).__name__} runs each request whole")

    @property
    def captured_rows(self) -> int | None:
        """The most rows a text-graph call replays as a CUDA graph (None: no call is captured)."""
        return self.session.captured_rows

    def probe_row(self, length: int) -> TextRow:
        """A text-only row of `length` tokens, to time the text graph at start-up."""
        raise NotImplementedError(f"{type(self).__name__} runs each request whole")
