"""`systemone bench --serve URL`: N clients in a closed loop against a running server, with the seeds' request mix
(text states, JSON states, a 40-option choice, a photo-sized JPEG and about 10 s of 720p video, new bytes every
request, 1 to 4 questions each). It reports requests/s, questions/s, p50/p99 latency and every non-200, per
client count, and runs the same requests against a reference server when one is given.

The client is a small HTTP/1.1 keep-alive client on asyncio streams, so it runs where only the standard library,
numpy and Pillow are installed (the lent GPU machine has no httpx).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit
from urllib.request import urlopen

import numpy as np
from PIL import Image

from .gpu_memory import PeakSampler, held_mib

KINDS = ("text", "json", "choice40", "image", "video")  # the seeds' mix
# Besides the mix: a text state with exactly one question (the text-only throughput figure).
ALL_KINDS = (*KINDS, "text1")
PHOTO = (1280, 960)
VIDEO = (1280, 720, 20)  # 20 frames at the server's 2 fps sampling: 10 s


def _jpeg(rgb: np.ndarray, quality: int = 85) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _tagged(jpeg: bytes, tag: bytes) -> bytes:
    """The same image with a comment segment after the start marker: new bytes, the same pixels, no re-encode."""
    return jpeg[:2] + b"\xff\xfe" + (len(tag) + 2).to_bytes(2, "big") + tag + jpeg[2:]


def _gradient(width: int, height: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)


class RequestMix:
    """Request bodies in a fixed rotation of kinds; media bytes differ in every request (a tagged comment segment,
    so no cache keyed on bytes can answer twice), pixels from a few noisy photo and video bases."""

    def __init__(self, family: str, seed: int = 0, kinds: tuple[str, ...] = KINDS):
        self.family = family
        self.rng = np.random.default_rng(seed)
        # d1 takes images only and at most 26 options (its letter codes).
        self.kinds = tuple(k for k in kinds if not (family == "d1" and k == "video"))
        self.max_options = 40 if family == "d3" else 26
        photo = _gradient(*PHOTO)
        self.photos = [_jpeg(self._noisy(photo)) for _ in range(4)]
        width, height, frames = VIDEO
        self.frames = [_jpeg(self._noisy(np.roll(_gradient(width, height), 8 * i, axis=1))) for i in range(frames)]

    def _noisy(self, rgb: np.ndarray) -> np.ndarray:
        out = rgb.copy()
        out[:64, :64] = self.rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        return out

    def _tag(self, i: int) -> bytes:
        return f"request {i} ".encode() + self.rng.bytes(8)

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
        kind = self.kinds[i % len(self.kinds)]
        body: dict[str, Any] = {"questions": self._questions(i, kind)}
        if kind == "json":
            body["state"] = {"ticket": f"Order {1000 + i} arrived late", "tier": "gold", "items": list(range(i % 20))}
        else:
            body["state"] = f"Customer message {i}: the parcel arrived late and the box was crushed."
        if kind == "image":
            photo = _tagged(self.photos[i % len(self.photos)], self._tag(i))
            body["images"] = ["data:image/jpeg;base64," + base64.b64encode(photo).decode()]
        if kind == "video":
            frames = (_tagged(self.frames[0], self._tag(i)), *self.frames[1:])
            body["videos"] = ["data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)]
        return kind, body


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
class LoadResult:
    seconds: float
    latencies: list[float] = field(default_factory=list)
    questions: int = 0
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        ok = len(self.latencies)
        ms = np.asarray(self.latencies) * 1000.0 if ok else np.zeros(1)
        return {"seconds": self.seconds, "answered": ok, "requests_per_s": ok / self.seconds,
                "questions_per_s": self.questions / self.seconds, "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)), "statuses": dict(self.statuses),
                "non_200": {str(k): v for k, v in self.statuses.items() if k != 200}, "errors": dict(self.errors)}


async def closed_loop(url: str, mix: RequestMix, clients: int, seconds: float, model: str | None = None,
                      keep: Callable[[dict[str, Any], bytes], None] | None = None) -> LoadResult:
    """`clients` connections, each sending its next request as soon as the last is answered, for `seconds`;
    `keep(body, payload)` sees each answered request and its 200's payload."""
    result = LoadResult(seconds)
    deadline = time.monotonic() + seconds
    counter = iter(range(10**9))

    async def client() -> None:
        http = HttpClient(url)
        try:
            while time.monotonic() < deadline:
                _, body = mix.body(next(counter))
                if model:
                    body["model"] = model
                payload = json.dumps(body).encode()
                start = time.perf_counter()
                try:
                    status, answer = await http.post(payload)
                except (OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
                    result.errors[type(exc).__name__] += 1
                    await http.close()
                    continue
                result.statuses[status] += 1
                if status == 200:
                    result.latencies.append(time.perf_counter() - start)
                    result.questions += len(body["questions"])
                    if keep is not None:
                        keep(body, answer)
        finally:
            await http.close()

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    result.seconds = time.monotonic() - start
    return result


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
             reference: str | None = None, kinds: tuple[str, ...] = KINDS,
             pids: dict[str, int] | None = None) -> dict[str, Any]:
    """The mix at each client count against `url` (and `reference`, when given, on the same requests); where a
    server has /metrics, its work shares during each run. With `pids` (the servers' processes by name, "server"
    and "reference"; may be empty), the most GPU memory each held and the device held in all during each run, and
    what they held before the first (nvidia-smi)."""
    report: dict[str, Any] = {"family": family, "kinds": list(kinds), "runs": {}}
    targets = {"server": url, **({"reference": reference} if reference else {})}
    sample = pids is not None
    if sample:
        report["gpu_memory_mib_before_load"] = held_mib(pids)
    for name, target in targets.items():
        for count in clients:
            before = server_metrics(target)
            memory = PeakSampler(lambda: held_mib(pids)) if sample else nullcontext()
            with memory:
                result = asyncio.run(closed_loop(target, RequestMix(family, 0, kinds), count, seconds, model))
            run = report["runs"][f"{name}@{count}"] = result.summary()
            if before:
                run["work"] = work_shares(before, server_metrics(target), result.seconds)
            if sample:
                run["gpu_memory_mib_peak"] = memory.peaks
            print(f"{name:9s} {count:3d} clients: {json.dumps(run)}", flush=True)
    return report
