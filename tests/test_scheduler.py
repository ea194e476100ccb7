"""The scheduler (docs/operations.md, docs/architecture.md): questions of concurrent requests share padded
text-graph calls in one engine thread; a question's answer does not depend on its batch mates; a big request does
not starve small ones; an abandoned request's rows are dropped while its batch mates are answered; a call in flight
is stopped only when nobody in it is waiting; closing lets every submitted request finish."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from systemone.models.errors import TimedOut, Unavailable
from systemone.models.family import Readout
from systemone.runtime.artifact import Artifact
from systemone.runtime.batch import BatchBudget, CallCost, TextRow
from systemone.runtime.deadline import Deadline
from systemone.runtime.engine import Engine, EngineOptions, Prepared
from systemone.runtime.scheduler import Scheduler
from systemone.runtime.service import DecisionService
from systemone.server.app import ServerOptions
from tests.live_server import live_server
from tests.media_helpers import data_url, gradient_png

NOUL = {"type": "noul", "instructions": "Is it urgent?"}
CHOICE = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "support": None}}
SCORE = {"type": "score", "criteria": ["calm", "annoyed", "furious"]}


def body(state: str, count: int, **extra) -> dict:
    kinds = (NOUL, CHOICE, SCORE)
    return {"state": state, "questions": {f"q{i}": kinds[i % 3] for i in range(count)}, **extra}


class Recording:
    """The real engine, recording how many rows each text-graph call took."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self.calls: list[int] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run_rows(self, rows, run_options=None):
        self.calls.append(len(rows))
        return self._engine.run_rows(rows, run_options)


def probabilities(answer: dict) -> dict[tuple[str, str], float]:
    return {(q, k): p for q, a in answer["answers"].items() for k, p in a["probabilities"].items()}


@pytest.mark.parametrize("form, bound, media_lane", [("portable", 1e-5, False), ("portable", 1e-5, True),
                                                     ("cuda-fused-fp16", 2e-3, False)])
def test_an_answer_does_not_depend_on_its_batch_mates(d3_service, d3_artifact, form, bound, media_lane):
    """The same questions answered one request at a time, and submitted together so that they share calls with
    other requests' questions of other lengths and with an image request's rows: probabilities within 1e-5 on the
    fp32 graphs, within 2e-3 on the half-precision form (run here on the CPU); with the vision graph in its own
    lane or in the engine thread."""
    if form != d3_service.form:
        d3_service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu", form=form))
    bodies = [body("short", 2), body("a much longer state, " * 12, 3),
              body("with a picture", 2, images=[data_url(gradient_png(96, 80))]), body("mid " * 20, 1),
              body("x", 3)]
    prepared = [d3_service.prepare(b) for b in bodies]
    alone = [d3_service.answer(p) for p in prepared]
    engine = Recording(d3_service.engine)
    scheduler = Scheduler(engine, batch_rows=16, batch_wait_s=0.3, media_lane=media_lane)
    futures = [scheduler.submit(p, Deadline()) for p in prepared]
    together = [d3_service.respond(p, f.result(timeout=60)) for p, f in zip(prepared, futures)]
    scheduler.close()
    assert max(engine.calls) >= 4, engine.calls  # requests really shared calls, the image request's rows included
    for one, shared in zip(alone, together):
        want, got = probabilities(one), probabilities(shared)
        assert want.keys() == got.keys()
        assert max(abs(want[k] - got[k]) for k in want) <= bound


