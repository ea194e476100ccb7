"""The text graph's runs, for every family: rows (a question's token ids, the family's positions for them, the media
rows among them) -> one `Readout` per row, read at the row's last token. A call is one right-padded batch; rows of
different requests may share it.

A family says what a call feeds besides its token ids and what it reads (`TextReads`): d1 its label tokens'
log-probabilities and greedy token (runtime/d1/label_reads.py), d3 its answer codes' logits at M-RoPE positions
(runtime/d3/code_logits.py). A graph that carries state (runtime/text_state.py) also reads a request's shared prefix
once, its questions as suffixes on that state, and a prompt too long for one call in chunks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from ..models.errors import DeviceMemoryExhausted
from ..models.family import Readout
from .batch import BatchBudget, CallCost, TextRow, drive, run_in_halves
from .session import GraphSession
from .text_state import Past, StateLayout


class TextReads(ABC):
    """A family's text graph: the inputs a call takes beside its state, and what it reads at each row's last
    token."""

    fetch: tuple[str, ...]  # the outputs a read fetches; the new state a call makes stays on the device
    # How rows of different lengths are grouped into calls before start-up measures a call (`BatchBudget.plan`);
    # None: each call filled as far as the budgets allow.
    unmeasured_cost: CallCost | None = None

    @abstractmethod
    def feeds(self, rows: Sequence[TextRow], width: int | None = None, captured: bool = False
              ) -> dict[str, np.ndarray]:
        """One call's inputs but the state: `rows` right-padded (to `width` where given), each read at its own last
        token, each with its own media rows. `captured`: the call replays a CUDA graph, whose inputs keep one shape
        a bucket."""

    @abstractmethod
    def readouts(self, rows: Sequence[TextRow], outputs: Sequence[np.ndarray]) -> list[Readout]:
        """One readout per row of `rows` from a call's fetched outputs (`fetch`, in its order)."""

    def capturable(self, rows: Sequence[TextRow]) -> bool:
        """Whether a call of these text-only rows from the start may replay a captured bucket."""
        return True

    @abstractmethod
    def probe_row(self, length: int) -> TextRow:
        """A text-only row of `length` tokens: to capture a bucket, to time the graph at start-up."""


