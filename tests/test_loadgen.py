"""The load generator behind `systemone bench --serve`: its request mix is valid for each family (every request
answered 200 by a live server), no cache can answer it (no two requests share a media byte string, and their
frames' pixels differ), every request ends as exactly one outcome counted under its kind (an answer, a status, a
connection error, a client timeout, a 200 that misses a question), and its own ceiling is measured against a stub
server with every run, in more processes while that ceiling is below 3x what it measures."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image

from systemone.loadgen import (ALL_KINDS, PUBLISHED_SOURCE, RequestMix, answers_every_question, ceiling,
                               closed_loop, generate, run_load, server_metrics, spread_until_ceiling, stub_server,
                               work_shares)
from systemone.runtime.d3.video import decode_video
from tests.live_server import live_server

SMALL_CLIP = (160, 96, 10, 2)  # the MP4 kind's clips at test size: width, height, fps, seconds


@pytest.mark.parametrize("family", ["d3", "d1"])
def test_the_mix_is_answered_and_counted(family, request):
    service = request.getfixturevalue(f"{family}_service")
    mix = RequestMix(family)
    kinds = [mix.body(i)[0] for i in range(len(mix.kinds))]
    assert ("video" in kinds) == (family == "d3") and "image" in kinds and "choice40" in kinds
    with live_server(service) as base:
        before = server_metrics(f"{base}/v1/systemone")
        result = asyncio.run(closed_loop(f"{base}/v1/systemone", RequestMix(family), clients=2, seconds=4.0))
        work = work_shares(before, server_metrics(f"{base}/v1/systemone"), result.seconds)
    summary = result.summary()
    assert result.errors == {} and set(result.statuses) == {200}, summary
    assert result.timeouts == result.incomplete == 0
    assert summary["answered"] == sum(result.statuses.values()) >= len(mix.kinds)
    assert 1 <= result.questions / summary["answered"] <= 4
    assert summary["p50_ms"] <= summary["p99_ms"]
    # Per kind: every kind of the rotation was sent, and the kinds' counts add up to the run's.
    assert set(summary["kinds"]) == set(mix.kinds)
    assert sum(k["answered"] for k in summary["kinds"].values()) == summary["answered"]
    assert all(k["p50_ms"] <= k["p99_ms"] for k in summary["kinds"].values())
    # The server's own account of the run: its engine thread ran graphs part of the time (one lane cannot be
    # busy longer than the run), and media threads loaded the photos and videos.
    assert 0 < work["text_lane_busy"] <= 1.01 and work["text_lane_jobs_per_s"] > 0, work
    assert work["media_threads_loading"] > 0, work


def test_a_server_without_metrics_reports_no_work_shares():
    assert server_metrics("http://127.0.0.1:9/v1/systemone") == {}  # the discard port: nothing listens


def media_items(body: dict) -> list[bytes]:
    """Every media byte string of a body: each image, each JPEG frame of a video, each video file."""
    items = [base64.b64decode(url.split(",", 1)[1]) for url in body.get("images", [])]
    for url in body.get("videos", []):
        items += [base64.b64decode(part) for part in url.split(",")[1:]]
    return items


def test_no_two_requests_share_a_media_byte_string_within_a_run_or_across_runs():
    mix = RequestMix("d3", kinds=ALL_KINDS, video_file=SMALL_CLIP, clips=2)
    spread = mix.renewed()
    runs = [mix, mix.renewed(), spread.part(0, 2), spread.part(1, 2)]  # three runs, one over two processes
    bodies = [run.body(i)[1] for run in runs for i in range(3 * len(mix.kinds))]
    items = [item for body in bodies for item in media_items(body)]
    # 3 photos, 3 videos of 20 frames and 3 MP4 files a rotation's three passes, in each of the four.
    assert len(items) == 4 * 3 * (1 + 20 + 1)
    assert len(set(items)) == len(items)
    # Every body names its run: a cache keyed on the state cannot answer a later run either.
    assert len({json.dumps(body["state"]) for body in bodies}) == len(bodies)


def test_every_frame_of_every_video_is_new_pixels_and_the_mp4_a_real_video_file():
    mix = RequestMix("d3", kinds=("video", "mp4"), video_file=SMALL_CLIP, clips=2)
    first, second = (media_items(mix.body(i)[1]) for i in (0, 2))  # two JPEG-frame videos
    for a, b in zip(first, second, strict=True):
        pixels = [np.asarray(Image.open(io.BytesIO(frame))) for frame in (a, b)]
        assert pixels[0].shape == pixels[1].shape and (pixels[0] != pixels[1]).any()
    clip = media_items(mix.body(1)[1])[0]
    assert clip[4:8] == b"ftyp"  # an MPEG-4 file, as a user's upload
    video = decode_video(clip, "videos[0]")  # as the server reads it
    assert len(video.frames) == 4 and video.frames[0].shape == (96, 160, 3)


def test_the_text_only_kind_asks_one_question_about_a_text_state(d3_service):
    mix = RequestMix("d3", kinds=("text1",))
    bodies = [mix.body(i)[1] for i in range(8)]
    assert all(len(body["questions"]) == 1 and isinstance(body["state"], str) for body in bodies)
    assert not any("images" in body or "videos" in body for body in bodies)
    with live_server(d3_service) as base:
        result = asyncio.run(closed_loop(f"{base}/v1/systemone", mix, clients=2, seconds=2.0))
    assert set(result.statuses) == {200} and result.questions == result.summary()["answered"] > 0


@contextmanager
def raw_server(reply: bytes | None):
    """A loopback HTTP server that answers every request with `reply`, or (None) reads requests and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as requests:
            while requests.readline():  # a request line: its headers, then its body, then the reply
                length = 0
                while (line := requests.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    length = int(value) if name.lower() == "content-length" else length
                requests.read(length)
                if reply is not None:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                 + str(len(reply)).encode() + b"\r\n\r\n" + reply)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/systemone"
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_silent_server_gives_timeouts_not_a_hang():
    with raw_server(None) as url:
        result = asyncio.run(closed_loop(url, RequestMix("d3", kinds=("text", "json")), clients=2, seconds=1.0,
                                         timeout_s=0.3))
    summary = result.summary()
    # Each client gives up after 0.3 s and sends its next request on a new connection, until the second is over.
    assert summary["answered"] == 0 and result.statuses == {} and result.errors == {}
    assert result.timeouts >= 4
    assert summary["kinds"]["text"]["timeouts"] >= 2 and summary["kinds"]["json"]["timeouts"] >= 2
    assert result.seconds < 3.0