def d1_runs_as_alone(service: DecisionService, bodies: list[dict], cost: CallCost, whole: list[bool]) -> list[int]:
    """`bodies` prepared and run alone, then submitted together to a scheduler, with the engine's call cost set to
    `cost` (the shared service's own is whatever an earlier test measured, and is restored): which run whole must be
    `whole`, and every answer the one its request gets alone (within 1e-5). The rows of each text call."""
    engine = Recording(service.engine)
    prepared = [service.prepare(b) for b in bodies]
    measured = service.engine.runner.cost
    try:
        service.engine.use_call_cost(cost)
        assert [engine.runs_whole(p) for p in prepared] == whole
        alone = [service.answer(p) for p in prepared]
        scheduler = Scheduler(engine, batch_rows=8, batch_wait_s=0.3)
        futures = [scheduler.submit(p, Deadline()) for p in prepared]
        together = [service.respond(p, f.result(timeout=120)) for p, f in zip(prepared, futures, strict=True)]
        scheduler.close()
    finally:
        service.engine.use_call_cost(measured)
    for one, shared in zip(alone, together, strict=True):
        want, got = probabilities(one), probabilities(shared)
        assert want.keys() == got.keys() and max(abs(want[k] - got[k]) for k in want) <= 1e-5
    return engine.calls


def test_d1_shares_calls_among_one_question_text_requests_and_runs_the_others_whole(d1_service):
    """d1's one-question requests are one row each (the whole prompt, an image's rows in it) and share calls across
    requests, each reading its own labels; a request with several questions on a state worth prefilling once runs
    whole, its prefix prefilled once. Every answer is the one the request gets alone."""
    bodies = [body(state, 1) if i % 3 else {"state": state, "questions": {"team": CHOICE}}
              for i, state in enumerate(["Charged twice", "Refund not received after two weeks", "Cannot log in",
                                         "Parcel lost in transit, please help", "Wrong size", "Double charge again"])]
    bodies += [body("A long thread about a charge. " * 10, 3),
               body("See the photo", 1, images=[data_url(gradient_png(64, 48))])]
    # Calls that cost little beyond their tokens: a shared prefix is always worth prefilling once.
    calls = d1_runs_as_alone(d1_service, bodies, CallCost(fixed_s=1e-9, token_s=1e-6), [False] * 6 + [True, False])
    assert sum(calls) == 7 and max(calls) >= 3, calls  # the one-question requests shared


def test_d1_reads_short_questions_as_rows_where_a_call_costs_more_than_their_shared_prefix(d1_service):
    """Where a call's fixed part outweighs the prefix tokens a prefill would save (a GPU's launch-bound calls: d1-3B
    on an H200 measured 6.8 ms a call and 12.4 us a token), a d1 request of a few short questions is one row a
    question, its whole prompt, in calls shared with other requests; one whose long state is worth prefilling once
    still runs whole. Every answer is the one the request gets alone, its prefix prefilled once (within 1e-5)."""
    bodies = [body("Charged twice", 3), body("Refund not received", 2), body("Cannot log in", 1),
              body("A long thread about a charge. " * 60, 3)]
    calls = d1_runs_as_alone(d1_service, bodies, CallCost(fixed_s=6.8e-3, token_s=12.4e-6),
                             [False, False, False, True])
    assert sum(calls) == 6 and max(calls) >= 3, calls  # the short requests' questions shared


def test_a_prefill_is_weighed_at_what_a_call_costs_however_the_cost_is_modelled(d1_service):
    """Whether a d1 request's prefix is prefilled once weighs the tokens it saves against the call it adds: the
    call's fixed part or, where the model has one (a GPU's launch-bound calls), its floor."""
    bodies = (body("Charged twice", 3), body("A long thread about a charge. " * 60, 3))
    prepared = [d1_service.prepare(b) for b in bodies]
    measured = d1_service.engine.runner.cost
    try:
        for cost in (CallCost(fixed_s=6.8e-3, token_s=12.4e-6),
                     CallCost(fixed_s=1e-9, token_s=12.4e-6, floor_s=6.8e-3)):
            d1_service.engine.use_call_cost(cost)
            assert [d1_service.engine.runs_whole(p) for p in prepared] == [False, True]
    finally:
        d1_service.engine.use_call_cost(measured)


class SlowVision(Recording):
    """The real engine, its vision graph taking a second longer."""

    def encode_media(self, prepared, run_options=None):
        time.sleep(1.0)
        return self._engine.encode_media(prepared, run_options)

    def encode_media_many(self, prepared, run_options=None):  # the scheduler's vision job
        time.sleep(1.0)
        return self._engine.encode_media_many(prepared, run_options)

    def run_steps(self, prepared, run_options=None, encoded=None):
        # A request run whole without the media lane encodes its media inside its run: through the slow graph too.
        return self._engine.run_steps(prepared, run_options, encoded if encoded is not None
                                      else self.encode_media(prepared, run_options))


