"""The load generator behind `systemone bench --serve`: its request mix is valid for each family (every request
answered 200 by a live server), and what it reports counts what was answered."""

from __future__ import annotations

import asyncio

import pytest

from systemone.loadgen import RequestMix, closed_loop, server_metrics, work_shares
from tests.live_server import live_server


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
    assert summary["answered"] == sum(result.statuses.values()) >= len(mix.kinds)
    assert 1 <= result.questions / summary["answered"] <= 4
    assert summary["p50_ms"] <= summary["p99_ms"]
    # The server's own account of the run: its engine thread ran graphs part of the time (one lane cannot be
    # busy longer than the run), and media threads loaded the photos and videos.
    assert 0 < work["text_lane_busy"] <= 1.01 and work["text_lane_jobs_per_s"] > 0, work
    assert work["media_threads_loading"] > 0, work


def test_a_server_without_metrics_reports_no_work_shares():
    assert server_metrics("http://127.0.0.1:9/v1/systemone") == {}  # the discard port: nothing listens


def test_media_bytes_are_new_in_every_request():
    mix = RequestMix("d3")
    images = [mix.body(i)[1]["images"][0] for i in range(3, 3 + 5 * len(mix.kinds), len(mix.kinds))]
    assert len(set(images)) == len(images)


def test_the_text_only_kind_asks_one_question_about_a_text_state(d3_service):
    mix = RequestMix("d3", kinds=("text1",))
    bodies = [mix.body(i)[1] for i in range(8)]
    assert all(len(body["questions"]) == 1 and isinstance(body["state"], str) for body in bodies)
    assert not any("images" in body or "videos" in body for body in bodies)
    with live_server(d3_service) as base:
        result = asyncio.run(closed_loop(f"{base}/v1/systemone", mix, clients=2, seconds=2.0))
    assert set(result.statuses) == {200} and result.questions == result.summary()["answered"] > 0
