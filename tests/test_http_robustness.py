"""Safe under bad input and load (decisions 1, 2, 5): every client input ends in a JSON 2xx/4xx,
bodies are capped, auth is enforced when configured, and a full server answers 503 + Retry-After at once."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import threading
import time
import tracemalloc

import httpx
import pytest
import zstandard

from systemone.cli import main as cli_main
from systemone.server.app import ServerOptions, create_app
from systemone.server.auth import is_loopback
from systemone.server.body import parse_json
from tests.live_server import live_server, port_of

NOUL = {"type": "noul", "instructions": "Is it urgent?"}
GOOD = json.dumps({"state": "x", "questions": {"q": NOUL}}).encode()
JSON_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def url(d3_service):
    with live_server(d3_service, ServerOptions(max_body_bytes=1 << 20)) as base:
        yield base


def send(url, content: bytes, headers=None, timeout=60):
    return httpx.post(url + "/v1/systemone", content=content, headers={**JSON_HEADERS, **(headers or {})},
                      timeout=timeout)


def assert_json_4xx(response, status):
    assert response.status_code == status, response.text
    assert isinstance(response.json(), dict)


# -- malformed and hostile JSON ---------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"{", b"nul", b'{"state": 1,}', b"\xff\xfe{}", b'"just a string"',
                                     b"[" * 5000 + b"]" * 5000, b'{"state": 1' + b"0" * 5000 + b', "questions": {}}'])
def test_malformed_bodies_are_422(url, content):
    assert_json_4xx(send(url, content), 422)


def test_lone_surrogates_are_422_wherever_they_are(url):
    for body in ('{"state": "\\ud800", "questions": {"q": {"type": "noul"}}}',
                 '{"state": "x", "questions": {"\\udfff": {"type": "noul"}}}',
                 '{"state": "x", "questions": {"q": {"type": "choice", "criteria": {"a\\ud83d": null}}}}'):
        response = send(url, body.encode())
        assert_json_4xx(response, 422)
        assert response.json()["detail"][0]["type"] == "string_unicode"


@pytest.mark.parametrize("state", [
    [0] * 1_000_000 + [["x"] * 1000, {"k": [1.5] * 1000}],
    json.loads("[" * 250 + ",".join(["[0]"] * 100_000) + "]" * 250),
], ids=["a million numbers", "100,000 lists 250 levels down"])
def test_checking_a_body_makes_no_object_per_value_or_container(state):
    """Nesting and lone surrogates are checked in memory for the depth alone: with three objects a value (the
    value, its location, its index), a million numbers took 160 MB more than reading them; with a location tuple a
    container, the 100,000 lists took 214 MB more."""
    raw = json.dumps({"state": state, "questions": {"q": NOUL}}).encode()
    tracemalloc.start()
    try:
        json.loads(raw.decode())  # what reading it takes, the check aside
        _, loads_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        parse_json(raw)
        _, parse_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parse_peak < loads_peak + (1 << 20), (parse_peak, loads_peak)


def test_nesting_is_bounded(url):
    deep = {"state": json.loads("[" * 300 + "]" * 300), "questions": {"q": NOUL}}
    assert_json_4xx(send(url, json.dumps(deep).encode()), 422)
    fine = {"state": json.loads("[" * 200 + "]" * 200), "questions": {"q": NOUL}}
    assert send(url, json.dumps(fine).encode()).status_code == 200


@pytest.mark.parametrize("state", ["NaN", "Infinity", "-Infinity", "1e400", "123456789" * 400, "-0"])
def test_odd_numbers_in_the_state_are_answered(url, state):
    """Spec 8 Q8: NaN/Infinity literals and huge numbers are read as Python reads them, then rendered."""
    response = send(url, ('{"state": %s, "questions": {"q": {"type": "noul"}}}' % state).encode())
    assert response.status_code == 200, response.text


def test_odd_numbers_in_typed_fields_are_422(url):
    for field in ('"priority": NaN', '"priority": 1e400', '"priority": 99999999999999999999', '"joint": 0'):
        assert_json_4xx(send(url, ('{"state": 1, "questions": {"q": {"type": "noul"}}, %s}' % field).encode()), 422)


def test_duplicate_keys_keep_the_last(url):
    body = b'{"state": 1, "questions": {"q": {"type": "score"}, "q": {"type": "noul"}}}'
    response = send(url, body)
    assert response.status_code == 200 and response.json()["answers"]["q"]["type"] == "noul"


# -- sizes and encodings ----------------------------------------------------------------------------------------
def test_body_over_the_limit_is_413(url):
    big = json.dumps({"state": "x" * (2 << 20), "questions": {"q": NOUL}}).encode()
    assert_json_4xx(send(url, big), 413)

    def chunks():  # no Content-Length: the cap applies while streaming
        for _ in range(40):
            yield b" " * 65536

    response = httpx.post(url + "/v1/systemone", content=chunks(), headers=JSON_HEADERS, timeout=60)
    assert_json_4xx(response, 413)


def test_zstd_and_gzip_bodies_are_read(url):
    plain = send(url, GOOD).json()["answers"]
    for encoding, data in (("zstd", zstandard.ZstdCompressor().compress(GOOD)), ("gzip", gzip.compress(GOOD))):
        response = send(url, data, {"Content-Encoding": encoding})
        assert response.status_code == 200 and response.json()["answers"] == plain


def test_decompression_bombs_are_413(url):
    bomb = json.dumps({"state": "x" * (8 << 20), "questions": {"q": NOUL}}).encode()
    for encoding, data in (("zstd", zstandard.ZstdCompressor().compress(bomb)), ("gzip", gzip.compress(bomb))):
        assert len(data) < (1 << 20)
        assert_json_4xx(send(url, data, {"Content-Encoding": encoding}), 413)


@pytest.mark.parametrize("encoding", ["br", "deflate", "compress", "zstd, br"])
def test_unsupported_encodings_are_415(url, encoding):
    assert_json_4xx(send(url, GOOD, {"Content-Encoding": encoding}), 415)


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_corrupt_compressed_bodies_are_400(url, encoding):
    assert_json_4xx(send(url, b"\x28\xb5\x2f\xfd garbage" if encoding == "zstd" else b"\x1f\x8b junk",
                         {"Content-Encoding": encoding}), 400)


# -- auth ------------------------------------------------------------------------------------------------------
def test_api_key_required_when_configured(d3_service):
    with live_server(d3_service, ServerOptions(api_key="s3cret")) as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "Bearer"}):
            response = send(base, GOOD, headers)
            assert response.status_code == 401
            assert response.json()["detail"]["error_type"] == "authentication_error"
            assert "Authorization: Bearer" in response.json()["detail"]["message"]
        assert send(base, GOOD, {"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/health").status_code == 200


def test_without_a_key_the_header_is_ignored(url):
    assert send(url, GOOD, {"Authorization": "Bearer anything"}).status_code == 200


def test_non_loopback_bind_needs_a_key_or_an_explicit_flag(d3_artifact, capsys, monkeypatch):
    monkeypatch.delenv("SYSTEMONE_API_KEY", raising=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    assert cli_main(["serve", str(d3_artifact), "--host", "0.0.0.0", "--device", "cpu"]) == 2
    assert "--allow-unauthenticated" in capsys.readouterr().err


# -- load: bounded slots and queue, time limit, disconnects, graceful shutdown ---------------------------------
class GatedEngine:
    """The real engine, whose graph calls wait for a gate: lets a test hold requests in flight in the scheduler."""

    def __init__(self, engine, gate: threading.Event, started: threading.Semaphore):
        self._engine, self.gate, self.started = engine, gate, started

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _gated(self, work, *args, **kwargs):
        self.started.release()
        self.gate.wait(timeout=60)
        return work(*args, **kwargs)

    def run(self, *args, **kwargs):
        return self._gated(self._engine.run, *args, **kwargs)

    def run_rows(self, *args, **kwargs):
        return self._gated(self._engine.run_rows, *args, **kwargs)


class GatedService:
    """The real service on a gated engine."""

    def __init__(self, service):
        self._service = service
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        service.batch_sizing()  # measured on the real engine, before the gate holds its calls
        self.engine = GatedEngine(service.engine, self.gate, self.started)

    def __getattr__(self, name):
        return getattr(self._service, name)


def test_full_server_answers_503_with_retry_after_at_once(d3_service):
    gated = GatedService(d3_service)
    with live_server(gated, ServerOptions(max_concurrency=1, max_queue=1)) as base:
        async def scenario():
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                post = lambda: client.post("/v1/systemone", content=GOOD, headers=JSON_HEADERS)  # noqa: E731
                running = asyncio.ensure_future(post())
                await asyncio.to_thread(gated.started.acquire)
                queued = asyncio.ensure_future(post())
                await asyncio.sleep(0.3)
                start = time.monotonic()
                refused = await post()
                refused_after = time.monotonic() - start
                health = await client.get("/health")  # the event loop answers while the model works
                metrics = (await client.get("/metrics")).text
                gated.gate.set()
                return (await running, await queued, refused, refused_after, health, metrics)

        running, queued, refused, refused_after, health, metrics = asyncio.run(scenario())
    assert running.status_code == 200 and queued.status_code == 200
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert "--max-concurrency" in refused.json()["error"]["message"]
    assert refused_after < 1.0
    assert health.status_code == 200
    assert "systemone_requests_running 1" in metrics and "systemone_queue_depth 1" in metrics


def test_request_time_limit_is_503_naming_the_limit(d3_service):
    gated = GatedService(d3_service)
    with live_server(gated, ServerOptions(request_timeout_s=0.5)) as base:
        response = send(base, GOOD)
        gated.gate.set()
    assert response.status_code == 503 and "--request-timeout" in response.json()["error"]["message"]


def test_a_client_that_disconnects_frees_its_slot(d3_service):
    gated = GatedService(d3_service)
    app_holder = {}

    with live_server(gated, ServerOptions(max_concurrency=1, max_queue=4)) as base:
        async def scenario():
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                running = asyncio.ensure_future(client.post("/v1/systemone", content=GOOD, headers=JSON_HEADERS))
                await asyncio.to_thread(gated.started.acquire)
                async with httpx.AsyncClient(base_url=base, timeout=0.5) as impatient:
                    with pytest.raises(httpx.ReadTimeout):
                        await impatient.post("/v1/systemone", content=GOOD, headers=JSON_HEADERS)
                await asyncio.sleep(0.3)
                app_holder["metrics"] = (await client.get("/metrics")).text
                gated.gate.set()
                return await running

        assert asyncio.run(scenario()).status_code == 200
    assert "systemone_queue_depth 0" in app_holder["metrics"]
    assert 'systemone_requests_total{status="499"} 1' in app_holder["metrics"]


def test_shutdown_finishes_requests_in_flight(d3_service):
    gated = GatedService(d3_service)
    result = {}
    with live_server(gated) as base:
        thread = threading.Thread(target=lambda: result.setdefault("r", send(base, GOOD)))
        thread.start()
        gated.started.acquire()
        threading.Timer(0.5, gated.gate.set).start()
    # live_server's exit asked uvicorn to stop while the request was in flight; it still got its answer.
    thread.join(timeout=60)
    assert result["r"].status_code == 200


# -- observability ---------------------------------------------------------------------------------------------
def test_request_id_is_echoed_on_errors_too(url):
    response = send(url, b"{", {"X-Request-Id": "trace-1"})
    assert response.status_code == 422 and response.headers["x-request-id"] == "trace-1"


def test_logs_hold_no_state_text_unless_asked(d3_service, caplog):
    marker = "SECRET-STATE-7f3a"
    body = json.dumps({"state": marker, "questions": {"q": NOUL}}).encode()
    from fastapi.testclient import TestClient

    with caplog.at_level(logging.INFO, logger="systemone.server"):
        TestClient(create_app(d3_service)).post("/v1/systemone", content=body, headers=JSON_HEADERS)
    assert "status=200" in caplog.text and marker not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="systemone.server"):
        TestClient(create_app(d3_service, ServerOptions(log_requests=True))).post(
            "/v1/systemone", content=body, headers=JSON_HEADERS)
    assert marker in caplog.text


def test_metrics_are_prometheus_text(url):
    send(url, GOOD)
    send(url, b"{")
    text = httpx.get(url + "/metrics").text
    assert 'systemone_requests_total{status="200"}' in text and 'systemone_requests_total{status="422"}' in text
    assert "# TYPE systemone_request_seconds histogram" in text and "systemone_input_tokens_total" in text


def test_a_client_that_aborts_its_upload_is_counted_not_logged_as_an_error(d3_service, caplog):
    import socket

    with live_server(d3_service) as base:
        port = port_of(base)
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100000\r\n\r\n{\"state\": \"")
                time.sleep(0.2)
        time.sleep(0.5)
        metrics = httpx.get(base + "/metrics").text
    assert "systemone_client_aborted_uploads_total 2" in metrics
    assert 'systemone_requests_total{status="499"} 2' in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
