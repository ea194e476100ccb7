"""Long texts never take the server from other clients (README "Bounds under hostile load"): the tokenizer lets go
of the GIL while it reads a long prompt, so `/health` answers meanwhile, and requests of long texts are prepared in
their own lane, so requests of ordinary size never queue behind them for a parsing thread."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from systemone.server.app import ServerOptions
from tests.live_server import live_server

NOUL = {"type": "noul", "instructions": "Is it urgent?"}
GOOD = json.dumps({"state": "printer on fire", "questions": {"q": NOUL}}).encode()
JSON_HEADERS = {"Content-Type": "application/json"}


def cjk_body(chars: int) -> bytes:
    """A state of `chars` CJK characters written as JSON escapes (six bytes each): under d1's character bound,
    over its 128,000 tokens, so it is refused after it is tokenized (about 2 s for a million on two cores)."""
    return ('{"state": "' + "\\u4f60\\u597d" * (chars // 2) + '", "questions": {"q": {"type": "noul"}}}').encode()


def test_health_answers_while_a_long_state_is_tokenized(d1_service):
    """Issue 50 item 3: one over-long CJK state froze /health for 10.3 s (the tokenizer held the GIL). Here a state
    of a million CJK characters: /health, asked every 20 ms meanwhile, answers each time within 0.5 s."""
    with live_server(d1_service) as base:
        async def scenario():
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                long = asyncio.ensure_future(client.post("/v1/systemone", content=cjk_body(1_000_000),
                                                         headers=JSON_HEADERS))
                seconds = []
                while not long.done():
                    start = time.monotonic()
                    assert (await client.get("/health")).status_code == 200
                    seconds.append(time.monotonic() - start)
                    await asyncio.sleep(0.02)
                return await long, seconds
        answer, seconds = asyncio.run(scenario())
    assert answer.status_code == 400 and "maximum context length" in answer.text, answer.text[:300]
    assert len(seconds) > 10 and max(seconds) < 0.5, (len(seconds), max(seconds))


def test_requests_of_ordinary_size_never_queue_behind_long_texts(d1_service):
    """Issue 50 item 3: four clients looping requests of long states (each ending in a 400) pushed other requests'
    p50 to 20.5 s on d1. Four such requests at once (about 2 s of tokenizing each, one after another in their own
    lane): a one-question request sent meanwhile is answered within 1.5 s, five times over."""
    with live_server(d1_service, ServerOptions(request_timeout_s=60)) as base:
        async def scenario():
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                long = [asyncio.ensure_future(client.post("/v1/systemone", content=cjk_body(1_000_000),
                                                          headers=JSON_HEADERS)) for _ in range(4)]
                await asyncio.sleep(0.5)
                good = []
                for _ in range(5):
                    start = time.monotonic()
                    response = await client.post("/v1/systemone", content=GOOD, headers=JSON_HEADERS)
                    good.append((response.status_code, time.monotonic() - start))
                return good, await asyncio.gather(*long)
        good, long = asyncio.run(scenario())
    assert [status for status, _ in good] == [200] * 5 and max(s for _, s in good) < 1.5, good
    assert {r.status_code for r in long} == {400}
