"""`systemone bench --serve URL`: N clients in a closed loop against a running server, with the seeds' request mix
(text states, JSON states, a 40-option choice, a photo-sized JPEG and about 10 s of 720p video as 20 pre-sampled
JPEG frames, 1 to 4 questions each; besides the mix, `mp4`: the same 10 s of video as a real MPEG-4 file, as users
send it, and `text1`). It reports requests/s, questions/s, p50/p99 latency and every other outcome (a status, a
connection error, a client timeout, a 200 that does not answer every question asked), per kind and in all, per
client count, and runs the same mix against a reference server when one is given.

No cache can answer it: every run has its own nonce, which every state and media item carries, and every photo and
every frame of every JPEG-frame video is new bytes and new pixels in every request (its quantisation table is
changed, a free change: nothing is re-encoded). An MP4 is new bytes in every request (a `free` box with the nonce
and the request's number); its pixels come from a few clips encoded at start, since encoding one takes seconds.

It is never the bottleneck: before each run its own ceiling is measured on the same mix against a stub server that
answers at once, and printed beside the run; where the ceiling is below 3x the rate it measures, the run is made
again with the clients spread over twice the processes (up to `max_processes`).

The client is a small HTTP/1.1 keep-alive client on asyncio streams, so it runs where only the standard library,
numpy, Pillow and OpenCV are installed (the lent GPU machine has no httpx).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import io
import json
import multiprocessing
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from queue import Empty
from typing import Any
from urllib.parse import urlsplit
from urllib.request import urlopen

import numpy as np
from PIL import Image

from .gpu_memory import PeakSampler, held_mib
from .models.registry import FAMILIES

KINDS = ("text", "json", "choice40", "image", "video")  # the seeds' mix
# Besides the mix: the video as an MPEG-4 file, and a text state with exactly one question (the text-only
# throughput figure).
ALL_KINDS = (*KINDS, "mp4", "text1")
VIDEO_KINDS = ("video", "mp4")
PHOTO = (1280, 960)
VIDEO = (1280, 720, 20)  # 20 frames at the server's 2 fps sampling: 10 s
VIDEO_FILE = (1280, 720, 30, 10)  # width, height, fps, seconds of the MP4 kind's clips
DEFAULT_TIMEOUT_S = 90.0  # past serve's default --request-timeout (60 s), so a server's own 503 comes first
CEILING_OVER_MEASURED = 3.0  # the generator's ceiling must be at least this many times the rate it measures

# The seeds' published figures (MI300X): requests/s of their mix at 1 / 8 / 64 closed-loop clients.
PUBLISHED_SOURCE = "the seeds' published figures (MI300X)"
PUBLISHED_CLIENTS = (1, 8, 64)
PUBLISHED = {"d3-nano": {"vLLM": (11.1, 52.8, 59.8), "own server": (14.2, 20.7, 16.5)},
             "d3-mini": {"vLLM": (10.4, 37.1, 35.7), "own server": (11.4, 16.2, 12.7)}}

# Luma quantisation entries (zigzag order) a request's number is written into, two bits each: low AC frequencies,
# non-zero in nearly every block, so every value decodes to other pixels.
_REQUANTIZED = range(1, 25)


def _jpeg(rgb: np.ndarray, quality: int = 85) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _tagged(jpeg: bytes, tag: bytes) -> bytes:
    """The same image with a comment segment after the start marker: new bytes, the same pixels, no re-encode."""
    return jpeg[:2] + b"\xff\xfe" + (len(tag) + 2).to_bytes(2, "big") + tag + jpeg[2:]


def _requantized(jpeg: bytes, value: int) -> bytes:
    """The JPEG with its luma quantisation table changed by `value` (two bits into each of 24 entries): the same
    coded coefficients dequantised otherwise, so other pixels, a distinct table for each value below 4**24."""
    out = bytearray(jpeg)
    at = 2
    while at + 4 <= len(out) and out[at] == 0xFF and out[at + 1] not in (0xDA, 0xD9):  # up to the scan
        length = int.from_bytes(out[at + 2:at + 4], "big")
        if out[at + 1] == 0xDB:  # DQT: tables of (precision << 4 | id, 64 entries)
            table, end = at + 4, at + 2 + length
            while table < end:
                precision, ident = out[table] >> 4, out[table] & 0x0F
                if ident == 0 and precision == 0:
                    for bit, entry in enumerate(_REQUANTIZED):
                        out[table + 1 + entry] = min(255, out[table + 1 + entry] + (value >> 2 * bit & 3))
                table += 1 + 64 * (2 if precision else 1)
        at += 2 + length
    return bytes(out)


def _gradient(width: int, height: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)


def _mp4(width: int, height: int, fps: int, seconds: int, seed: int) -> bytes:
    """A clip of moving content: a gradient panning and a block of noise crossing it, every frame different."""
    import cv2

    rng = np.random.default_rng(seed)
    base, noise = _gradient(width, height), rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (width, height))
        for i in range(fps * seconds):
            frame = np.roll(base, 4 * i + 97 * seed, axis=1)
            x = (8 * i + 131 * seed) % max(1, width - 64)
            frame[height // 4:height // 4 + 64, x:x + 64] = noise
            writer.write(frame)
        writer.release()
        with open(path, "rb") as f:
            return f.read()


@functools.lru_cache(maxsize=2)
def _clips(width: int, height: int, fps: int, seconds: int, count: int) -> tuple[bytes, ...]:
    return tuple(_mp4(width, height, fps, seconds, seed) for seed in range(count))


def _boxed(mp4: bytes, tag: bytes) -> bytes:
    """The file with a `free` box after its last: new bytes, which every MP4 reader skips."""
    return mp4 + (len(tag) + 8).to_bytes(4, "big") + b"free" + tag


class RequestMix:
    """Request bodies in a fixed rotation of kinds, each carrying the run's nonce; every photo and JPEG frame with
    a quantisation table of its own (new bytes, new pixels) from a few noisy photo and video bases."""

    def __init__(self, family: str, seed: int = 0, kinds: tuple[str, ...] = KINDS, nonce: str | None = None,
                 video_file: tuple[int, int, int, int] = VIDEO_FILE, clips: int = 4):
        self.family = family
        self.rng = np.random.default_rng(seed)
        # Only the kinds the family takes, and no more options than every checkpoint of it does (d1: images, 26).
        contract = FAMILIES.get(family).contract
        self.kinds = tuple(k for k in kinds if "video" in contract.modalities or k not in VIDEO_KINDS)
        self.max_options = min(40, contract.most_options or 40)
        self.nonce = nonce or secrets.token_hex(8)
        self.process, self.processes = 0, 1
        # Only the kinds asked for: the bases take seconds to encode.
        photo = _gradient(*PHOTO) if "image" in self.kinds else None
        self.photos = [_jpeg(self._noisy(photo)) for _ in range(4)] if photo is not None else []
        width, height, frames = VIDEO
        self.frames = ([_jpeg(self._noisy(np.roll(_gradient(width, height), 8 * i, axis=1))) for i in range(frames)]
                       if "video" in self.kinds else [])
        self.clips = _clips(*video_file, clips) if "mp4" in self.kinds else ()

    def renewed(self) -> RequestMix:
        """The same mix (the same base media) with a nonce of its own: another run's."""
        mix = object.__new__(RequestMix)
        mix.__dict__.update(self.__dict__, nonce=secrets.token_hex(8), rng=np.random.default_rng(secrets.randbits(64)))
        return mix

    def part(self, process: int, processes: int) -> RequestMix:
        """The mix of one of `processes` generator processes: request i there is request i * processes + process
        of the run, so no two processes send the same request."""
        mix = object.__new__(RequestMix)
        mix.__dict__.update(self.__dict__, process=process, processes=processes,
                            rng=np.random.default_rng([process, secrets.randbits(64)]))
        return mix

    def _noisy(self, rgb: np.ndarray) -> np.ndarray:
        out = rgb.copy()
        out[:64, :64] = self.rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        return out

    def _media(self, jpeg: bytes, serial: int, index: int) -> bytes:
        """Item `index` of request `serial`: a table no other request of any run has (the run's nonce offsets the
        values), and the nonce and request in a comment."""
        value = (int(self.nonce, 16) + serial * 64 + index) % 4 ** len(_REQUANTIZED)
        return _tagged(_requantized(jpeg, value), f"run {self.nonce} request {serial} item {index}".encode())

    def _questions(self, i: int, kind: str) -> dict[str, Any]:
        count = 1 if kind == "text1" else 1 + i % 4
        questions: dict[str, Any] = {}
        for q in range(count):
            if kind == "choice40" and q == 0:
                questions["pick"] = {"type": "choice", "instructions": "Which category fits best?",
                                     "criteria": {f"category {k}": None for k in range(self.max_options)}}
            elif q % 3 == 0:
                questions[f"q{q}"] = {"type": "noul", "instructions": "Does this need a human?"}
            elif q % 3 == 1:
                questions[f"q{q}"] = {"type": "choice", "instructions": "Which team?",
                                      "criteria": {"billing": "money", "support": None, "sales": None}}
            else:
                questions[f"q{q}"] = {"type": "score", "criteria": ["calm", "annoyed", "furious"]}
        return questions

    def body(self, i: int) -> tuple[str, dict[str, Any]]:
        """The kind and body of this process's request `i`."""
        kind = self.kinds[i % len(self.kinds)]
        serial = i * self.processes + self.process
        body: dict[str, Any] = {"questions": self._questions(i, kind)}
        if kind == "json":
            body["state"] = {"ticket": f"Order {1000 + serial} arrived late", "tier": "gold", "run": self.nonce,
                             "items": list(range(i % 20))}
        else:
            body["state"] = (f"Customer message {serial} (run {self.nonce}): the parcel arrived late and the box "
                             "was crushed.")
        if kind == "image":
            photo = self._media(self.photos[i % len(self.photos)], serial, 0)
            body["images"] = ["data:image/jpeg;base64," + base64.b64encode(photo).decode()]
        if kind == "video":
            frames = [self._media(frame, serial, k) for k, frame in enumerate(self.frames)]
            body["videos"] = ["data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)]
        if kind == "mp4":
            clip = _boxed(self.clips[serial % len(self.clips)], f"run {self.nonce} request {serial}".encode())
            body["videos"] = ["data:video/mp4;base64," + base64.b64encode(clip).decode()]
        return kind, body


def answers_every_question(body: dict[str, Any], payload: bytes) -> bool:
    """Whether a 200's payload answers each question `body` asked, and no other, each with its probabilities."""
    try:
        answers = json.loads(payload)["answers"]
    except (ValueError, TypeError, KeyError):
        return False
    return (isinstance(answers, dict) and answers.keys() == body["questions"].keys()
            and all(isinstance(a, dict) and a.get("probabilities") for a in answers.values()))


class HttpClient:
    """One keep-alive HTTP/1.1 connection posting JSON."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path = parts.path or "/"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            await self.close()
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        length, close = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and value.strip().lower() == "close":
                close = True
        payload = await self.reader.readexactly(length)
        if close:
            await self.close()
        return status, payload

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@dataclass
class KindResult:
    """One kind's outcomes in a run: every request sent ends as exactly one of them."""

    latencies: list[float] = field(default_factory=list)  # of the 200s that answered every question
    questions: int = 0  # the questions those answered
    statuses: Counter = field(default_factory=Counter)  # every HTTP status received
    errors: Counter = field(default_factory=Counter)  # connection errors, by exception name
    timeouts: int = 0  # no answer within the client timeout
    incomplete: int = 0  # a 200 that did not answer every question asked

    def merge(self, other: KindResult) -> None:
        self.latencies += other.latencies
        self.questions += other.questions
        self.statuses.update(other.statuses)
        self.errors.update(other.errors)
        self.timeouts += other.timeouts
        self.incomplete += other.incomplete

    def summary(self, seconds: float) -> dict[str, Any]:
        ok = len(self.latencies)
        ms = np.asarray(self.latencies) * 1000.0 if ok else np.zeros(1)
        return {"answered": ok, "requests_per_s": ok / seconds, "questions_per_s": self.questions / seconds,
                "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                "statuses": {str(k): v for k, v in self.statuses.items()},
                "non_200": {str(k): v for k, v in self.statuses.items() if k != 200}, "errors": dict(self.errors),
                "timeouts": self.timeouts, "incomplete": self.incomplete}


@dataclass
class LoadResult:
    seconds: float
    kinds: dict[str, KindResult] = field(default_factory=dict)

    def kind(self, name: str) -> KindResult:
        return self.kinds.setdefault(name, KindResult())

    def total(self) -> KindResult:
        total = KindResult()
        for result in self.kinds.values():
            total.merge(result)
        return total

    @property
    def latencies(self) -> list[float]:
        return self.total().latencies

    @property
    def questions(self) -> int:
        return self.total().questions

    @property
    def statuses(self) -> Counter:
        return self.total().statuses

    @property
    def errors(self) -> Counter:
        return self.total().errors

    @property
    def timeouts(self) -> int:
        return self.total().timeouts

    @property
    def incomplete(self) -> int:
        return self.total().incomplete

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies) / self.seconds

    @staticmethod
    def merged(results: list[LoadResult]) -> LoadResult:
        """The results of processes that ran over the same window, as one run."""
        merged = LoadResult(max(r.seconds for r in results))
        for result in results:
            for name, kind in result.kinds.items():
                merged.kind(name).merge(kind)
        return merged

    def summary(self) -> dict[str, Any]:
        return {"seconds": self.seconds, **self.total().summary(self.seconds),
                "kinds": {name: kind.summary(self.seconds) for name, kind in sorted(self.kinds.items())}}


