"""How many rows one text-graph call takes on this device, chosen from a measurement at start-up.

Batching pays where the device has parallel work to spare (a GPU) and costs where it has not (the tiny d3 graph on
two CPU cores: one question alone took 7.8 ms, 16.2 ms a question in a batch of 16). So the scheduler does not
guess: the text graph is timed at 1, 2, 4, ... rows of a typical length, and the largest batch whose time a
question is within timing noise of the best one is kept. Where the time a question is flat, the larger batch wins
though it gains no questions/s: fewer calls, each with its fixed part (on two CPU cores, 64 clients got 279-289
requests/s with calls of 32 rows, 257-266 with 8; `scripts/results/batch_rows_rule_cpu_d3_tiny.txt`).
Where the text graph's calls are captured as CUDA graphs, no batch larger than the largest captured one is tried:
start-up times every size before the capture, uncaptured, and past the captured sizes that timing proved no guide.
On the H200 (d3-nano, text-only requests from 64 clients, the twenty-second run) it timed 1.16-1.17 ms a question at
64 rows and 1.18-1.19 at 32; served, calls of up to 64 rows got a p99 of 124-139 ms and 723-832 requests/s, calls of
32 (captured) 81-112 ms and 819-839 requests/s, in four alternating runs each. With 64 the text lane stood idle 4-16%
of the time (1-2% with 32): a call that takes every waiting row leaves the next one few ready.
The same timings give the call's cost model (a fixed part, a part per padded token, and a floor: the fastest call), by
which an engine groups one request's rows of different lengths into calls (`BatchBudget.plan`).
Under a bounded arena (--gpu-memory) the measurement stops at the largest batch the arena holds.

The sizes are timed in interleaved rounds (1, 2, 4, ... then again), each size's fastest run counting: a burst of
other work on a shared host slows a few runs of every size, not all the runs of one. Under steady contention, where
the time a question is flat, the choice still varies from one measurement to the next, so `serve` keeps the first
start's choice for the artifact on the machine (systemone/batch_rows.py, docs/decisions/batch-rows.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..models.errors import DeviceMemoryExhausted
from .batch import CallCost
from .engine import Engine

TYPICAL_LENGTH = 128  # tokens a row while timing: about a short state and one question
MOST_ROWS = 64
# A batch is kept while its time a question is at most this much over the best measured: timing noise on a shared
# machine is a few %.
NOISE = 1.05
ROUNDS = 5  # timed runs a batch size, one a round (the fastest counts), after one untimed run of the new shape
MIN_ROUNDS = 2  # even where the time limit has passed
TIME_LIMIT_S = 5.0  # no larger batch is tried past half of this, and no further round past it
REPEATS = 3  # timed runs of the long row (the fastest counts), after one untimed run
LONG_LENGTH = 1024  # tokens of the one long row timed for the cost of attention's token pairs


class TooLittleDeviceMemory(RuntimeError):
    """The bounded arena (--gpu-memory) cannot hold one typical question: the server would answer nothing."""


@dataclass(frozen=True)
class BatchSizing:
    rows: int
    length: int = TYPICAL_LENGTH
    seconds: dict[int, float] = field(default_factory=dict)  # one call's fastest time at each batch size tried
    long: tuple[int, float] | None = None  # one row of a long prompt: its length and fastest time

    @property
    def cost(self) -> CallCost | None:
        """The call's cost model fitted to the timings (None with fewer than two batch sizes timed), its part per
        token pair from the long row's time over what its tokens alone explain."""
        cost = fit_call_cost({batch * self.length: s for batch, s in self.seconds.items()})
        if cost is None or self.long is None:
            return cost
        length, seconds = self.long
        return replace(cost, pair_s=max(0.0, (seconds - cost.fixed_s - cost.token_s * length) / length**2))

    def to_dict(self) -> dict[str, object]:
        return {"rows": self.rows, "length": self.length, "seconds": {str(b): s for b, s in self.seconds.items()},
                "long": list(self.long) if self.long is not None else None}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BatchSizing:
        long = raw.get("long")
        return cls(int(raw["rows"]), int(raw["length"]), {int(b): float(s) for b, s in raw["seconds"].items()},
                   (int(long[0]), float(long[1])) if long else None)

    def describe(self) -> str:
        if not self.seconds:
            return f"{self.rows} (set by flag, or the engine runs each request whole)"
        tried = ", ".join(f"{b}: {s * 1000 / b:.2f}" for b, s in self.seconds.items())
        cost = self.cost
        model = f"; a call costs {cost.describe()}" if cost is not None else ""
        return f"{self.rows} (measured at {self.length} tokens, ms a question by rows a call: {tried}{model})"


