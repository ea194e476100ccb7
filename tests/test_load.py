"""Bounded load on loopback: 64 concurrent clients, then 4x the configured capacity. Every request is
answered or refused with 503 + Retry-After; none fails, hangs or gets another 5xx."""

from __future__ import annotations

import asyncio

import pytest

from scripts.load_test import phase
from systemone.server.app import ServerOptions
from tests.live_server import live_server


@pytest.mark.parametrize("max_concurrency, max_queue, max_batch_rows", [(1, 4, 1), (4, 4, 4)])
def test_load_is_answered_or_refused_cleanly(d3_service, max_concurrency, max_queue, max_batch_rows):
    """One request at a time, and four admitted to the scheduler whose questions share calls of up to 4 rows."""
    capacity = max_concurrency + max_queue
    with live_server(d3_service, ServerOptions(max_concurrency=max_concurrency, max_queue=max_queue,
                                               max_batch_rows=max_batch_rows)) as url:
        for clients, per_client in ((64, 2), (4 * capacity, 3)):
            report = asyncio.run(phase(url, clients, per_client, timeout=120))
            assert report["failed"] == 0 and report["other_5xx"] == 0, report
            assert report["answered"] + report["refused_503"] == clients * per_client, report
            assert report["answered"] >= capacity
            assert "503 without Retry-After" not in report["statuses"]


def test_what_start_up_made_is_frozen_out_of_the_collectors_full_passes_while_serving(d3_service):
    """The garbage collector's full passes scan only what requests leave behind while the server runs (they held
    the GIL up to 80 ms each under load when they scanned the tokenizer and sessions too, scripts/gc_pauses.py);
    the objects are handed back when the app stops."""
    import gc

    import httpx

    assert gc.get_freeze_count() == 0
    with live_server(d3_service) as url:
        assert httpx.get(url + "/health").status_code == 200
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0
