"""A request's media load in the media pool's threads while its prompts are drafted (runtime/media_pool.py): media
are read before the prompts are checked (spec 1.3 step 8), and no media thread works on for a request that failed.
Each rule holds for both ways of waiting: in the calling thread (the CLI, `DecisionService.prepare`) and on the
event loop (the server)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable

import pytest

from systemone.models.errors import DecisionError
from systemone.runtime.media_allowance import MediaBudget, MediaBusy
from systemone.runtime.media_encoder import MediaEncoder
from systemone.runtime.media_errors import MediaError
from systemone.runtime.media_pool import MediaLoad, MediaPool
from tests.media_helpers import HeldMedia


def drafted(loading: MediaLoad, draft: Callable[[], str], waits_on: str):
    if waits_on == "thread":
        return loading.with_draft(draft)

    async def on_the_event_loop():
        return await loading.with_draft_async(asyncio.get_running_loop().run_in_executor(None, draft))
    return asyncio.run(on_the_event_loop())


@pytest.fixture
def pool():
    pool = MediaPool(workers=2)
    yield pool
    pool.close()


WAYS = ["thread", "event loop"]


@pytest.mark.parametrize("waits_on", WAYS)
def test_the_prompts_are_drafted_while_the_media_load(pool, waits_on):
    media = HeldMedia(seconds=0.2)

    def draft() -> str:
        assert media.started.wait(5) and not media.stopped.is_set()  # the image is loading now
        return "prompts"

    prompts, loaded = drafted(pool.begin(media, request=None), draft, waits_on)
    assert prompts == "prompts" and loaded.items == {"photo": "photo"}


def prompt_too_long(media: HeldMedia) -> Callable[[], str]:
    """A draft that fails on the request (its prompt too long for the model) once `media`'s job is loading."""
    def draft() -> str:
        assert media.started.wait(5)
        raise DecisionError("However, your prompt contains at least 21 input tokens")
    return draft


@pytest.mark.parametrize("waits_on", WAYS)
def test_a_media_error_wins_over_the_prompts_error(pool, waits_on):
    """Spec 1.3 step 8: the image is read before the prompt is checked, so its error is the one given."""
    media = HeldMedia(seconds=0.1, error="not an image")
    with pytest.raises(MediaError, match="images\\[0\\]: not an image"):
        drafted(pool.begin(media, request=None), prompt_too_long(media), waits_on)


@pytest.mark.parametrize("waits_on", WAYS)
def test_with_readable_media_the_prompts_error_is_given(pool, waits_on):
    media = HeldMedia(seconds=0.1)
    with pytest.raises(DecisionError, match="at least 21 input tokens"):
        drafted(pool.begin(media, request=None), prompt_too_long(media), waits_on)
    assert not media.stopped.is_set()  # waited for to its end, not stopped


@pytest.mark.parametrize("waits_on", WAYS)
def test_a_fault_in_the_draft_stops_the_requests_media_at_once(pool, waits_on):
    """Nothing will read this request's media: its job stops rather than hold a media thread for its whole time."""
    media = HeldMedia(seconds=30)

    def draft() -> str:
        assert media.started.wait(5)
        raise RuntimeError("a fault while drafting")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="a fault while drafting"):
        drafted(pool.begin(media, request=None), draft, waits_on)
    assert media.stopped.wait(2), "the media job ran on"
    while pool.running and time.monotonic() - start < 5:
        time.sleep(0.01)
    assert pool.running == 0 and time.monotonic() - start < 5


def test_stopping_a_requests_media_twice_counts_its_queued_job_out_once(pool):
    """The pool's queue depth (/ready, /metrics) stays right when a load is stopped by its waiter and again by its
    request (a timeout, then the client gone)."""
    busy = [HeldMedia(seconds=30) for _ in range(pool.workers)]
    held = [pool.begin(media, request=None) for media in busy]
    try:
        assert all(media.started.wait(5) for media in busy)  # every media thread taken
        queued = pool.begin(HeldMedia(seconds=30), request=None)
        assert pool.queued == 1
        queued.cancel()
        queued.cancel()
        assert pool.queued == 0
    finally:
        for load in held:
            load.cancel()


