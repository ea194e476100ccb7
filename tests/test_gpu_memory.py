"""A bounded device arena (`--gpu-memory`) that cannot hold a call: the call's rows run again in smaller calls,
and a single row that still does not fit is a 503 with Retry-After (the client may retry), never a 500. The arena
itself is onnxruntime's on CUDA; here a CPU session fails past a row count exactly as onnxruntime words it."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from systemone.models.errors import DeviceMemoryExhausted, Unavailable
from systemone.runtime.artifact import Artifact
from systemone.runtime.batch import BatchBudget, TextRow
from systemone.runtime.d3.code_logits import CodeLogitsRunner, text_positions
from systemone.runtime.engine import EngineOptions
from systemone.runtime.service import DecisionService
from systemone.runtime.session import GraphSession, memory_errors
from systemone.server.app import create_app

# onnxruntime's message when the BFC arena is at its limit (seen on the H200 with --gpu-memory 8).
ARENA_FULL = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Expand node. "
              "Status Message: bfc_arena.cc:360 Available memory of 11587072 is smaller than requested bytes of "
              "104857600")


class BoundedSession(GraphSession):
    """The CPU session with an arena that holds at most `most_rows` rows a call."""

    def __init__(self, path, most_rows: int):
        super().__init__(path, "cpu")
        self.most_rows = most_rows
        self.calls: list[int] = []

    def run(self, feeds, run_options=None):
        rows = feeds["input_ids"].shape[0]
        self.calls.append(rows)
        if rows > self.most_rows:
            with memory_errors():
                raise RuntimeError(ARENA_FULL)
        return super().run(feeds, run_options)


def rows_of(lengths: list[int]) -> list[TextRow]:
    rng = np.random.default_rng(0)
    return [TextRow(rng.integers(0, 5000, n).tolist(), text_positions(n)) for n in lengths]


def test_a_call_the_arena_cannot_hold_runs_again_in_halves(d3_artifact):
    hidden = int(Artifact.load(d3_artifact).manifest.model["hidden_size"])
    plain = CodeLogitsRunner(GraphSession(d3_artifact / "text.onnx", "cpu"), BatchBudget(), hidden)
    bounded_session = BoundedSession(d3_artifact / "text.onnx", most_rows=2)
    bounded = CodeLogitsRunner(bounded_session, BatchBudget(), hidden)
    rows = rows_of([9, 30, 12, 25, 7])
    assert np.abs(bounded.run_rows(rows) - plain.run_rows(rows)).max() <= 1e-5
    assert bounded_session.calls == [5, 2, 3, 1, 2]  # 5 -> 2 + 3, and 3 -> 1 + 2


def test_a_row_the_arena_cannot_hold_is_retryable_not_an_internal_error(d3_artifact):
    hidden = int(Artifact.load(d3_artifact).manifest.model["hidden_size"])
    runner = CodeLogitsRunner(BoundedSession(d3_artifact / "text.onnx", most_rows=0), BatchBudget(), hidden)
    with pytest.raises(DeviceMemoryExhausted, match="--gpu-memory") as raised:
        runner.run_rows(rows_of([9]))
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
