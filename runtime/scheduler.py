"""The engine's turn: one thread runs the server's text-graph calls, fed by a queue of admitted requests, and with
`media_lane` a second thread runs the vision graph beside it.

Requests arrive prepared (checked, media loaded, prompts tokenized). In the engine thread:

- a request its engine runs whole (`Engine.runs_whole`: several questions on a prefix worth prefilling once as
  its own state, or a prompt too long for one call) is a job a step of its run (`Engine.run_steps`: a prefix
  chunk, a batch of its reads, each about `BatchBudget.slice_s` long), after its vision job in the media lane
  where there is one;
  each step takes its turn in the order below as a row does, so other requests' calls run between its steps;
- otherwise a request with media first runs its vision graph, in a vision job (in the media lane's thread where
  there is one, so that no text call waits behind a vision run and the two graphs' runs overlap); then its rows
  join the queue (a text-only request's rows join at once);
- a vision job takes every request then waiting for one, up to MEDIA_BATCH, so their crops share the vision
  graph's runs where the engine's encoder can share them (d1's crops of one grid, of any request);
- rows of different requests share padded text-graph calls. Rows are taken in start-time fair order: a request
  arriving when the scheduler's virtual time is V has its rows at V, V+1, V+2, ... (V is the place of the last row
  taken), ties in arrival order. So requests waiting together take turns row by row: a request of 64 questions
  cannot hold back a one-question request that arrives after it, and a stream of new requests cannot hold back
  the later rows of one already waiting. The first row in that order anchors the call; later ones join it while
  it has fewer than `batch_rows` rows, their lengths stay within FILL of its longest (padding costs as much as real
  tokens) and it fits the engine's budget (padded tokens, attention memory, and the time slice by the measured
  call cost). While the call could take more rows, it waits up to `batch_wait_s` after its rows became ready for
  other requests' rows to arrive.

- a row too long for the time slice that the engine cannot split (a bidirectional d3 prompt of thousands of
  tokens: one call of seconds on a CPU) runs in the long lane, a thread of its own, beside the engine thread's
  calls, so that no other request waits for it to end.

A request is answered when its last row returns. A call or vision job the device memory (--gpu-memory) cannot
hold runs again in smaller parts, and only a request whose own row or media does not fit alone fails (a 503). A
request whose deadline has passed, or that was abandoned (its client left, its time ran out: `Deadline.cancel`),
has its waiting rows dropped; a call in flight is stopped (onnxruntime's `RunOptions.terminate`) only when every
request in it is gone, so batch mates still get their answers. `close` lets every request already submitted finish,
then ends the threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import islice
from collections.abc import Callable, Generator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import onnxruntime as ort

from ..models.errors import DeviceMemoryExhausted, Unavailable
from ..models.family import Readout
from .batch import CallCost, TextRow, run_in_halves
from .deadline import Deadline
from .engine import Engine, Prepared

log = logging.getLogger(__name__)

# The shortest row of a call is at least this fraction of its longest: a row much shorter waits for a call of its
# own rather than pay for the padding.
FILL = 0.5
# Requests whose vision graphs one media job runs together (their crops share runs where the encoder can share
# them): what waits is taken, up to this many, without waiting for more.
MEDIA_BATCH = 8


@dataclass(eq=False)
class _Ticket:
    """One submitted request: its rows waiting, its readouts so far, and the future its caller awaits."""

    prepared: Prepared
    deadline: Deadline
    future: Future
    arrival: int
    stage: str  # "whole" (jobs of its run's steps), "media" (its vision job first), "rows" (rows queued or in flight)
    encoded: Any = None  # its media's vision output, where the media lane ran it before its whole run
    steps: Generator[None, None, list[Readout]] | None = None  # its whole run, once begun (`Engine.run_steps`)
    options: Any = None  # the RunOptions its whole run's steps share (set to stop them)
    pending: deque[tuple[int, TextRow]] = field(default_factory=deque)
    readouts: list[Readout | None] = field(default_factory=list)
    start: int = 0  # the scheduler's virtual time when it arrived: its first row's place in the order
    taken: int = 0  # rows taken into calls so far
    ready_at: float = 0.0  # when its rows joined the queue

    @property
    def gone(self) -> bool:
        return self.deadline.expired() or self.future.cancelled()

    def key(self, offset: int = 0) -> tuple[int, int]:
        """The place of its row `taken + offset` in the order rows are taken: (virtual time, arrival)."""
        return (self.start + self.taken + offset, self.arrival)


@dataclass
class _Call:
    """The work in flight: which requests it serves and the options that stop it."""

    tickets: list[_Ticket]
    options: Any


# The lanes: the engine thread; the vision graph's own, where there is one; and one for the rows too long for the
# time slice that the engine cannot split (a bidirectional d3 prompt), run beside the engine thread's calls.
TEXT, MEDIA, LONG = "text", "media", "long"


class Scheduler:
    def __init__(self, engine: Engine, batch_rows: int = 1, batch_wait_s: float = 0.001, media_lane: bool = False,
                 cost: CallCost | None = None):
        if batch_rows < 1 or batch_wait_s < 0:
            raise ValueError(f"batch_rows must be >= 1 (got {batch_rows}) and batch_wait_s >= 0 (got {batch_wait_s})")
        self.engine = engine
        self.batch_rows = batch_rows
        self.batch_wait_s = batch_wait_s
        self.cost = cost  # the call cost measured at start-up: a call of several rows stays within the time slice
        self.lanes = (TEXT, MEDIA) if media_lane and engine.encodes_media_apart else (TEXT,)
        budget = engine.budget
        if cost is not None and budget is not None and budget.slice_s is not None and engine.shares_batches:
            self.lanes += (LONG,)
        self._cond = threading.Condition()
        self._tickets: list[_Ticket] = []
        self._arrivals = 0
        self._virtual = 0  # the virtual time of the last row taken (start-time fair queueing)
        self._in_flight: dict[str, _Call] = {}  # by lane
        self._closing = False
        self._threads: dict[str, threading.Thread] = {}
        self._warm = threading.Event()  # the engine's warm-up is done: the media lane may run graphs
        self._busy_s = dict.fromkeys(self.lanes, 0.0)  # seconds each lane spent in jobs (/metrics)
        self._jobs = dict.fromkeys(self.lanes, 0)

    # -- the callers' side -------------------------------------------------------------------------------------
    def submit(self, prepared: Prepared, deadline: Deadline) -> Future[list[Readout]]:
        """Queue a prepared request; the future gives one readout per question, in question order. Cancelling the
        future or the deadline drops the request's rows."""
        future: Future[list[Readout]] = Future()
        with self._cond:
            if self._closing:
                raise Unavailable("the server is shutting down; retry later")
            self._arrivals += 1
            ticket = _Ticket(prepared, deadline, future, self._arrivals, self._first_stage(prepared),
                             start=self._virtual, readouts=[None] * len(prepared.questions))
            if ticket.stage == "rows":
                self._queue_rows(ticket, self.engine.rows(prepared, None))
            self._tickets.append(ticket)
            self._start_lanes(self.lanes)
            self._cond.notify_all()
        unregister = deadline.on_cancel(lambda: self._on_gone())
        future.add_done_callback(lambda done: self._on_gone() if done.cancelled() else unregister())
        return future

    def start(self) -> None:
        """Start the engine thread now and return once the engine has warmed up on it (d3: its CUDA graphs
        captured, on the thread that replays them), so the first request does not wait for it. Without it the
        engine thread starts, and warms up, at the first request."""
        with self._cond:
            if self._closing:
                raise Unavailable("the server is shutting down; retry later")
            self._start_lanes((TEXT,))
        self._warm.wait()

    def _start_lanes(self, lanes: tuple[str, ...]) -> None:
        for lane in lanes:
            if lane not in self._threads:
                self._threads[lane] = threading.Thread(target=self._loop, args=(lane,), daemon=True,
                                                       name=f"systemone-{'engine' if lane == TEXT else lane}")
                self._threads[lane].start()

    def close(self, timeout: float | None = None) -> None:
        """Take no new request; let every submitted one finish, then end the engine thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet answered."""
        with self._cond:
            return len(self._tickets)

    def work(self) -> dict[str, tuple[float, int]]:
        """Seconds each lane has spent running jobs, and its jobs, since start (a lane busy nearly all the time is
        the server's bound)."""
        with self._cond:
            return {lane: (self._busy_s[lane], self._jobs[lane]) for lane in self.lanes}

    def _first_stage(self, prepared: Prepared) -> str:
        whole = self.engine.runs_whole(prepared)
        if prepared.media is None:
            return "whole" if whole else "rows"
        # A request run whole has its vision job apart only where a media lane runs it beside the text calls.
        return "media" if not whole or MEDIA in self.lanes else "whole"

    def _queue_rows(self, ticket: _Ticket, rows: list[TextRow]) -> None:
        ticket.pending = deque(enumerate(rows))
        ticket.stage = "rows"
        ticket.ready_at = time.monotonic()

    def _on_gone(self) -> None:
        """A request was abandoned: wake the engine thread to drop its rows, and stop the call in flight when it
        served nobody else."""
        with self._cond:
            for call in self._in_flight.values():
                if all(t.gone for t in call.tickets):
                    call.options.terminate = True
            self._cond.notify_all()

    # -- the engine thread (and the media lane's) --------------------------------------------------------------
    def _loop(self, lane: str) -> None:
        # The engine warms up on its own thread before any job; the media lane runs no graph before that (a CUDA
        # graph capture fails if another thread runs one meanwhile).
        if lane == TEXT:
            try:
                self.engine.warm_up()
            except Exception:  # noqa: BLE001 - serving without the warm-up beats serving nothing
                log.exception("the engine's warm-up failed; serving without it")
            finally:
                self._warm.set()
        else:
            self._warm.wait()
        while (job := self._next_job(lane)) is not None:
            start = time.monotonic()
            job()
            with self._cond:
                self._busy_s[lane] += time.monotonic() - start
                self._jobs[lane] += 1

    def _next_job(self, lane: str) -> Callable[[], None] | None:
        with self._cond:
            while True:
                for ticket in [t for t in self._tickets if t.gone]:
                    self._finish(ticket, error=ticket.deadline.error())
                # The media lane ends once no request can need it again; the engine thread once none is left.
                if not any(self._serves(lane, t) for t in self._tickets):
                    if self._closing:
                        del self._threads[lane]
                        return None
                    self._cond.wait()
                    continue
                job, wait_s = self._pick(lane)
                if job is not None:
                    return job
                self._cond.wait(wait_s)

    def _serves(self, lane: str, ticket: _Ticket) -> bool:
        if lane == LONG:
            return ticket.stage != "whole"  # its rows, queued or to come after its media
        return lane == TEXT or ticket.stage == MEDIA

    def _long(self, row: TextRow) -> bool:
        """A row whose one call would take longer than the time slice: the long lane runs it, beside the others."""
        return LONG in self.lanes and self.cost.seconds(1, row.length) > self.engine.budget.slice_s

    def _takes(self, ticket: _Ticket, lane: str) -> int:
        """How many of the ticket's next rows the lane may take (in order): the leading rows that are not long for
        the engine thread, the next row if it is long for the long lane."""
        count = 0
        for _, row in islice(ticket.pending, self.batch_rows if lane == TEXT else 1):
            if self._long(row) != (lane == LONG):
                break
            count += 1
        return count

    def _pick(self, lane: str) -> tuple[Callable[[], None] | None, float | None]:
        """The lane's next job, or how long to wait for more rows to join a call that is not full yet."""
        job_stages = ("media",) if lane == MEDIA else ("whole",) if MEDIA in self.lanes else ("whole", "media")
        jobs = [t for t in self._tickets if t.stage in job_stages]
        first_job = min(jobs, key=_Ticket.key, default=None)
        if lane == MEDIA:
            if first_job is None:
                return None, None
            return self._job(first_job, jobs, lane), 0.0
        candidates = sorted(((t.key(i), t, i) for t in self._tickets if t.stage == "rows"
                             for i in range(self._takes(t, lane))), key=lambda c: c[0])
        if lane == LONG:
            if not candidates:
                return None, None
            ticket = candidates[0][1]
            self._virtual = max(self._virtual, ticket.key()[0])
            index, row = ticket.pending.popleft()
            ticket.taken += 1
            self._cond.notify_all()  # its next rows may be the engine thread's now
            return self._batch([(ticket, index, row)], LONG), 0.0
        if first_job is not None and (not candidates or first_job.key() <= candidates[0][0]):
            self._virtual = max(self._virtual, first_job.key()[0])
            return self._job(first_job, jobs, lane), 0.0
        if not candidates:  # every request's work is in flight
            return None, None
        call, full = self._group([(t, i) for _, t, i in candidates])
        ready = min(t.ready_at for t, _ in call)
        wait_s = ready + self.batch_wait_s - time.monotonic()
        if not full and wait_s > 0 and not self._closing:
            return None, wait_s
        taken: list[tuple[_Ticket, int, TextRow]] = []
        for ticket, _ in call:
            self._virtual = max(self._virtual, ticket.key()[0])
            index, row = ticket.pending.popleft()  # a ticket's rows are taken in order: candidates ran in order
            ticket.taken += 1
            taken.append((ticket, index, row))
        if LONG in self.lanes:
            self._cond.notify_all()  # a ticket's next row may be the long lane's now
        return self._batch(taken, TEXT), 0.0

    def _group(self, candidates: list[tuple[_Ticket, int]]) -> tuple[list[tuple[_Ticket, int]], bool]:
        """The anchor and the candidates that join it, and whether the call is full (no more rows, or the budget
        refused one)."""
        def length(candidate: tuple[_Ticket, int]) -> int:
            ticket, offset = candidate
            return ticket.pending[offset][1].length

        budget = self.engine.budget
        call = [candidates[0]]
        longest = shortest = length(candidates[0])
        next_offset = {candidates[0][0]: 1}
        full = False
        for candidate in candidates[1:]:
            if len(call) == self.batch_rows:
                break
            ticket, offset = candidate
            if next_offset.get(ticket, 0) != offset:
                continue  # an earlier row of this request stayed out: its rows go in order
            n = length(candidate)
            wide, narrow = max(longest, n), min(shortest, n)
            if narrow < FILL * wide:
                continue
            if budget is not None and not (budget.fits(len(call) + 1, wide)
                                           and budget.within_slice(len(call) + 1, wide, 0, self.cost)):
                full = True
                continue
            call.append(candidate)
            next_offset[ticket] = offset + 1
            longest, shortest = wide, narrow
        return call, full or len(call) == self.batch_rows

    def _job(self, first: _Ticket, jobs: list[_Ticket], lane: str) -> Callable[[], None]:
        """`first`'s whole run, or the vision job of `first` and the other requests waiting for theirs."""
        if first.stage == "whole":
            return self._whole_job(first, lane)
        waiting = sorted((t for t in jobs if t.stage == "media" and t is not first), key=_Ticket.key)
        return self._media_job([first, *waiting[:MEDIA_BATCH - 1]], lane)

    def _whole_job(self, ticket: _Ticket, lane: str) -> Callable[[], None]:
        """The next step of `ticket`'s whole run (a prefix chunk, a batch of its reads): between two steps the
        request waits its turn again, so other requests' calls run between the parts of a large one."""
        ticket.stage = "running"

        def run() -> None:
            ticket.options = self._start([ticket], lane, ticket.options)
            try:
                if ticket.steps is None:  # `encoded` only where the media lane ran it (engines that encode apart)
                    ticket.steps = (self.engine.run_steps(ticket.prepared, ticket.options) if ticket.encoded is None
                                    else self.engine.run_steps(ticket.prepared, ticket.options, ticket.encoded))
                next(ticket.steps)
            except StopIteration as done:
                with self._cond:
                    del self._in_flight[lane]
                    ticket.readouts = list(done.value)
                    self._finish(ticket)
                return
            except Exception as exc:  # noqa: BLE001 - the request's caller gets it (a stopped run included)
                self._fail([ticket], lane, exc)
                return
            with self._cond:
                del self._in_flight[lane]
                ticket.stage = "whole"
                ticket.taken += 1  # its next step waits behind the rows and steps now before it in the order
                self._cond.notify_all()
        return run

    def _media_job(self, tickets: list[_Ticket], lane: str) -> Callable[[], None]:
        """The vision graphs of several requests in one job (their crops sharing runs where the engine can);
        then each request's rows queue, or its whole run waits its turn in the engine thread."""
        for ticket in tickets:
            ticket.stage = "running"

        def run() -> None:
            options = self._start(tickets, lane)
            failed: dict[_Ticket, DeviceMemoryExhausted] = {}
            try:
                try:
                    encoded = self.engine.encode_media_many([t.prepared for t in tickets], options)
                except DeviceMemoryExhausted:
                    if len(tickets) == 1:
                        raise
                    encoded = self._encode_apart(tickets, options, failed)
                # Each request's next step: its whole run on its vision rows, or its rows.
                steps = [(ticket, out, None if self.engine.runs_whole(ticket.prepared)
                          else self.engine.rows(ticket.prepared, out))
                         for ticket, out in zip(tickets, encoded, strict=True) if ticket not in failed]
            except Exception as exc:  # noqa: BLE001 - every request in the job gets it (a stopped run included)
                self._fail(tickets, lane, exc)
                return
            with self._cond:
                del self._in_flight[lane]
                for ticket, exc in failed.items():
                    self._finish(ticket, error=exc)
                for ticket, out, rows in steps:
                    if rows is not None:
                        self._queue_rows(ticket, rows)
                    else:
                        ticket.encoded, ticket.stage = out, "whole"
                self._cond.notify_all()  # the engine thread may be waiting with nothing else to do
        return run

    def _encode_apart(self, tickets: list[_Ticket], options: Any,
                      failed: dict[_Ticket, DeviceMemoryExhausted]) -> list[Any]:
        """The device memory (--gpu-memory) could not hold the job at once: each request's media again alone; a
        request whose media it cannot hold alone goes into `failed` (its 503) with None for its encoding."""
        encoded: list[Any] = []
        for ticket in tickets:
            try:
                encoded += self.engine.encode_media_many([ticket.prepared], options)
            except DeviceMemoryExhausted as exc:
                failed[ticket] = exc
                encoded.append(None)
        return encoded

    def _batch(self, taken: list[tuple[_Ticket, int, TextRow]], lane: str) -> Callable[[], None]:
        def run() -> None:
            tickets = list(dict.fromkeys(t for t, _, _ in taken))
            options = self._start(tickets, lane)
            try:
                readouts = run_in_halves(lambda rows: self.engine.run_rows(list(rows), options),
                                         [row for _, _, row in taken])
            except Exception as exc:  # noqa: BLE001 - every request in the call gets it
                self._fail(tickets, lane, exc)
                return
            with self._cond:
                del self._in_flight[lane]
                for (ticket, index, _), readout in zip(taken, readouts, strict=True):
                    if isinstance(readout, DeviceMemoryExhausted):
                        if ticket in self._tickets:
                            self._finish(ticket, error=readout)
                    else:
                        ticket.readouts[index] = readout
                for ticket in tickets:
                    if ticket in self._tickets and not ticket.pending and all(r is not None for r in ticket.readouts):
                        self._finish(ticket)
        return run

    def _fail(self, tickets: list[_Ticket], lane: str, error: BaseException) -> None:
        """The lane's job failed or was stopped: every request in it gets the error."""
        with self._cond:
            del self._in_flight[lane]
            for ticket in tickets:
                self._finish(ticket, error=error)

    def _start(self, tickets: list[_Ticket], lane: str, options: Any = None) -> Any:
        options = options if options is not None else ort.RunOptions()
        with self._cond:
            self._in_flight[lane] = _Call(tickets, options)
        return options

    def _finish(self, ticket: _Ticket, error: BaseException | None = None) -> None:
        """Answer (or fail) a request and forget it; its caller may have gone already."""
        if ticket in self._tickets:
            self._tickets.remove(ticket)
        if ticket.gone:  # whatever stopped its work, the request was abandoned first
            error = ticket.deadline.error()
        try:
            if error is not None:
                ticket.future.set_exception(error)
            else:
                ticket.future.set_result([r for r in ticket.readouts if r is not None])
        except InvalidStateError:  # the caller cancelled the future
            pass
        self._cond.notify_all()  # a lane waiting for work may now have none left to wait for (closing)