def test_a_cancelled_wait_on_the_event_loop_leaves_no_unread_error(pool, caplog):
    """A request whose wait for its media is cancelled (the client left) while a job still runs: the job ends with
    the request's error later, and asyncio has nothing to complain of."""
    media = HeldMedia(seconds=30)

    async def leave_while_loading():
        waiting = asyncio.ensure_future(pool.begin(media, request=None).result_async())
        await asyncio.to_thread(media.started.wait, 5)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await asyncio.to_thread(media.stopped.wait, 5)
        while pool.running:
            await asyncio.sleep(0.01)

    asyncio.run(leave_while_loading())
    gc.collect()
    assert "never retrieved" not in caplog.text


class Loads(MediaEncoder[str]):
    """Each key an image: `http...` keys are fetched (held until the test lets them go), the others loaded at
    once; each takes `pixels` from its account before it loads."""

    def __init__(self, keys: list[str], pixels: int = 0):
        super().__init__(session=None, policy=None)  # type: ignore[arg-type]  # never fetches nor runs a graph
        self.keys, self.pixels = keys, pixels
        self.release, self.started = threading.Event(), threading.Semaphore(0)
        self.running, self.most = 0, 0
        self._lock = threading.Lock()

    def jobs(self, request):
        return [(key, f"images[{i}]") for i, key in enumerate(self.keys)]

    def load_one(self, key, where, deadline, allowance, workers):
        if self.pixels:
            allowance.take_pixels(self.pixels, where, "Image")
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.started.release()
        try:
            if key.startswith("http"):
                deadline.on_cancel(self.release.set)
                self.release.wait(30)
            return key
        finally:
            with self._lock:
                self.running -= 1

    def rows(self, item, run_options):
        raise NotImplementedError


def test_inline_media_never_wait_behind_network_fetches():
    """Issue 50 item 6: six clients whose URLs answered 503 (each held a media thread through its retries' pauses)
    pushed other clients' inline images to a p50 of 28 s. Fetches over the network have threads of their own:
    with every one of them held, an inline image loads at once."""
    pool = MediaPool(workers=2)
    held = [Loads([f"http://slow/{i}.png"]) for i in range(4)]
    try:
        loads = [pool.begin(media, request=None) for media in held]
        assert all(media.started.acquire(timeout=5) for media in held[:2])  # both network threads held
        start = time.monotonic()
        inline = pool.begin(Loads(["data:image/png;base64,AAAA"]), request=None).result()
        assert inline.items == {"data:image/png;base64,AAAA": "data:image/png;base64,AAAA"}
        assert time.monotonic() - start < 2
    finally:
        for media in held:
            media.release.set()
        for load in loads:
            load.result()
        pool.close()


def test_one_request_loads_at_most_half_a_lanes_threads_at_once():
    """A request of 8 images on a lane of 4 threads: at most 2 of them load at once, so another request's image
    finds a thread."""
    pool = MediaPool(workers=4)
    media = Loads([f"http://slow/{i}.png" for i in range(8)])
    other = Loads(["http://other/0.png"])
    try:
        load = pool.begin(media, request=None)
        assert media.started.acquire(timeout=5) and media.started.acquire(timeout=5)
        other_load = pool.begin(other, request=None)
        assert other.started.acquire(timeout=5)  # a thread was left for it
        assert media.running == 2
        other.release.set()
        media.release.set()
        assert len(load.result().items) == 8 and other_load.result().items
        assert media.most == 2
    finally:
        media.release.set()
        other.release.set()
        pool.close()


def test_the_media_being_loaded_share_one_server_budget():
    """Issue 50 item 5: media memory was bounded per request only (8 requests of one 8300x8300 WebP each, under
    the request's pixel budget, reached 8.6 GB together). The items being loaded take their decoded pixels from the
    server's budget as well: past it a request is refused at once (503, naming the flag) rather than decode, and
    the pixels come back when an item's job ends."""
    pool = MediaPool(workers=4, budget=MediaBudget(pixels=20_000_000, server_pixels=30_000_000))
    first = Loads(["http://big/0.png"], pixels=16_000_000)
    try:
        loading = pool.begin(first, request=None)
        assert first.started.acquire(timeout=5) and pool.server.pixels == 16_000_000
        with pytest.raises(MediaBusy, match="--max-server-media-pixels") as refused:
            pool.begin(Loads(["data:image/png;base64,BBBB"], pixels=16_000_000), request=None).result()
        assert refused.value.retry_after_s == 1
        first.release.set()
        loading.result()
        assert pool.server.pixels == 0
        assert pool.begin(Loads(["data:image/png;base64,CCCC"], pixels=16_000_000), request=None).result().items
        assert pool.server.pixels == 0
    finally:
        first.release.set()
        pool.close()
