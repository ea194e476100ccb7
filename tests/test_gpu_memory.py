"""A bounded device arena (`--gpu-memory`) that cannot hold a call: the call's rows run again in smaller calls,
and a single row that still does not fit is a 503 with Retry-After (the client may retry), never a 500, for its
request alone (the requests sharing its call get their answers); start-up measures calls only as large as the
arena holds, and one that cannot hold a single question stops `serve` saying so; a vision job of several requests
it cannot hold runs each request's media again alone, and only a request whose media does not fit alone fails.
The arena itself is onnxruntime's on CUDA; here a CPU session fails past a size exactly as onnxruntime words it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from systemone.models.errors import DeviceMemoryExhausted, Unavailable
from systemone.runtime.artifact import Artifact
from systemone.runtime.batch import BatchBudget, TextRow
from systemone.runtime.batch_sizing import TooLittleDeviceMemory, measure_batch_rows
from systemone.runtime.d3.code_logits import CodeLogits, code_logits, text_positions
from systemone.runtime.deadline import Deadline
from systemone.runtime.engine import EngineOptions
from systemone.runtime.scheduler import Scheduler
from systemone.runtime.service import DecisionService
from systemone.runtime.session import GraphSession, memory_errors
from systemone.runtime.text_runner import TextRunner
from systemone.server.app import create_app
from tests.media_helpers import data_url, gradient_png

# onnxruntime's message when the BFC arena is at its limit (seen on the H200 with --gpu-memory 8).
ARENA_FULL = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Expand node. "
              "Status Message: bfc_arena.cc:360 Available memory of 11587072 is smaller than requested bytes of "
              "104857600")


class BoundedSession(GraphSession):
    """The CPU session with an arena that holds at most `most_rows` rows, or `most_tokens` padded tokens, a call."""

    def __init__(self, path, most_rows: int | None = None, most_tokens: int | None = None):
        super().__init__(path, "cpu")
        self.most_rows, self.most_tokens = most_rows, most_tokens
        self.calls: list[int] = []

    def run(self, feeds, run_options=None, fetch=None):
        rows, length = feeds["input_ids"].shape
        self.calls.append(rows)
        if ((self.most_rows is not None and rows > self.most_rows)
                or (self.most_tokens is not None and rows * length > self.most_tokens)):
            with memory_errors():
                raise RuntimeError(ARENA_FULL)
        return super().run(feeds, run_options, fetch)


def rows_of(lengths: list[int]) -> list[TextRow]:
    rng = np.random.default_rng(0)
    return [TextRow(rng.integers(0, 5000, n).tolist(), text_positions(n)) for n in lengths]


def runner(session: GraphSession, artifact) -> TextRunner:
    """The bidirectional d3 graph's runner (no state) on `session`."""
    return TextRunner(session, BatchBudget(), CodeLogits(int(Artifact.load(artifact).manifest.model["hidden_size"])),
                      layout=None)


def test_a_call_the_arena_cannot_hold_runs_again_in_halves(d3_artifact):
    plain = runner(GraphSession(d3_artifact / "text.onnx", "cpu"), d3_artifact)
    bounded_session = BoundedSession(d3_artifact / "text.onnx", most_rows=2)
    bounded = runner(bounded_session, d3_artifact)
    rows = rows_of([9, 30, 12, 25, 7])
    assert np.abs(code_logits(bounded.run_rows(rows)) - code_logits(plain.run_rows(rows))).max() <= 1e-5
    assert bounded_session.calls == [5, 2, 3, 1, 2]  # 5 -> 2 + 3, and 3 -> 1 + 2


def test_a_row_the_arena_cannot_hold_is_retryable_not_an_internal_error(d3_artifact):
    bounded = runner(BoundedSession(d3_artifact / "text.onnx", most_rows=0), d3_artifact)
    with pytest.raises(DeviceMemoryExhausted, match="--gpu-memory") as raised:
        bounded.run_rows(rows_of([9]))
    assert isinstance(raised.value, Unavailable)


def test_other_onnxruntime_errors_pass_through():
    with pytest.raises(RuntimeError, match="Invalid rank"), memory_errors():
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Invalid rank for input")


def test_the_client_gets_503_with_retry_after(d3_artifact):
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"))
    client = TestClient(create_app(service))  # started (its batch sizing measured) while the arena had room
    service.engine.runner.session = BoundedSession(d3_artifact / "text.onnx", most_rows=0)
    response = client.post("/v1/systemone", json={"state": "The parcel arrived crushed.",
                                                  "questions": {"q": {"type": "noul", "instructions": "Refund?"}}})
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1" and "--gpu-memory" in response.json()["error"]["message"]