def test_a_200_that_misses_a_question_is_not_an_answer():
    # Requests of the text kind ask 1, 2, 3, 4, 1, ... questions; this server always answers q0 alone.
    reply = json.dumps({"answers": {"q0": {"type": "noul", "probabilities": {"yes": 0.5, "no": 0.5}}}}).encode()
    with raw_server(reply) as url:
        result = asyncio.run(closed_loop(url, RequestMix("d3", kinds=("text",)), clients=1, seconds=1.0))
    answered = len(result.latencies)
    assert answered > 0 and result.incomplete > 0
    assert result.statuses[200] == answered + result.incomplete
    assert result.questions == answered  # only the one-question requests count as answered
    assert answers_every_question({"questions": {"q0": {}}}, reply)
    assert not answers_every_question({"questions": {"q0": {}, "q1": {}}}, reply)
    assert not answers_every_question({"questions": {"q0": {}}}, b'{"answers": {"q0": {}}}')  # no probabilities
    assert not answers_every_question({"questions": {"q0": {}}}, b"not json")


def test_the_generator_runs_in_several_processes_as_one_run():
    mix = RequestMix("d3", kinds=("text", "choice40"))
    with stub_server(2) as stub:
        result = generate(stub, mix, clients=3, seconds=1.0, processes=2)
    summary = result.summary()
    assert summary["answered"] > 0 and result.statuses == {200: summary["answered"]}
    assert set(summary["kinds"]) == {"text", "choice40"}