@pytest.mark.parametrize("family", ["d3", "d1"])
@pytest.mark.parametrize("media_lane", [False, True])
def test_in_a_media_lane_a_vision_run_holds_back_no_text_request(family, media_lane, request):
    """A text request arriving while an image request's vision graph runs: in the engine thread it waits for the
    vision run; with the media lane its call runs beside it, and the image request's rows (d3), or its whole run
    on the encoded image (d1, its prefix prefilled once), follow when ready, answering as it does alone."""
    service = request.getfixturevalue(f"{family}_service")
    scheduler = Scheduler(SlowVision(service.engine), batch_rows=4, batch_wait_s=0.0, media_lane=media_lane)
    image = service.prepare(body("with a picture", 2, images=[data_url(gradient_png(96, 80))]))
    text = service.prepare(body("short", 1))
    image_future = scheduler.submit(image, Deadline())
    time.sleep(0.2)  # its vision run has begun
    start = time.monotonic()
    assert len(scheduler.submit(text, Deadline()).result(timeout=60)) == 1
    waited = time.monotonic() - start
    if media_lane:
        assert waited < 0.5 and not image_future.done(), waited  # answered while the vision graph still ran
    else:
        assert waited >= 0.7, waited
    alone = probabilities(service.answer(image))
    shared = probabilities(service.respond(image, image_future.result(timeout=60)))
    assert alone.keys() == shared.keys() and max(abs(alone[k] - shared[k]) for k in alone) <= 1e-5
    scheduler.close(timeout=30)
    assert scheduler.waiting == 0


class CountingVision(SlowVision):
    """The real engine, its vision jobs taking a second longer and counted by the requests each one encoded."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.jobs: list[int] = []

    def encode_media_many(self, prepared, run_options=None):
        self.jobs.append(len(prepared))
        return super().encode_media_many(prepared, run_options)


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_image_requests_waiting_together_share_one_vision_job_and_answer_as_alone(family, request):
    """While one image request's vision graph runs, three more arrive: the next vision job takes all three (d1's
    crops of one grid share the graph's runs), and each answers as it does alone."""
    service = request.getfixturevalue(f"{family}_service")
    engine = CountingVision(service.engine)
    scheduler = Scheduler(engine, batch_rows=4, batch_wait_s=0.0, media_lane=True)
    sizes = [(96, 80), (64, 48), (96, 80), (40, 72)]
    prepared = [service.prepare(body(f"photo {i}", 1 + i % 2, images=[data_url(gradient_png(w, h))]))
                for i, (w, h) in enumerate(sizes)]
    futures = [scheduler.submit(prepared[0], Deadline())]
    time.sleep(0.2)  # the first vision job has begun
    futures += [scheduler.submit(p, Deadline()) for p in prepared[1:]]
    for one, future in zip(prepared, futures, strict=True):
        alone, shared = probabilities(service.answer(one)), probabilities(service.respond(one, future.result(60)))
        assert alone.keys() == shared.keys() and max(abs(alone[k] - shared[k]) for k in alone) <= 1e-5
    assert engine.jobs == [1, 3]
    scheduler.close(timeout=30)


def test_d1_crops_of_several_images_share_vision_runs_with_the_same_rows(d1_service):
    """Two images of one size (different pixels) and a third of another: crops of one grid run together, so fewer
    vision runs than image by image; each crop attends only to its own patches, so its rows are those it gets
    alone."""
    encoder = d1_service.engine.media
    pngs = [gradient_png(96, 80, seed=1), gradient_png(96, 80, seed=2), gradient_png(40, 72)]
    images = [d1_service.prepare(body("x", 1, images=[data_url(png)])).media.in_order()[0] for png in pngs]
    assert images[0].crops[0].grid == images[1].crops[0].grid != images[2].crops[0].grid
    runs = []
    real_run = encoder.session.run

    def counting_run(feeds, run_options=None):
        runs.append(feeds["patches"].shape[0])
        return real_run(feeds, run_options)

    encoder.session.run = counting_run
    try:
        alone = [encoder.rows(image, None) for image in images]
        runs_alone, runs[:] = len(runs), []
        together = encoder.rows_many(images, None)
    finally:
        del encoder.session.run
    assert len(runs) == runs_alone - 1 and sum(runs) == sum(len(image.crops) for image in images)
    for one, shared in zip(alone, together, strict=True):
        assert one.shape == shared.shape and abs(one - shared).max() <= 1e-5


