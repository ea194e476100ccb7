"""Deadlines (spec 6.1, decision 1; docs/operations.md): every media fetch has an overall deadline and stops
with its request; media work runs in its own bounded pool, so slow media servers never starve request parsing;
--request-timeout covers media and prompts too; /ready says when the server cannot take work."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from systemone.models.errors import TimedOut
from systemone.runtime.artifact import Artifact
from systemone.runtime.deadline import Deadline
from systemone.runtime.engine import EngineOptions
from systemone.runtime.media_fetch import FetchPolicy, MediaUnreadable, fetch
from systemone.runtime.service import DecisionService
from systemone.server.app import ServerOptions
from tests.drip_server import DripServer
from tests.live_server import live_server
from tests.media_helpers import data_url, gradient_png

NOUL = {"type": "noul", "instructions": "Is it urgent?"}
GOOD = json.dumps({"state": "x", "questions": {"q": NOUL}}).encode()
JSON_HEADERS = {"Content-Type": "application/json"}


def in_thread(work, within_s: float):
    """`work()`'s result or exception, and the seconds it took; fails if it is still running after `within_s`."""
    out = {}

    def run():
        start = time.monotonic()
        try:
            out["result"] = work()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc
        out["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"still running after {within_s} s"
    return out


@pytest.mark.parametrize("headers_too, version", [(False, "HTTP/1.1"), (True, "HTTP/1.1"), (False, "HTTP/1.0")])
def test_a_fetch_that_drips_stops_at_its_overall_deadline(headers_too, version):
    """A byte a second keeps every read alive; the fetch's overall deadline (--image-fetch-timeout) ends it
    (HTTP/1.0: the connection lets go of its socket while the response still reads from it)."""
    policy = FetchPolicy(allow_private_hosts=True, image_timeout_s=1.5)
    with DripServer(interval_s=0.5, headers_too=headers_too, version=version).running() as drip:
        out = in_thread(lambda: fetch(drip.url + "/slow.png", "images[0]", "image", policy), within_s=10)
        assert drip.wait_closed(within_s=2)
    assert isinstance(out["error"], MediaUnreadable)
    assert "images[0]" in out["error"].message and "--image-fetch-timeout" in out["error"].message
    assert 1.4 < out["seconds"] < 4


def test_a_fetch_stops_at_once_when_its_request_is_abandoned():
    deadline = Deadline(60)
    policy = FetchPolicy(allow_private_hosts=True, image_timeout_s=60)
    with DripServer(interval_s=0.5).running() as drip:
        threading.Timer(0.5, deadline.cancel).start()
        out = in_thread(lambda: fetch(drip.url + "/slow.png", "images[0]", "image", policy, deadline), within_s=10)
        assert drip.wait_closed(within_s=2)
    assert isinstance(out["error"], TimedOut) and "--request-timeout" in out["error"].message
    assert out["seconds"] < 2


@pytest.fixture(scope="module")
def private_media_service(d3_artifact):
    """The tiny d3 model, fetching from loopback (the drip server) with a long per-fetch deadline, so only the
    request's deadline can stop the fetches."""
    policy = FetchPolicy(allow_private_hosts=True, image_timeout_s=120)
    return DecisionService(Artifact.load(d3_artifact), EngineOptions(device="cpu", fetch_policy=policy),
                           served_model_names=["vllm-sr/d3-tiny"])


def test_slow_media_never_starve_other_requests(private_media_service):
    """Eight requests with two dripping images each: a good request and a malformed one are answered within 2 s,
    /ready reports the busy media pool, every slow request ends at --request-timeout (503), and no fetch outlives
    its request by more than 2 s."""
    with DripServer(interval_s=1.0).running() as drip, \
            live_server(private_media_service, ServerOptions(request_timeout_s=4, max_queue=16)) as base:
        slow = [json.dumps({"state": "x", "images": [f"{drip.url}/{i}a.png", f"{drip.url}/{i}b.png"],
                            "questions": {"q": NOUL}}) for i in range(8)]

        async def scenario():
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                slow_posts = [asyncio.ensure_future(client.post("/v1/systemone", content=body, headers=JSON_HEADERS))
                              for body in slow]
                await asyncio.sleep(1.0)
                busy = await client.get("/ready")
                start = time.monotonic()
                good = await client.post("/v1/systemone", content=GOOD, headers=JSON_HEADERS)
                good_s = time.monotonic() - start
                start = time.monotonic()
                malformed = await client.post("/v1/systemone", content=b"{", headers=JSON_HEADERS)
                malformed_s = time.monotonic() - start
                slow_answers = await asyncio.gather(*slow_posts)
                ended = time.monotonic()
                closed = await asyncio.to_thread(drip.wait_closed, 2.0)
                closed_s = time.monotonic() - ended
                metrics = (await client.get("/metrics")).text
                ready = await client.get("/ready")
                return busy, good, good_s, malformed, malformed_s, slow_answers, closed, closed_s, metrics, ready

        busy, good, good_s, malformed, malformed_s, slow_answers, closed, closed_s, metrics, ready = \
            asyncio.run(scenario())
    assert good.status_code == 200 and good_s < 2.0, (good.status_code, good_s)
    assert malformed.status_code == 422 and malformed_s < 2.0
    assert [r.status_code for r in slow_answers] == [503] * 8
    assert all("--request-timeout" in r.json()["error"]["message"] for r in slow_answers)
    assert busy.status_code == 503 and busy.json()["media_queued"] > 0
    assert closed, f"{drip.open} fetches still open {closed_s:.1f} s after their requests ended"
    assert "systemone_media_jobs_running 0" in metrics
    assert ready.status_code == 200


class Failing(BaseHTTPRequestHandler):
    """Answers every GET with a 503 at once: worth another try to a fetch, 1 s and then 4 s later."""

    def do_GET(self):  # noqa: N802
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_failing_media_urls_never_starve_inline_images(private_media_service):
    """Issue 50 item 6: six clients whose URLs answered 503 pushed other clients' inline data: images to a p50 of
    28 s (each failing URL held a media thread through its retries' pauses). Here six requests of four such URLs
    each, then inline-image requests one after another: each is answered within 3 s."""
    failing = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    failing.daemon_threads = True
    threading.Thread(target=failing.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{failing.server_address[1]}"
    inline = json.dumps({"state": "x", "images": [data_url(gradient_png(32, 32))], "questions": {"q": NOUL}})
    try:
        with live_server(private_media_service, ServerOptions(request_timeout_s=20)) as base:
            async def scenario():
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                    failing_posts = [asyncio.ensure_future(client.post(
                        "/v1/systemone", headers=JSON_HEADERS,
                        content=json.dumps({"state": "x", "images": [f"{url}/{i}-{j}.png" for j in range(4)],
                                            "questions": {"q": NOUL}}))) for i in range(6)]
                    await asyncio.sleep(0.5)
                    seconds = []
                    for _ in range(3):
                        start = time.monotonic()
                        answer = await client.post("/v1/systemone", content=inline, headers=JSON_HEADERS)
                        seconds.append((answer.status_code, time.monotonic() - start))
                    return seconds, await asyncio.gather(*failing_posts)
            seconds, failed = asyncio.run(scenario())
    finally:
        failing.shutdown()
    assert [status for status, _ in seconds] == [200] * 3 and max(s for _, s in seconds) < 3, seconds
    assert {r.status_code for r in failed} == {422}, [r.text[:200] for r in failed]