def test_start_up_measures_calls_only_as_large_as_the_arena_holds_and_the_server_answers(d3_artifact):
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"))
    session = BoundedSession(d3_artifact / "text.onnx", most_rows=1)
    service.engine.runner.session = session
    client = TestClient(create_app(service))  # measures its batch rows now, in the bounded arena
    assert 2 in session.calls and service.batch_sizing().rows == 1
    response = client.post("/v1/systemone", json={"state": "The parcel arrived crushed.",
                                                  "questions": {"q": {"type": "noul", "instructions": "Refund?"}}})
    assert response.status_code == 200, response.text


def test_an_arena_that_cannot_hold_one_question_stops_start_up_naming_the_flag(d3_artifact):
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"))
    service.engine.runner.session = BoundedSession(d3_artifact / "text.onnx", most_rows=0)
    with pytest.raises(TooLittleDeviceMemory, match="--gpu-memory"):
        measure_batch_rows(service.engine)


def test_a_shared_call_the_arena_cannot_hold_fails_only_the_request_whose_row_does_not_fit_alone(d3_artifact):
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"))
    question = {"q": {"type": "noul", "instructions": "Refund?"}}
    short = [service.prepare({"state": f"Parcel {i} arrived crushed.", "questions": question}) for i in range(3)]
    long = service.prepare({"state": "The parcel arrived crushed, the box torn open. " * 2, "questions": question})
    lengths = [len(p.prompts[0].token_ids) for p in (*short, long)]
    assert max(lengths[:3]) < lengths[3] <= 2 * min(lengths[:3])  # long enough not to fit, close enough to share
    answers_alone = [service.answer(p) for p in short]
    session = BoundedSession(d3_artifact / "text.onnx", most_tokens=max(lengths[:3]))
    service.engine.runner.session = session
    scheduler = Scheduler(service.engine, batch_rows=4, batch_wait_s=5.0)
    futures = [scheduler.submit(p, Deadline()) for p in (short[0], long, short[1], short[2])]
    with pytest.raises(DeviceMemoryExhausted, match="--gpu-memory"):
        futures[1].result(timeout=60)
    for prepared, future, alone in zip(short, (futures[0], futures[2], futures[3]), answers_alone, strict=True):
        assert service.respond(prepared, future.result(timeout=60))["answers"] == alone["answers"]
    assert session.calls[0] == 4  # the four requests shared one call before it was split
    scheduler.close(timeout=30)


class BoundedVision(GraphSession):
    """The CPU vision session with an arena that holds at most `most_patches` pixel rows a run."""

    def __init__(self, path, most_patches: int):
        super().__init__(path, "cpu")
        self.most_patches = most_patches

    def run(self, feeds, run_options=None):
        if feeds["pixel_values"].shape[0] > self.most_patches:
            with memory_errors():
                raise RuntimeError(ARENA_FULL)
        return super().run(feeds, run_options)


def test_a_vision_job_the_arena_cannot_hold_fails_only_the_request_that_does_not_fit_alone(d3_artifact):
    service = DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu"))
    question = {"q": {"type": "noul", "instructions": "Is it damaged?"}}
    small = [service.prepare({"state": f"photo {i}", "questions": question,
                              "images": [data_url(gradient_png(96, 80, seed=i))]}) for i in range(3)]
    big = service.prepare({"state": "a large photo", "questions": question,
                           "images": [data_url(gradient_png(640, 480))]})
    patches = [p.media.loaded.in_order()[0].pixels.shape[0] for p in (*small, big)]
    assert max(patches[:3]) < patches[3]
    answers_alone = [service.answer(p) for p in small]
    service.engine.media.session = BoundedVision(d3_artifact / "vision.onnx", most_patches=max(patches[:3]))
    engine = service.engine
    started, release = threading.Event(), threading.Event()
    encode = engine.encode_media_many

    def held_first_job(prepared, run_options=None):  # the first job waits, so the other three share the next
        if not started.is_set():
            started.set()
            release.wait(10)
        return encode(prepared, run_options)

    engine.encode_media_many = held_first_job
    scheduler = Scheduler(engine, batch_rows=4, batch_wait_s=0.0, media_lane=True)
    futures = [scheduler.submit(small[0], Deadline())]
    assert started.wait(10)
    futures += [scheduler.submit(p, Deadline()) for p in (small[1], big, small[2])]
    time.sleep(0.1)
    release.set()
    with pytest.raises(DeviceMemoryExhausted, match="--gpu-memory"):
        futures[2].result(timeout=60)
    for prepared, future, alone in zip(small, (futures[0], futures[1], futures[3]), answers_alone, strict=True):
        shared = service.respond(prepared, future.result(timeout=60))
        assert shared["answers"] == alone["answers"]
    scheduler.close(timeout=30)