async def closed_loop(url: str, mix: RequestMix, clients: int, seconds: float, model: str | None = None,
                      keep: Callable[[dict[str, Any], bytes], None] | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S, requests: int | None = None) -> LoadResult:
    """`clients` connections, each sending its next request as soon as the last is answered (or given up after
    `timeout_s`: the connection is then closed and a new one opened), for `seconds` (and no more than `requests`
    requests in all, where given); `keep(body, payload)` sees each request answered in full and its payload."""
    result = LoadResult(seconds)
    deadline = time.monotonic() + seconds
    counter = iter(range(10**9) if requests is None else range(requests))

    async def client() -> None:
        http = HttpClient(url)
        try:
            while time.monotonic() < deadline:
                number = next(counter, None)
                if number is None:
                    break
                kind, body = mix.body(number)
                if model:
                    body["model"] = model
                payload = json.dumps(body).encode()
                outcome = result.kind(kind)
                start = time.perf_counter()
                try:
                    status, answer = await asyncio.wait_for(http.post(payload), timeout_s)
                except TimeoutError:  # before OSError, of which it is one
                    outcome.timeouts += 1
                    await http.close()
                    continue
                except (OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
                    outcome.errors[type(exc).__name__] += 1
                    await http.close()
                    continue
                latency = time.perf_counter() - start
                outcome.statuses[status] += 1
                if status != 200:
                    continue
                if not answers_every_question(body, answer):
                    outcome.incomplete += 1
                    continue
                outcome.latencies.append(latency)
                outcome.questions += len(body["questions"])
                if keep is not None:
                    keep(body, answer)
        finally:
            await http.close()

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    result.seconds = time.monotonic() - start
    return result


def _process_run(ready: Any, go: Any, results: Any, url: str, mix: RequestMix, clients: int, seconds: float,
                 model: str | None, timeout_s: float) -> None:
    """One generator process: ready once imported and given its mix, then its share of the clients from `go`."""
    ready.put(mix.process)
    go.wait()
    results.put(asyncio.run(closed_loop(url, mix, clients, seconds, model, timeout_s=timeout_s)))


def generate(url: str, mix: RequestMix, clients: int, seconds: float, processes: int = 1, model: str | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> LoadResult:
    """The closed loop with its clients spread over `processes` processes (at most one a client), which start
    together once every one is ready; their outcomes as one run."""
    processes = max(1, min(processes, clients))
    if processes == 1:
        return asyncio.run(closed_loop(url, mix, clients, seconds, model, timeout_s=timeout_s))
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads (a GPU memory sampler)
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    workers = [context.Process(target=_process_run, daemon=True,
                               args=(ready, go, results, url, mix.part(k, processes),
                                     clients // processes + (k < clients % processes), seconds, model, timeout_s))
               for k in range(processes)]
    for worker in workers:
        worker.start()

    def collect(queue: Any, seconds: float) -> list[Any]:
        got, end = [], time.monotonic() + seconds
        while len(got) < len(workers):
            try:
                got.append(queue.get(timeout=0.5))
            except Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead or time.monotonic() > end:
                    raise RuntimeError(f"the load generator's processes stopped (exit codes {dead}) or took over "
                                       f"{seconds:.0f} s") from None
        return got

    try:
        collect(ready, 120)
        go.set()
        outcome = LoadResult.merged(collect(results, seconds + timeout_s + 120))
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
    return outcome


def warm_up(url: str, mix: RequestMix, clients: int, seconds: float, model: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S, every_kind: bool = True) -> dict[str, Any]:
    """Load that is not measured, before a measured run: with `every_kind`, one request of each of the mix's kinds,
    one after another; then `seconds` of `clients` clients. Work a server does once per shape (the reference
    server's Triton kernels compile on a shape's first request: 42 s for d3-nano's first on an H100) falls here, not
    in the run measured after it. What it answered, and how long it took."""
    done: dict[str, Any] = {}
    if every_kind:
        first = asyncio.run(closed_loop(url, mix.renewed(), 1, len(mix.kinds) * timeout_s, model,
                                        timeout_s=timeout_s, requests=len(mix.kinds)))
        done["every_kind"] = {"seconds": round(first.seconds, 2), "answered": len(first.latencies),
                              "statuses": {str(k): v for k, v in sorted(first.statuses.items())}}
    load = asyncio.run(closed_loop(url, mix.renewed(), clients, seconds, model, timeout_s=timeout_s))
    done["load"] = {"seconds": round(load.seconds, 2), "answered": len(load.latencies)}
    return done


# -- the stub server the generator's ceiling is measured against ---------------------------------------------------
def stub_answer(body: bytes) -> bytes:
    """A response of the server's shape answering every question of `body`, at once."""
    request = json.loads(body)
    answers = {qid: {"type": q.get("type"), "probabilities": {"yes": 0.5, "no": 0.5}, "confidence": 0.5}
               for qid, q in request["questions"].items()}
    return json.dumps({"id": "decision-stub", "object": "structured_decision", "model": "stub",
                       "answers": answers, "usage": {"input_tokens": 0, "output_tokens": 0}}).encode()


async def _stub_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while request := await reader.readline():
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            try:
                status, payload = (b"200 OK", stub_answer(body)) if request.startswith(b"POST ") else (b"404 Not Found",
                                                                                                    b"{}")
            except (ValueError, KeyError, TypeError, AttributeError):
                status, payload = b"400 Bad Request", b"{}"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _serve_stub(port: int) -> None:
    server = await asyncio.start_server(_stub_connection, "127.0.0.1", port, reuse_port=True, backlog=1024)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


@contextmanager
def stub_server(processes: int = 1) -> Iterator[str]:
    """The endpoint of `processes` stub server processes sharing one port (SO_REUSEPORT), stopped on exit."""
    command = [sys.executable, "-m", "systemone.loadgen", "--stub-port"]
    started: list[subprocess.Popen] = []
    try:
        port = "0"
        for _ in range(max(1, processes)):
            started.append(subprocess.Popen([*command, port], stdout=subprocess.PIPE, text=True))
            line = started[-1].stdout.readline()
            if not line.startswith("port "):
                raise RuntimeError("the load generator's stub server did not start")
            port = line.split()[1]
        yield f"http://127.0.0.1:{port}/v1/systemone"
    finally:
        for process in started:
            process.terminate()
            process.wait(timeout=10)


def ceiling(stub: str, mix: RequestMix, clients: int, processes: int, seconds: float) -> float:
    """Requests/s the generator reaches on `mix` with `clients` over `processes` against the stub at `stub`: its
    own ceiling, since the stub answers at once."""
    return generate(stub, mix.renewed(), clients, seconds, processes).requests_per_s


def spread_until_ceiling(ceiling_of: Callable[[int], float],
                         measured: Callable[[int], tuple[LoadResult, dict[str, Any]]], processes: int,
                         most: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run (`measured(processes)`: its result and report) made with `processes` generator processes, and again
    with twice as many (up to `most`) while the generator's ceiling with that many (`ceiling_of`) is below 3x the
    rate the run measured; the last run's report and the generator's account of it."""
    spread, tries = max(1, min(processes, most)), []
    while True:
        top = ceiling_of(spread)
        result, run = measured(spread)
        rate = result.requests_per_s
        tries.append({"processes": spread, "ceiling_requests_per_s": top, "requests_per_s": rate})
        if top >= CEILING_OVER_MEASURED * rate or spread >= most:
            break
        spread = min(2 * spread, most)
    return run, {"processes": spread, "ceiling_requests_per_s": top,
                 "ceiling_over_measured": top / rate if rate else None,
                 "ceiling_rule_met": top >= CEILING_OVER_MEASURED * rate, "tries": tries}


def published_table(size: str, runs: dict[str, Any], clients: tuple[int, ...]) -> list[str]:
    """Each client count's requests/s of this run's servers beside the seeds' published figures for `size`."""
    figures = PUBLISHED[size]
    names = sorted({name.split("@")[0] for name in runs})
    lines = [f"requests/s, {size}: this run beside {PUBLISHED_SOURCE}",
             f"{'clients':>8s}" + "".join(f"{n:>12s}" for n in names) + "".join(f"{n:>12s}" for n in figures)]
    for count in sorted({*clients, *PUBLISHED_CLIENTS}):
        ours = "".join(f"{runs[f'{n}@{count}']['requests_per_s']:12.1f}" if f"{n}@{count}" in runs else f"{'-':>12s}"
                       for n in names)
        theirs = "".join(f"{values[PUBLISHED_CLIENTS.index(count)]:12.1f}" if count in PUBLISHED_CLIENTS
                         else f"{'-':>12s}" for values in figures.values())
        lines.append(f"{count:8d}{ours}{theirs}")
    return lines


def server_metrics(url: str) -> dict[str, float]:
    """The counters and gauges of the server's /metrics (beside `url`), by name with labels; empty where it has
    none (the reference server)."""
    parts = urlsplit(url)
    try:
        with urlopen(f"{parts.scheme}://{parts.netloc}/metrics", timeout=10) as response:
            text = response.read().decode()
    except (OSError, ValueError):
        return {}
    samples = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            samples[name] = float(value)
    return samples


def work_shares(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Where the server's time went during a run, from its counters: each scheduler lane's busy share of the wall
    time (text near 1: the text graph is the bound) and the media threads loading on average."""
    counters = {f"{lane}_lane_{share}": f'systemone_engine_{counter}_total{{lane="{lane}"}}'
                for share, counter in (("busy", "busy_seconds"), ("jobs_per_s", "jobs")) for lane in ("text", "media")}
    counters["media_threads_loading"] = "systemone_media_load_seconds_total"
    return {share: (after[name] - before.get(name, 0.0)) / seconds for share, name in counters.items() if name in after}


def run_load(url: str, family: str, clients: tuple[int, ...], seconds: float, model: str | None = None,
             reference: str | None = None, kinds: tuple[str, ...] = KINDS, pids: dict[str, int] | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, processes: int = 1, max_processes: int | None = None,
             ceiling_seconds: float = 5.0, published: str | None = None,
             mix: RequestMix | None = None, warm_up_s: float = 5.0) -> dict[str, Any]:
    """The mix at each client count against `url` (and `reference`, when given, on the same mix), each run with a
    nonce of its own and the generator's ceiling beside it; where a server has /metrics, its work shares during
    each run. Before each run, `warm_up` at its client count for `warm_up_s` (each kind once first, before a
    server's first run; 0: none); the servers take turns at each client count, who goes first alternating. With
    `pids` (the servers' processes by name, "server" and "reference"; may be empty), the most GPU memory each held
    and the device held in all during each run, and what they held before the first (nvidia-smi). With `published` (a checkpoint size), the seeds' published figures beside the runs."""
    most = max_processes or max(1, (os.cpu_count() or 2) // 2)
    base = mix or RequestMix(family, 0, kinds)
    report: dict[str, Any] = {"family": family, "kinds": list(base.kinds), "client_timeout_s": timeout_s, "runs": {}}
    targets = {"server": url, **({"reference": reference} if reference else {})}
    sample = pids is not None
    if sample:
        report["gpu_memory_mib_before_load"] = held_mib(pids)
    ceilings: dict[tuple[int, int], float] = {}
    warmed: set[str] = set()
    with stub_server(most) as stub:
        for index, count in enumerate(clients):
            for name in (list(targets) if index % 2 == 0 else list(targets)[::-1]):
                target = targets[name]
                warm = None
                if warm_up_s > 0:
                    warm = warm_up(target, base, count, warm_up_s, model, timeout_s, every_kind=name not in warmed)
                    warmed.add(name)

                def ceiling_of(spread: int, count: int = count) -> float:
                    if (count, spread) not in ceilings:
                        ceilings[count, spread] = ceiling(stub, base, count, spread, ceiling_seconds)
                    return ceilings[count, spread]

                def measured(spread: int, target: str = target, count: int = count) -> tuple[LoadResult, Any]:
                    before = server_metrics(target)
                    memory = PeakSampler(lambda: held_mib(pids)) if sample else nullcontext()
                    with memory:
                        result = generate(target, base.renewed(), count, seconds, spread, model, timeout_s)
                    run = result.summary()
                    if before:
                        run["work"] = work_shares(before, server_metrics(target), result.seconds)
                    if sample:
                        run["gpu_memory_mib_peak"] = memory.peaks
                    return result, run

                run, generator = spread_until_ceiling(ceiling_of, measured, min(processes, count), min(count, most))
                report["runs"][f"{name}@{count}"] = {**run, "generator": generator,
                                                     **({"warm_up": warm} if warm is not None else {})}
                print(f"{name:9s} {count:3d} clients: {run['requests_per_s']:.1f} requests/s; generator ceiling "
                      f"{generator['ceiling_requests_per_s']:.1f} requests/s ({generator['processes']} process(es), "
                      f"{generator['ceiling_over_measured'] or 0:.1f}x the rate"
                      f"{'' if generator['ceiling_rule_met'] else ', BELOW 3x: the generator may bound it'}): "
                      f"{json.dumps(report['runs'][f'{name}@{count}'])}", flush=True)
    if published:
        report["published"] = {"source": PUBLISHED_SOURCE, "size": published, "clients": list(PUBLISHED_CLIENTS),
                               "requests_per_s": PUBLISHED[published],
                               "same_kinds": tuple(base.kinds) == KINDS}
        for line in published_table(published, report["runs"], clients):
            print(line, flush=True)
        if tuple(base.kinds) != KINDS:
            print(f"(this run's kinds {' '.join(base.kinds)} are not the seeds' mix {' '.join(KINDS)})", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description="the load generator's stub server (its ceiling's measure)")
    parser.add_argument("--stub-port", type=int, required=True, help="port to bind (0: any; shared by reuse)")
    asyncio.run(_serve_stub(parser.parse_args().stub_port))


if __name__ == "__main__":
    main()
