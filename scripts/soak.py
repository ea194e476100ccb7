"""Soak test on loopback: `systemone serve` on an artifact, good requests mixed with every hostile input the
bounds of docs/operations.md cover, for a bounded time. Reports the server's RSS over time (each minute also by kind of
mapping, and its floor in each window), status counts per kind of request (5xx only as an overloaded server's 503
for an attack; slow media end at their fetch deadline, 422) and the good requests' latency percentiles, overall and
per window.

    python scripts/soak.py ARTIFACT [--minutes 20] [--attackers 3] [--only KIND,KIND] [-- SERVE FLAGS]

Everything stays on 127.0.0.1: the server, media servers that drip bytes, answer 503 or send too much, and the
attack traffic. A raw-HTTP attack is counted by what it saw (a status, "no answer", or "N of M closed").
"""

from __future__ import annotations

import argparse
import base64
import gzip
import io
import itertools
import json
import math
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from PIL import Image

from systemone.local_server import free_port, resident_by_mapping, rss_mb, serve_command, start_server

NOUL = {"type": "noul", "instructions": "Is it urgent?"}
GOOD = {"state": {"ticket": "printer on fire", "priority": "high"},
        "questions": {"q": NOUL, "c": {"type": "choice", "instructions": "Which team?",
                                       "criteria": {"hardware": None, "software": None, "facilities": None}}}}
SAMPLE_S = 5  # between RSS samples
MAPPING_EVERY = 60 // SAMPLE_S  # RSS samples between two by-mapping samples: a minute


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


class Drip(BaseHTTPRequestHandler):
    """Declares 100 MB and sends a byte a second."""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(100 << 20))
        self.end_headers()
        try:
            for _ in range(600):
                self.wfile.write(b"\x89")
                self.wfile.flush()
                time.sleep(1)
        except OSError:
            pass

    def log_message(self, *args):
        pass