def test_the_ceiling_is_measured_and_printed_with_every_run(capsys):
    mix = RequestMix("d3", kinds=("text1",))
    with stub_server() as stub:
        assert ceiling(stub, mix, clients=2, processes=1, seconds=0.5) > 0
        # The stub stands in for the measured server too.
        report = run_load(stub, "d3", clients=(1, 2), seconds=0.5, kinds=("text1",), max_processes=1,
                          ceiling_seconds=0.5, published="d3-nano", mix=mix, warm_up_s=0)
    for count in (1, 2):
        run = report["runs"][f"server@{count}"]
        assert run["answered"] > 0 and run["generator"]["ceiling_requests_per_s"] > 0
        assert run["generator"]["processes"] == 1  # the most allowed
    printed = capsys.readouterr().out
    assert printed.count("generator ceiling") == 2
    # The seeds' published figures beside the run's, at their client counts.
    assert PUBLISHED_SOURCE in printed and "11.1" in printed and "59.8" in printed and "16.5" in printed
    assert report["published"]["requests_per_s"]["vLLM"] == (11.1, 52.8, 59.8)


def test_each_run_follows_a_warm_up_and_the_servers_take_turns():
    """A server's first run comes after each kind of the mix was answered once and a few seconds of the run's load,
    none of it measured (the reference's kernels compile on a shape's first request); each later run after the
    load alone. At each client count both servers run, who goes first alternating."""
    mix = RequestMix("d3", kinds=("text", "json", "choice40"))
    with stub_server() as ours, stub_server() as reference:
        report = run_load(ours, "d3", clients=(1, 2, 3), seconds=0.3, reference=reference, max_processes=1,
                          ceiling_seconds=0.2, mix=mix, warm_up_s=0.3)
    assert list(report["runs"]) == ["server@1", "reference@1", "reference@2", "server@2", "server@3", "reference@3"]
    for name in ("server", "reference"):
        first = report["runs"][f"{name}@1"]["warm_up"]
        assert first["every_kind"] == {"seconds": first["every_kind"]["seconds"], "answered": 3,
                                       "statuses": {"200": 3}}
        assert first["load"]["answered"] > 0
        for count in (2, 3):
            later = report["runs"][f"{name}@{count}"]["warm_up"]
            assert "every_kind" not in later and later["load"]["answered"] > 0
            assert report["runs"][f"{name}@{count}"]["answered"] > 0


def test_a_closed_loop_stops_at_its_request_count():
    mix = RequestMix("d3", kinds=("text", "json"))
    with stub_server() as stub:
        done = asyncio.run(closed_loop(stub, mix, 3, 30.0, requests=5))
    assert len(done.latencies) == 5 and done.seconds < 30.0


class Measured:
    """A run of a fixed rate, whatever the processes."""

    def __init__(self, rate: float):
        self.requests_per_s = rate


def test_the_generator_doubles_its_processes_while_its_ceiling_is_below_3x_the_rate():
    runs: list[int] = []

    def measured(processes: int):
        runs.append(processes)
        return Measured(50.0), {"requests_per_s": 50.0}

    # 40 requests/s a process against a run of 50: 1 and 2 processes are below 150, 4 are not.
    run, generator = spread_until_ceiling(lambda p: 40.0 * p, measured, processes=1, most=8)
    assert runs == [1, 2, 4] and generator["processes"] == 4 and generator["ceiling_rule_met"]
    assert [t["ceiling_requests_per_s"] for t in generator["tries"]] == [40.0, 80.0, 160.0]
    # Where the most processes allowed do not reach it, the run says so.
    runs.clear()
    run, generator = spread_until_ceiling(lambda p: 40.0 * p, measured, processes=1, most=2)
    assert runs == [1, 2] and not generator["ceiling_rule_met"] and generator["ceiling_over_measured"] == 1.6