def test_concurrent_http_requests_share_graph_calls(d3_service):
    """16 clients at once, one question each, at most 8 rows a call: fewer text-graph calls than questions, and
    every answer equals the one-at-a-time answer."""
    bodies = [body(f"ticket {i}: " + "late parcel " * (i % 4), 1) for i in range(16)]
    alone = [d3_service.decide(b) for b in bodies]
    with live_server(d3_service, ServerOptions(max_batch_rows=8, batch_wait_ms=50)) as url:
        before = d3_service.engine.session.runs

        async def clients():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/systemone", json=b) for b in bodies))

        responses = asyncio.run(clients())
        calls = d3_service.engine.session.runs - before
    assert [r.status_code for r in responses] == [200] * 16
    assert calls < 16, calls
    for one, response in zip(alone, responses):
        want, got = probabilities(one), probabilities(response.json())
        assert max(abs(want[k] - got[k]) for k in want) <= 1e-5


def test_a_big_request_does_not_starve_a_small_one(d3_service):
    """A 64-question request, then a one-question request: with 2 rows a call, the small one is answered while
    the big one still has most of its questions to run (first in first out would answer it after all 32 calls)."""
    engine = Recording(d3_service.engine)
    scheduler = Scheduler(engine, batch_rows=2, batch_wait_s=0.0)
    big = d3_service.prepare(body("the same state", 64))
    small = d3_service.prepare(body("the same state", 1))
    done: list[str] = []
    big_future = scheduler.submit(big, Deadline())
    big_future.add_done_callback(lambda _: done.append("big"))
    small_future = scheduler.submit(small, Deadline())
    small_future.add_done_callback(lambda _: done.append(f"small after {len(engine.calls)} calls"))
    assert len(small_future.result(timeout=60)) == 1 and len(big_future.result(timeout=60)) == 64
    scheduler.close()
    assert done[0].startswith("small") and int(done[0].split()[2]) <= 2, done
    assert done[1] == "big" and sum(engine.calls) == 65 and max(engine.calls) == 2


def test_an_abandoned_requests_rows_are_dropped_and_its_batch_mates_answered(d3_service):
    engine = Recording(d3_service.engine)
    scheduler = Scheduler(engine, batch_rows=16, batch_wait_s=0.3)
    gone, stays = Deadline(), Deadline()
    leaving = scheduler.submit(d3_service.prepare(body("leaving", 3)), gone)
    staying_request = d3_service.prepare(body("staying", 2))
    staying = scheduler.submit(staying_request, stays)
    gone.cancel()  # its client left while its rows waited for the call to fill
    expired = scheduler.submit(d3_service.prepare(body("too late", 4)), Deadline(0.0))
    readouts = staying.result(timeout=60)
    scheduler.close()
    with pytest.raises(TimedOut):
        leaving.result(timeout=1)
    with pytest.raises(TimedOut):
        expired.result(timeout=1)
    assert sum(engine.calls) == 2  # only the staying request's rows ran
    assert probabilities(d3_service.respond(staying_request, readouts)) == pytest.approx(
        probabilities(d3_service.answer(staying_request)), abs=1e-5)