class Failing(BaseHTTPRequestHandler):
    """Answers 503 at once: a fetch tries it again 1 s, then 4 s later."""

    def do_GET(self):  # noqa: N802
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Endless(BaseHTTPRequestHandler):
    """300 MiB with no declared length: refused at --max-media-bytes (or the server's media budget)."""

    protocol_version = "HTTP/1.0"

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        block = b"\0" * (1 << 20)
        try:
            for _ in range(300):
                self.wfile.write(block)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def raw(port: int, data: bytes, wait_s: float = 0.2, then: bytes = b"") -> str:
    """Send `data`, wait, send `then`; the status of the first response the server sent meanwhile, or what
    happened to the connection ("no answer": it is still open, "closed")."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        time.sleep(wait_s)
        if then:
            s.sendall(then)
        s.setblocking(False)
        try:
            head = s.recv(64)
        except BlockingIOError:
            return "no answer"
        except OSError:
            return "closed"
    return head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "closed"


def held_open(port: int, count: int, data: bytes, hold_s: float) -> str:
    """`count` connections that each send `data` and then nothing for `hold_s`; how many the server closed."""
    sockets = []
    for _ in range(count):
        try:
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            sockets[-1].sendall(data)
        except OSError:
            break
    time.sleep(hold_s)
    closed = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            closed += sock.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        sock.close()
    return f"{closed} of {len(sockets)} closed"


def pipelined(port: int) -> str:
    """A request, and a POST pipelined behind it whose 64 KiB body comes later: both must be answered."""
    body = json.dumps({**GOOD, "state": "x" * (64 << 10)}).encode()
    head = (b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n")
    first = json.dumps(GOOD).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head % len(first) + first + head % len(body) + body[:100])
        time.sleep(0.5)
        s.sendall(body[100:])
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return "+".join(part.split(b" ", 1)[0].decode() for part in data.split(b"HTTP/1.1 ")[1:]) or "closed"


def cjk_state(chars: int) -> bytes:
    """A state of CJK characters as JSON escapes: under d1's character bound, far over its tokens."""
    return ('{"state": "' + "\\u4f60\\u597d" * (chars // 2) + '", "questions": {"q": {"type": "noul"}}}').encode()


def heaviest_valid(max_model_len: int) -> dict[str, object]:
    """64 questions over a state of 3,000 words (about 4 tokens each), or as many as the served model's
    max_model_len takes (a tiny checkpoint's is shorter): the heaviest request it must answer."""
    words = " ".join(f"word{i % 977}" for i in range(min(3000, max_model_len // 5)))
    return {"state": words, "questions": {f"q{i}": {"type": "noul", "instructions": f"Case {i}?"} for i in range(64)}}


def attacks(port: int, media: Path, drip_url: str, failing_url: str, endless_url: str,
            max_model_len: int) -> dict[str, object]:
    """Each attack: a JSON body (posted), or a callable that speaks raw HTTP (the status it saw, if any)."""
    one_bit = Image.new("1", (13_000, 13_000))
    (media / "bomb.png").write_bytes(saved(one_bit, "PNG"))
    (media / "bomb.tiff").write_bytes(saved(one_bit, "TIFF", compression="group4"))
    del one_bit
    (media / "bomb.gif").write_bytes(saved(Image.new("P", (13_000, 13_000)), "GIF"))
    (media / "bomb.webp").write_bytes(saved(Image.new("L", (10_000, 10_000)), "WEBP", lossless=True))
    (media / "photo.png").write_bytes(saved(Image.new("RGB", (640, 480), (90, 120, 150)), "PNG"))
    frame = base64.b64encode(saved(Image.new("RGB", (64, 64), (10, 20, 30)), "JPEG")).decode()
    # Under the request's pixel budget (68.9 megapixels, 2.7 KB): several at once meet the server's.
    wide_webp = base64.b64encode(saved(Image.new("RGB", (8300, 8300), (90, 120, 150)), "WEBP", lossless=True))
    q = {"q": NOUL}
    post_head = (b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n")
    return {
        "image_bombs": {"state": "x", "questions": q,
                        "images": [f"file://{media}/bomb.{ext}" for ext in ("png", "tiff", "gif", "webp")]},
        "slow_media": {"state": "x", "images": [f"{drip_url}/a.png", f"{drip_url}/b.png"], "questions": q},
        "bad_urls": {"state": "x", "images": ["http://[::1", "http://[zz]/", "http://[::7f00:1]/a.png",
                                             "http://[64:ff9b::7f00:1]/", f"file://{media}/a\u0000b.png",
                                             "file://" + str(media) + "/" + "n" * 5000], "questions": q},
        "jpeg_video_800": {"state": "x", "videos": ["data:video/jpeg;base64," + ",".join([frame] * 800)],
                           "questions": q},
        "big_state": {"state": "word " * 4_000_000, "questions": q},
        "many_questions": {"state": " ".join(f"w{i}" for i in range(60_000)),
                           "questions": {f"q{i}": NOUL for i in range(64)}},
        "huge_array": {"state": [0] * 3_000_000, "questions": q},
        # 800 KB; d1 would show it indented as 302 million characters
        "deep_lists": ('{"state": ' + "[" * 250 + ",".join(["[0]"] * 200_000) + "]" * 250
                       + ', "questions": {"q": {"type": "noul"}}}').encode(),
        "good_image": {"state": "x", "images": [f"file://{media}/photo.png"], "questions": q},
        "malformed": b'{"state": ',
        "gzip_trailing": ("gzip", gzip.compress(json.dumps(GOOD).encode()) + b"junk"),
        "aborted_upload": lambda: raw(port, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                            b"application/json\r\nContent-Length: 100000\r\n\r\n{\"state\": "),
        "slowloris": lambda: raw(port, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n", wait_s=2.0),
        "stalled_upload": lambda: raw(port, b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                            b"application/json\r\nContent-Length: 60000000\r\n\r\n{\"state\": \""
                                            + b"x" * (1 << 20), wait_s=5.0),
        # issue 50: declared bodies never sent, idle bodies at the connection cap's door, long texts, a short first
        # question before long ones, the heaviest valid request, pixel bombs under the request's budget, failing
        # and over-long downloads, pipelining, headers over the cap in one read, NAT64 and 192.0.0.0/24 hosts
        "declared_bodies": lambda: held_open(port, 16, post_head % (64 << 20), 5.0),
        "idle_bodies": lambda: held_open(port, 64, post_head % 1000, 5.0),
        "long_cjk_state": cjk_state(2_900_000),
        "short_first_long_others": {"state": "x", "questions": {
            "q0": NOUL, **{f"q{i}": {"type": "noul", "instructions": "word " * 300_000} for i in range(1, 15)}}},
        "heaviest_valid": heaviest_valid(max_model_len),
        "wide_webp": {"state": "x", "images": ["data:image/webp;base64," + wide_webp.decode()], "questions": q},
        "failing_urls": {"state": "x", "images": [f"{failing_url}/{i}.png" for i in range(4)], "questions": q},
        "refused_download": {"state": "x", "images": [f"{endless_url}/big.png"], "questions": q},
        "pipelined": lambda: pipelined(port),
        "headers_in_one_read": lambda: raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 60_000
                                           + b"\r\n\r\n", wait_s=0.5),
        "nat64_and_192_0_0": {"state": "x", "images": ["http://[64:ff9b::]/a.png", "http://192.0.0.9/a.png",
                                                       "http://[64:ff9b:1:7f00:1::]/a.png"], "questions": q},
    }


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--attackers", type=int, default=3, help="threads sending attacks")
    parser.add_argument("--good-interval", type=float, default=0.25, help="seconds between good requests")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--only", default=None, help="comma-separated attacks to send (default: every one)")
    parser.add_argument("--window-minutes", type=float, default=5.0, help="RSS floor and p99 reported per window")
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []  # after --: more flags for systemone serve
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    media = Path(tempfile.mkdtemp(prefix="soak-media-"))
    urls = {}
    for name, handler in (("drip", Drip), ("failing", Failing), ("endless", Endless)):
        origin = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        origin.daemon_threads = True
        threading.Thread(target=origin.serve_forever, daemon=True).start()
        urls[name] = f"http://127.0.0.1:{origin.server_address[1]}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # Its media servers are on loopback: fetched directly, whatever proxy the environment names.
    server = start_server(serve_command(args.artifact, port, "--allow-private-media-hosts", "--no-media-proxy",
                                        "--allowed-local-media-path", str(media), "--log-level", "warning",
                                        *serve_flags),
                          base, 300, stdout=subprocess.DEVNULL, stderr=open(media / "server.log", "wb"))
    try:
        max_model_len = httpx.get(base + "/v1/models").json()["data"][0]["max_model_len"]
        kinds = attacks(port, media, urls["drip"], urls["failing"], urls["endless"], max_model_len)
        if args.only:
            kinds = {kind: kinds[kind] for kind in args.only.split(",")}
        statuses: dict[str, Counter] = defaultdict(Counter)
        good_seconds: list[float] = []
        good_at: list[float] = []  # when each good request was sent, seconds from the start
        rss: list[tuple[float, float]] = []
        by_mapping: list[tuple[float, dict[str, float]]] = []
        samples: dict[str, str] = {}
        lock = threading.Lock()
        start = time.monotonic()
        end = start + args.minutes * 60
        post_headers = {"Content-Type": "application/json"}

        def send(kind: str, body: object, client: httpx.Client) -> None:
            if callable(body):
                try:
                    seen = body()
                except OSError as exc:
                    seen = type(exc).__name__
                with lock:
                    statuses[kind][seen] += 1
                return
            headers = dict(post_headers)
            if isinstance(body, tuple):
                headers["Content-Encoding"], content = body
            else:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
            t = time.monotonic()
            try:
                response = client.post(base + "/v1/systemone", content=content, headers=headers)
                status = response.status_code
                if status >= 500 or (kind == "good" and status != 200):
                    with lock:
                        samples.setdefault(f"{kind} {status}", response.text[:300])
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            with lock:
                statuses[kind][status] += 1
                if kind == "good":
                    good_seconds.append(time.monotonic() - t)
                    good_at.append(t - start)

        def attacker(seed: int) -> None:
            order = list(kinds)
            random.Random(seed).shuffle(order)
            with httpx.Client(timeout=120) as client:
                for kind in itertools.cycle(order):
                    if time.monotonic() >= end:
                        return
                    send(kind, kinds[kind], client)

        def good() -> None:
            with httpx.Client(timeout=120) as client:
                while time.monotonic() < end:
                    send("good", GOOD, client)
                    time.sleep(args.good_interval)

        threads = [threading.Thread(target=attacker, args=(i,)) for i in range(args.attackers)]
        threads.append(threading.Thread(target=good))
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            rss.append((time.monotonic() - start, rss_mb(server.pid)))
            if len(rss) % MAPPING_EVERY == 1:
                by_mapping.append((round(rss[-1][0]), resident_by_mapping(server.pid)))
            time.sleep(SAMPLE_S)
        rss.append((time.monotonic() - start, rss_mb(server.pid)))
        by_mapping.append((round(rss[-1][0]), resident_by_mapping(server.pid)))
    finally:
        server.terminate()
        server.wait(timeout=60)

    five_xx = {k: {s: n for s, n in c.items() if isinstance(s, int) and s >= 500 and not (s == 503 and k != "good")}
               for k, c in statuses.items()}
    window = args.window_minutes * 60
    windows = []
    for first in range(0, int(math.ceil(args.minutes * 60 / window))):
        low, high = first * window, (first + 1) * window
        rss_in = [m for t, m in rss if low <= t < high]
        good_in = [s for s, at in zip(good_seconds, good_at) if low <= at < high]
        windows.append({"minutes": f"{low / 60:g}-{high / 60:g}",
                        "rss_floor_mb": round(min(rss_in), 1) if rss_in else None, "good": len(good_in),
                        "good_p50_s": percentile(good_in, 50), "good_p99_s": percentile(good_in, 99)})
    warm = [m for t, m in rss if t >= min(60.0, args.minutes * 60 / 3)]
    report = {
        "minutes": args.minutes,
        "statuses": {k: {str(s): n for s, n in c.items()} for k, c in sorted(statuses.items())},
        "five_xx": {k: v for k, v in five_xx.items() if v},
        "good": {"count": len(good_seconds), "p50_s": percentile(good_seconds, 50),
                 "p99_s": percentile(good_seconds, 99), "max_s": max(good_seconds, default=float("nan"))},
        "rss_mb": {"start": rss[0][1] if rss else None, "peak": max((m for _, m in rss), default=None),
                   "after_warmup_min": min(warm, default=None), "after_warmup_max": max(warm, default=None),
                   "end": rss[-1][1] if rss else None},
        "unexpected_answers": samples,
        "windows": windows,
        "rss_series": [(round(t), round(m)) for t, m in rss],
        "rss_mb_by_mapping": by_mapping,
        "server_log_lines": sum(1 for _ in open(media / "server.log", "rb")),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if report["five_xx"] else 0


if __name__ == "__main__":
    sys.exit(main())