def fit_call_cost(seconds_by_tokens: dict[int, float]) -> CallCost | None:
    """A call's cost model fitted to (padded tokens, seconds): the fixed and per-token parts by least squares on the
    relative error, so the smallest call weighs as much as the largest, neither part negative. Where a larger call
    was the fastest (a GPU's launch-bound small calls: their time falls, then rises), that call's time is the
    floor, and the two parts are fitted to the calls from it on, where the time rises with the tokens."""
    if len(seconds_by_tokens) < 2:
        return None
    points = sorted(seconds_by_tokens.items())
    fastest = min(range(len(points)), key=lambda i: points[i][1])
    falls_first = 0 < fastest < len(points) - 1
    rising = points[fastest:] if falls_first else points
    x = np.array([tokens for tokens, _ in rising], dtype=np.float64)
    t = np.array([seconds for _, seconds in rising], dtype=np.float64)
    w = 1.0 / t**2
    sw, sx, st = w.sum(), (w * x).sum(), (w * t).sum()
    sxx, sxt = (w * x * x).sum(), (w * x * t).sum()
    token_s = max(0.0, (sw * sxt - sx * st) / (sw * sxx - sx * sx))
    return CallCost(fixed_s=max(0.0, (st - token_s * sx) / sw), token_s=token_s,
                    floor_s=points[fastest][1] if falls_first else 0.0)


def measure_batch_rows(engine: Engine, length: int = TYPICAL_LENGTH, most: int = MOST_ROWS,
                       time_limit_s: float = TIME_LIMIT_S, rounds: int = ROUNDS) -> BatchSizing:
    """The most rows a call whose time a question on `engine`'s device is within NOISE of the best of the smaller
    batches (1 for engines that run each request whole), at most as many as its arena (--gpu-memory) holds and,
    where its calls are captured, as its largest captured call; `TooLittleDeviceMemory` if it holds not even one.
    Each size is run once untimed (its allocations), then timed once a round over `rounds` interleaved rounds."""
    if not engine.shares_batches or engine.budget is None:
        return BatchSizing(1)
    most = min(most, engine.captured_rows or most)
    length = min(length, engine.max_model_len)
    started = time.perf_counter()
    probes: dict[int, list[Any]] = {}
    batch = 1
    while batch <= most and engine.budget.fits(batch, length):
        rows = [engine.probe_row(length)] * batch
        try:
            engine.run_rows(rows)  # a shape's first run pays for its allocations
        except DeviceMemoryExhausted as exc:
            if batch == 1:
                raise TooLittleDeviceMemory(
                    f"the device memory each graph may use (--gpu-memory) cannot hold one question of {length} "
                    "tokens in the text graph; give it more") from exc
            break  # a call of more rows than the arena holds would be split at every use
        probes[batch] = rows
        if time.perf_counter() - started > time_limit_s / 2:
            break
        batch *= 2
    fastest: dict[int, float] = {}
    for round_ in range(rounds):
        for batch, rows in probes.items():
            start = time.perf_counter()
            engine.run_rows(rows)
            seconds = time.perf_counter() - start
            fastest[batch] = min(fastest.get(batch, seconds), seconds)
        if round_ + 1 >= MIN_ROUNDS and time.perf_counter() - started > time_limit_s:
            break
    best, seconds_kept = 1, {}
    for batch, seconds in fastest.items():  # in size order
        seconds_kept[batch] = seconds
        if seconds / batch > NOISE * min(s / b for b, s in seconds_kept.items()):
            break  # slower a question than noise explains: larger batches would only be slower still
        best = batch
    return BatchSizing(best, length, seconds_kept, _long_row(engine, length))


def _long_row(engine: Engine, short: int) -> tuple[int, float] | None:
    """One row of LONG_LENGTH tokens (or the longest the engine and its budget take) timed, for the part of a
    call's time that grows with its tokens' pairs; None where it is no longer than the rows timed already."""
    length = min(LONG_LENGTH, engine.max_model_len, engine.budget.max_batch_tokens)
    while length > short and not engine.budget.fits(1, length):
        length //= 2
    if length <= 2 * short:
        return None
    row = [engine.probe_row(length)]
    try:
        engine.run_rows(row)
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            engine.run_rows(row)
            times.append(time.perf_counter() - start)
    except DeviceMemoryExhausted:
        return None
    return length, min(times)