# -- the mechanics, on an engine whose calls the test controls ---------------------------------------------------
class HeldEngine(Engine):
    """Rows of one token a question; each call waits until the test releases it or the call is stopped."""

    shares_batches = True
    budget = BatchBudget()

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.stopped: list[bool] = []

    def prepare(self, request, questions, media=None, draft=None):
        raise NotImplementedError

    def run(self, prepared, run_options=None):
        raise NotImplementedError

    def rows(self, prepared, encoded):
        return [TextRow([1]) for _ in prepared.questions]

    def run_rows(self, rows, run_options=None):
        self.entered.release()
        while not self.release.wait(0.01):
            if run_options.terminate:
                self.stopped.append(True)
                raise RuntimeError("Exiting due to terminate flag being set to true.")
        self.stopped.append(False)
        return [Readout({0: 1.0}) for _ in rows]


def held(count: int) -> Prepared:
    return Prepared(None, list(range(count)), [], [])


def test_a_call_in_flight_stops_only_when_every_request_in_it_is_gone():
    engine = HeldEngine()
    scheduler = Scheduler(engine, batch_rows=4, batch_wait_s=0.2)
    a, b = Deadline(), Deadline()
    fa, fb = scheduler.submit(held(1), a), scheduler.submit(held(1), b)
    assert engine.entered.acquire(timeout=10)  # both rows are in one call now
    a.cancel()
    time.sleep(0.1)
    assert engine.stopped == []  # b still waits for its answer: the call goes on
    engine.release.set()
    assert len(fb.result(timeout=10)) == 1
    with pytest.raises(TimedOut):
        fa.result(timeout=1)

    engine.release.clear()
    alone = Deadline()
    fc = scheduler.submit(held(2), alone)
    assert engine.entered.acquire(timeout=10)
    alone.cancel()  # nobody in the call waits any more: it is stopped
    with pytest.raises(TimedOut):
        fc.result(timeout=10)
    assert engine.stopped == [False, True]
    engine.release.set()
    scheduler.close()


class HeldVision(HeldEngine):
    """Its vision graph, too, waits until the test releases it or the run is stopped."""

    encodes_media_apart = True

    def encode_media(self, prepared, run_options=None):
        return self.run_rows([], run_options)


def test_in_the_media_lane_an_abandoned_requests_vision_run_is_stopped_and_close_waits_for_both_lanes():
    engine = HeldVision()
    scheduler = Scheduler(engine, batch_rows=4, batch_wait_s=0.0, media_lane=True)
    leaving = Deadline()
    gone = scheduler.submit(Prepared(None, [0], [], [], media="an image"), leaving)
    assert engine.entered.acquire(timeout=10)  # its vision run, in the media lane
    text = scheduler.submit(held(1), Deadline())
    assert engine.entered.acquire(timeout=10)  # a text call beside it, in the engine thread
    leaving.cancel()
    with pytest.raises(TimedOut):
        gone.result(timeout=10)
    assert engine.stopped == [True]  # the vision run stopped; the text call goes on
    staying = scheduler.submit(Prepared(None, [0, 1], [], [], media="another image"), Deadline())
    closing = threading.Thread(target=scheduler.close)
    closing.start()
    time.sleep(0.1)
    assert closing.is_alive()  # both lanes hold work
    engine.release.set()
    closing.join(timeout=10)
    assert not closing.is_alive()
    assert len(text.result(timeout=0)) == 1 and len(staying.result(timeout=0)) == 2


def test_close_lets_submitted_requests_finish_and_refuses_new_ones():
    engine = HeldEngine()
    scheduler = Scheduler(engine, batch_rows=2, batch_wait_s=0.0)
    futures = [scheduler.submit(held(3), Deadline()) for _ in range(4)]
    assert engine.entered.acquire(timeout=10)
    closing = threading.Thread(target=scheduler.close)
    closing.start()
    time.sleep(0.1)
    with pytest.raises(Unavailable, match="shutting down"):
        scheduler.submit(held(1), Deadline())
    assert closing.is_alive()  # it waits for the requests in flight and queued
    engine.release.set()
    closing.join(timeout=10)
    assert not closing.is_alive()
    assert [len(f.result(timeout=0)) for f in futures] == [3, 3, 3, 3]
    assert sum(1 for s in engine.stopped if not s) == 6  # 12 rows, 2 a call