class TextRunner:
    """Calls of one text graph, each within `budget`; `layout`: the state the graph carries (None: it carries
    none, and every prompt is read whole)."""

    def __init__(self, session: GraphSession, budget: BatchBudget, reads: TextReads, layout: StateLayout | None):
        self.session = session
        self.budget = budget
        self.reads = reads
        self.layout = layout
        self.cost: CallCost | None = reads.unmeasured_cost  # measured at start-up (`Engine.use_call_cost`)
        # One read-only zero state for every captured replay, which a replay then never copies again
        # (runtime/cuda_graphs.py).
        self.empty: dict[str, np.ndarray] = layout.empty(read_only=True) if layout is not None else {}
        self._start: Past | None = None
        # A graph without state outputs only its reads: a plain run fetches them all.
        self.fetch = reads.fetch if layout is not None else None

    def start(self) -> Past:
        """The state of a prompt from its start, on the device once (d3-nano's zero recurrent states are 18 MB)."""
        if self._start is None:
            self._start = Past(0, self.empty).moved(self.session.device_values)
        return self._start

    # -- one call ---------------------------------------------------------------------------------------------
    def outputs(self, rows: Sequence[TextRow], run_options: Any = None, past: Past | None = None
                ) -> list[np.ndarray]:
        """One graph call over `rows` on `past` (None: from the start): the fetched outputs, in row order. Text-only
        rows from the start that fit a captured bucket are padded to it and replay its CUDA graph: filler rows of
        one token, every row padded to the bucket's length (exact: each row is read at its own last token, its
        padded keys masked or after it)."""
        text_only = all(row.media is None or not row.media.positions.size for row in rows)
        bucket = (self.session.capture_shape(len(rows), max(row.length for row in rows))
                  if text_only and past is None and self.reads.capturable(rows) else None)
        if bucket is None:
            feeds = self.reads.feeds(rows)
            if self.layout is not None:
                feeds.update((past or self.start()).states)
            return self.session.run(feeds, run_options, fetch=self.fetch)
        batch, width = bucket
        padded = [*rows, *[TextRow([0])] * (batch - len(rows))]
        feeds = {**self.reads.feeds(padded, width, captured=True), **self.empty}
        return [out[:len(rows)] for out in self.session.run_captured(feeds, fetch=self.fetch)]

    def run_batch(self, rows: Sequence[TextRow], run_options: Any = None, past: Past | None = None
                  ) -> list[Readout]:
        """One graph call over `rows` on `past` (None: from the start): a readout per row, in row order."""
        return self.reads.readouts(rows, self.outputs(rows, run_options, past))

    def capture(self) -> None:
        """Every bucket's CUDA graph, captured now on this thread (`GraphSession.capture_buckets`). Prefixes and
        the reads on them (a past of any length) run uncaptured."""
        self.session.capture_buckets(lambda batch, width: self.outputs([self.reads.probe_row(width)] * batch))

    # -- whole prompts ----------------------------------------------------------------------------------------
    def run_rows(self, rows: Sequence[TextRow], run_options: Any = None) -> list[Readout]:
        """A readout per row, in row order, each row read from the start, in padded calls within the budget."""
        return drive(self.running_rows(rows, run_options))

    def running_rows(self, rows: Sequence[TextRow], run_options: Any = None
                     ) -> Generator[None, None, list[Readout]]:
        """`run_rows` as steps, one call (or its halves, where the device memory refuses it) a step."""
        out: list[Readout | None] = [None] * len(rows)
        for number, group in enumerate(self.budget.plan([row.length for row in rows], cost=self.cost)):
            if number:
                yield
            results = run_in_halves(lambda part: self.run_batch([rows[i] for i in part], run_options), group)
            for index, result in zip(group, results, strict=True):
                if isinstance(result, DeviceMemoryExhausted):
                    raise result  # a row the arena cannot hold alone: the request cannot be answered now
                out[index] = result
        return out

    # -- a prefix read once, its suffixes on it (a graph with state) ------------------------------------------
    def prefill(self, past: Past, row: TextRow, run_options: Any = None) -> Past:
        """The state after `row` (a request's shared prefix, media rows and all) read on `past`, left on the
        device for the reads after it."""
        return drive(self.prefilling(past, row, run_options))

    def prefilling(self, past: Past, row: TextRow, run_options: Any = None) -> Generator[None, None, Past]:
        """`prefill` as steps: one call a chunk, each as long as the budgets and the time slice allow (one call
        where the row fits them), each chunk on the state the one before it left."""
        if self.layout is None:
            raise RuntimeError("this text graph carries no state: every prompt is read whole")
        start = 0
        while start < row.length:
            if start:
                yield
            size = min(self.budget.chunk_length(past.length, self.cost), row.length - start)
            out = self.session.run_bound({**self.reads.feeds([row.part(start, start + size)]), **past.states},
                                         run_options)
            past = self._after(past, size, out)
            start += size
        return past

    def _after(self, past: Past, size: int, out: dict[str, Any]) -> Past:
        """The state after a call of `size` tokens on `past`, on the device: the first call's outputs kept where
        they are (on a GPU, d1-3B's state made a round trip through pageable host memory, tens of MB), a later
        one's joined to the past's on the host (`StateLayout.after`) and put back."""
        new = [out[name] for name in self.layout.names("new")]
        if not past.length:
            return Past(size, dict(zip(self.layout.names("past"), new, strict=True))).moved(self.session.held)
        return self.layout.after(past, size, new).moved(self.session.device_values)

    def read_suffixes(self, past: Past, rows: Sequence[TextRow], run_options: Any = None) -> list[Readout]:
        """A readout per row (each a question's tokens after the prefix, with their positions) read on `past`, in
        padded calls of similar lengths within the budget; a row too long for a call of its own is read on a
        copy of the past that it extends first, by all but its last chunk."""
        return drive(self.reading_suffixes(past, rows, run_options))

    def reading_suffixes(self, past: Past, rows: Sequence[TextRow], run_options: Any = None
                         ) -> Generator[None, None, list[Readout]]:
        """`read_suffixes` as steps, one call a step."""
        out: list[Readout | None] = [None] * len(rows)
        fitting = []
        for index, row in enumerate(rows):
            if self.budget.fits(1, row.length, past.length):
                fitting.append(index)
                continue
            keep = self.budget.chunk_length(past.length + row.length)  # the last chunk, read on the extended state
            own = yield from self.prefilling(past, row.part(0, row.length - keep), run_options)
            yield
            (out[index],) = self.run_batch([row.part(row.length - keep)], run_options, own)
            yield
        # The prefix's state goes to the device once, not once a call.
        past = past.moved(self.session.device_values)
        for number, group in enumerate(self.budget.plan([rows[i].length for i in fitting], past.length, self.cost)):
            if number:
                yield
            chosen = [fitting[i] for i in group]
            for index, readout in zip(chosen, self.run_batch([rows[i] for i in chosen], run_options, past),
                                      strict=True):
                out[index] = readout
        return out