def test_unanswered_rows_keep_their_question_order():
    """Rows of one request split over several calls come back in question order."""
    class Echo(HeldEngine):
        def rows(self, prepared, encoded):
            return [TextRow([q] * (1 + q % 3)) for q in prepared.questions]

        def run_rows(self, rows, run_options=None):
            return [Readout({0: float(r.token_ids[0])}) for r in rows]

    scheduler = Scheduler(Echo(), batch_rows=3, batch_wait_s=0.0)
    readouts = scheduler.submit(held(10), Deadline()).result(timeout=10)
    scheduler.close()
    assert [r.scores[0] for r in readouts] == list(map(float, range(10)))


class WarmingVision(HeldVision):
    """Its warm-up (where d3 captures CUDA graphs) waits until the test releases it; every graph run records the
    thread it ran on."""

    def __init__(self):
        super().__init__()
        self.warming = threading.Event()
        self.warm_release = threading.Event()
        self.warm_thread: int | None = None
        self.ran: list[tuple[str, bool]] = []  # (what, whether the warm-up was over)

    def warm_up(self):
        self.warm_thread = threading.get_ident()
        self.warming.set()
        assert self.warm_release.wait(10)

    def encode_media(self, prepared, run_options=None):
        self.ran.append(("vision", self.warm_release.is_set()))
        return None

    def run_rows(self, rows, run_options=None):
        self.ran.append(("text on the warm-up thread", threading.get_ident() == self.warm_thread))
        return [Readout({0: 1.0}) for _ in rows]


def test_the_engine_warms_up_on_its_own_thread_before_any_graph_runs_in_either_lane():
    """onnxruntime keeps a CUDA graph in the thread that captured it, and a capture fails while another thread runs
    a graph (runtime/cuda_graphs.py): so the engine thread warms up first, and the media lane waits for it."""
    engine = WarmingVision()
    scheduler = Scheduler(engine, batch_rows=4, batch_wait_s=0.0, media_lane=True)
    starting = threading.Thread(target=scheduler.start)
    starting.start()
    assert engine.warming.wait(10)
    image = scheduler.submit(Prepared(None, [0], [], [], media="an image"), Deadline())
    text = scheduler.submit(held(1), Deadline())
    time.sleep(0.2)
    assert engine.ran == [] and starting.is_alive()  # nothing runs, and start() waits, until the warm-up is over
    engine.warm_release.set()
    starting.join(timeout=10)
    assert len(image.result(timeout=10)) == 1 and len(text.result(timeout=10)) == 1
    assert ("vision", True) in engine.ran and all(done for _, done in engine.ran)
    scheduler.close()


def test_a_warm_up_that_fails_is_logged_and_the_engine_serves_without_it(caplog):
    class FailingWarmUp(HeldEngine):
        def warm_up(self):
            raise RuntimeError("no capture today")

    engine = FailingWarmUp()
    engine.release.set()
    scheduler = Scheduler(engine, batch_rows=2, batch_wait_s=0.0)
    scheduler.start()
    assert len(scheduler.submit(held(2), Deadline()).result(timeout=10)) == 2
    assert "warm-up failed" in caplog.text and "no capture today" in caplog.text
    scheduler.close()


# -- a large request shares the engine (issue 50 item 4) ----------------------------------------------------------
class Sized(HeldEngine):
    """Rows of 30 tokens a question, answered at once."""

    budget = BatchBudget(slice_s=0.1)

    def __init__(self):
        super().__init__()
        self.calls: list[int] = []

    def rows(self, prepared, encoded):
        return [TextRow([1] * 30) for _ in prepared.questions]

    def run_rows(self, rows, run_options=None):
        self.calls.append(len(rows))
        return [Readout({0: 1.0}) for _ in rows]


def test_a_call_of_several_rows_stays_within_the_time_slice():
    """By the measured cost (1 ms a token here), a call of 30-token rows takes 30 ms a row: within a 0.1 s slice,
    3 rows a call at most, though 16 would fit the budget, so another request's row waits for one short call."""
    engine = Sized()
    scheduler = Scheduler(engine, batch_rows=16, batch_wait_s=0.0, cost=CallCost(fixed_s=0.0, token_s=1e-3))
    assert len(scheduler.submit(held(12), Deadline()).result(timeout=30)) == 12
    scheduler.close()
    assert sum(engine.calls) == 12 and max(engine.calls) == 3, engine.calls


def test_a_request_run_whole_lets_others_run_between_its_steps(d1_service):
    """A d1 request of 8 questions on a long state runs whole (its prefix prefilled once, then its reads); a
    one-question request sent just after it is answered between its steps, not after the whole run."""
    scheduler = Scheduler(d1_service.engine, batch_rows=4, batch_wait_s=0.0)
    big = d1_service.prepare(body("A long thread about a charge. " * 300, 8))
    small = d1_service.prepare(body("Cannot log in", 1))
    assert d1_service.engine.runs_whole(big) and not d1_service.engine.runs_whole(small)
    done: list[str] = []
    big_future = scheduler.submit(big, Deadline())
    big_future.add_done_callback(lambda _: done.append("big"))
    small_future = scheduler.submit(small, Deadline())
    small_future.add_done_callback(lambda _: done.append("small"))
    assert len(small_future.result(timeout=60)) == 1 and len(big_future.result(timeout=60)) == 8
    scheduler.close()
    assert done == ["small", "big"]


def test_a_request_that_cannot_finish_in_time_is_refused_at_once(d1_service, monkeypatch):
    """Issue 50 item 4: a d1 state of 127,600 tokens could never be read within 60 s on two cores, yet ran until
    its deadline and held the engine. By the call cost measured at start-up (here set to this machine's: 10 ms a
    call, 30 us a token, 0.1 us a token pair), a state of about 30,000 tokens needs some 45 s: with 5 s left it is
    a 413 at once, naming the limit."""
    monkeypatch.setattr(d1_service.engine, "call_cost", CallCost(fixed_s=0.01, token_s=30e-6, pair_s=1e-7),
                        raising=False)
    with live_server(d1_service, ServerOptions(request_timeout_s=5)) as base:
        start = time.monotonic()
        response = httpx.post(base + "/v1/systemone", json=body("word " * 30_000, 1), timeout=30)
        seconds = time.monotonic() - start
    assert response.status_code == 413 and "--request-timeout" in response.json()["error"]["message"], response.text
    assert seconds < 3, seconds


@pytest.mark.alone
def test_a_good_requests_p99_beside_the_heaviest_client_stays_within_the_bound(d1_service):
    """Issue 50 item 4's bound (README "Bounds under hostile load"): one-question requests, one at a time, first
    alone, then while another client keeps sending 8-question requests over a state of about 9,000 tokens (about
    3 s of the engine each, run whole): their p99 stays within 5 times the quiet p99, or 0.5 s more. Before, such a
    run held the engine for its whole length (two clients' p99 went from 0.063 s to 2.18 s beside one)."""
    heavy = body("A long thread about a charge. " * 1500, 8)
    with live_server(d1_service, ServerOptions(request_timeout_s=60)) as base:
        def latencies(count: int) -> list[float]:
            seconds = []
            with httpx.Client(base_url=base, timeout=60) as client:
                for _ in range(count):
                    start = time.monotonic()
                    assert client.post("/v1/systemone", json=body("Cannot log in", 1)).status_code == 200
                    seconds.append(time.monotonic() - start)
            return seconds

        latencies(3)  # warm
        quiet = max(latencies(20))
        stop, heavy_statuses = threading.Event(), []

        def heavy_client() -> None:
            with httpx.Client(base_url=base, timeout=60) as client:
                while not stop.is_set():
                    heavy_statuses.append(client.post("/v1/systemone", json=heavy).status_code)

        thread = threading.Thread(target=heavy_client)
        thread.start()
        try:
            time.sleep(0.5)
            beside = max(latencies(20))
        finally:
            stop.set()
            thread.join(timeout=60)
    assert heavy_statuses and set(heavy_statuses) == {200}, heavy_statuses
    assert beside <= max(5 * quiet, quiet + 0.5), (quiet, beside)
